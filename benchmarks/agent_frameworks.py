"""The agent frameworks people point at an OpenAI-compatible endpoint (openai-agents with its chat
and Responses models, pydantic-ai, instructor in TOOLS, JSON_SCHEMA and JSON modes, LangChain), run
unchanged against `shoal serve` with the bundled model: every call must get through; what a 135M
model cannot do (valid output for a schema it was not held to) is reported as the model's, and a
refused request (HTTP 4xx) as a failure. The frameworks live in their own venv
(benchmarks/.peers/agent-frameworks, from PyPI on first use); the checks are
agent_framework_checks.py.

    .venv/bin/python benchmarks/agent_frameworks.py        # prints a line a check; results/ gets the JSON
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
from peer_venv import peer_python

from shoal.processes import free_port

HERE = Path(__file__).resolve().parent
FRAMEWORKS = ("openai-agents", "pydantic-ai-slim[openai]", "instructor", "langchain-openai")
MODEL = "smollm2-135m-instruct"


def main() -> int:
    python = peer_python("agent-frameworks", FRAMEWORKS, print)
    port = free_port()
    log = (python.parent.parent / "shoal-serve.log").open("w")  # in the frameworks' (ignored) venv
    server = subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve", "--port", str(port)], stdout=log, stderr=log)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        checks = subprocess.run(
            [str(python), str(HERE / "agent_framework_checks.py"), url + "/v1", MODEL],
            capture_output=True,
            text=True,
            timeout=1800,
            check=True,
        )
    finally:
        server.terminate()
        server.wait(timeout=60)
    results = json.loads(checks.stdout)
    versions = subprocess.run(
        [str(python), "-m", "pip", "list", "--format", "json"], capture_output=True, text=True, check=True
    ).stdout
    wanted = {"openai", "openai-agents", "pydantic-ai-slim", "instructor", "langchain-openai", "langchain-core"}
    packages = {p["name"]: p["version"] for p in json.loads(versions) if p["name"] in wanted}
    for name, result in results.items():
        detail = " ".join(result.get("detail", "").split())
        print(f"{name:34s} {result['result']:8s} {detail[:100]}")
    counts = {
        kind: sum(r["result"] == kind for r in results.values()) for kind in ("passed", "model", "refused", "error")
    }
    print(f"{counts} with {packages}")
    out = HERE / "results" / f"agent-frameworks-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps({"packages": packages, "counts": counts, "results": results}, indent=1))
    print(f"wrote {out}")
    return 0 if counts["refused"] == counts["error"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
