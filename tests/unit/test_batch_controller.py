"""The adaptive batch size shrinks when steps are slower than the target and grows under load."""

from __future__ import annotations

from shoal.engine.batch_controller import BatchSizeController


def test_without_a_target_the_limit_is_the_maximum():
    controller = BatchSizeController(maximum=64, target_ms=None)
    controller.observe(step_ms=1000.0, running=64, waiting=10)
    assert controller.limit == 64


def test_slow_steps_shrink_and_fast_steps_under_load_grow():
    controller = BatchSizeController(maximum=64, target_ms=50.0)
    start = controller.limit
    for _ in range(20):
        controller.observe(step_ms=20.0, running=controller.limit, waiting=5)
    assert controller.limit == min(64, start + 20)
    grown = controller.limit
    controller.observe(step_ms=80.0, running=grown, waiting=5)
    assert controller.limit == grown * 3 // 4
    for _ in range(50):
        controller.observe(step_ms=500.0, running=controller.limit, waiting=5)
    assert controller.limit == 1


def test_idle_fast_steps_do_not_grow_the_limit():
    controller = BatchSizeController(maximum=64, target_ms=50.0)
    start = controller.limit
    controller.observe(step_ms=5.0, running=2, waiting=0)
    assert controller.limit == start


def test_engine_holds_the_latency_target(make_tiny_engine):
    """With an unreachable target the limit falls to 1: once the first wave (admitted before the
    controller had measured anything) drains, later requests run one at a time. All finish."""
    from shoal.engine.sampling_params import SamplingParams
    from tests.support.engine_runs import run_to_completion

    engine = make_tiny_engine(itl_target_ms=1e-6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    running_sets = []
    original = engine.scheduler.schedule

    def spy(limit=None, *args, **kwargs):
        chunks = original(limit, *args, **kwargs)
        running_sets.append({s.request_id for s in engine.scheduler.running})
        return chunks

    engine.scheduler.schedule = spy
    results = run_to_completion(engine, {f"r{i}": ([5 + i, 6, 7], params) for i in range(12)})
    assert len(results) == 12 and all(len(t) == 6 for t in results.values())
    assert engine.stats().batch_size_limit == 1
    first_wave = running_sets[0]
    assert len(first_wave) == 8
    later = [ids - first_wave for ids in running_sets]
    assert max(len(ids) for ids in later) == 1
