"""The environment variables that shape an engine process wherever it runs.

A launcher that starts workers on other machines (Ray) passes on those of `NODE_VARIABLES` that are
set where `shoal serve` runs, so a cap the operator chose holds on every node, not only on this one.
"""

from __future__ import annotations

from collections.abc import Mapping

CPU_ISA_VARIABLE = "SHOAL_CPU_ISA"
NODE_VARIABLES = (CPU_ISA_VARIABLE,)


def node_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `NODE_VARIABLES` that are set in `environ`."""
    return {name: environ[name] for name in NODE_VARIABLES if name in environ}
