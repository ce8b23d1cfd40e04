"""The admission class of a request, as a router tells it to the worker that runs it: the
`x-shoal-priority` header (critical, standard, sheddable, or batch, the class of a router's batch
work). A shoal worker schedules batch work in the engine's background class (it sits out the steps
in which interactive requests prefill); other engines ignore the header."""

from __future__ import annotations

from collections.abc import Mapping

PRIORITY_HEADER = "x-shoal-priority"
BATCH = "batch"


def scheduling_class(headers: Mapping[str, str]) -> str:
    """The engine scheduling class (engine.sequence.SCHEDULING_CLASSES) for a request's headers."""
    return "background" if headers.get(PRIORITY_HEADER) == BATCH else "interactive"
