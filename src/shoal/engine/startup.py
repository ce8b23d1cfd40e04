"""A served engine's start: built and calibrated on the engine thread, the one thread of the
process that runs torch (see async_engine for why one thread)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from shoal.config.engine import EngineConfig
from shoal.engine.async_engine import AsyncLLMEngine
from shoal.engine.calibration import Calibration, calibrate, calibration_path
from shoal.engine.engine import LLMEngine


def start_engine(
    config: EngineConfig, cache_root: Path, on_replica_failure: Callable[[str], None] | None = None
) -> tuple[AsyncLLMEngine, Calibration]:
    """The running engine and its calibration (figures kept under cache_root). Raises what building
    the engine raised (a bad model, a configuration this machine cannot hold)."""
    engine = AsyncLLMEngine(lambda: LLMEngine(config, on_replica_failure=on_replica_failure))
    calibration = engine.call_sync(lambda inner: calibrate(inner, calibration_path(inner, cache_root)))
    return engine, calibration
