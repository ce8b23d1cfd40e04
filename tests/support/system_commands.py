"""System programs the tests start (redis-server, haproxy, nft): installed from the distribution's
packages when missing, by scripts/ensure_command.sh."""

from __future__ import annotations

import subprocess
from pathlib import Path

ENSURE_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ensure_command.sh"


def ensure_command(command: str, package: str | None = None) -> str:
    """The path of `command`, once its package (`package`, default the command's name) is installed."""
    argv = [str(ENSURE_SCRIPT), command, *([package] if package else [])]
    found = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=600)
    return found.stdout.strip().splitlines()[-1]
