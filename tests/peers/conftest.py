"""The GGUF goldens' figures at the end of the run, one line a file, whether the tests passed or not."""

from __future__ import annotations

from tests.support.gguf_goldens import RESULTS


def pytest_terminal_summary(terminalreporter) -> None:
    if RESULTS:
        terminalreporter.section("GGUF goldens: shoal against llama.cpp on the same file")
        for result in RESULTS:
            terminalreporter.write_line(result.line())
