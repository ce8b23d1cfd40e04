"""The engine's measured speeds (shoal.engine.speed): the decode step and how far steps fall from it."""

from __future__ import annotations

import pytest

from shoal.engine.speed import SpeedEstimator


def test_steady_steps_have_no_noise_and_unsteady_ones_their_relative_spread():
    steady, unsteady = SpeedEstimator(), SpeedEstimator()
    assert steady.decode_step_noise is None
    steady.seed(1000.0, 100.0, 0.05)
    unsteady.seed(1000.0, 100.0, 0.05)
    for i in range(400):
        steady.observe(0, 4, 0.05)
        unsteady.observe(0, 4, 0.04 if i % 2 else 0.06)  # 20 % either side of 50 ms
    assert steady.decode_step_s == pytest.approx(0.05) and steady.decode_step_noise == pytest.approx(0.0)
    assert unsteady.decode_step_s == pytest.approx(0.05, rel=0.05)
    assert unsteady.decode_step_noise == pytest.approx(0.2, rel=0.1)


def test_the_noise_forgets_a_disturbance_that_has_passed():
    """A stretch of steps twice as long (another process took the CPU), then steady ones again:
    the noise rises while it lasts and falls back as the reported step settles."""
    speed = SpeedEstimator()
    speed.seed(1000.0, 100.0, 0.05)
    for seconds in [0.05] * 50 + [0.1] * 20:
        speed.observe(0, 4, seconds)
    disturbed = speed.decode_step_noise
    assert disturbed > 0.3
    for _ in range(300):
        speed.observe(0, 4, 0.05)
    assert speed.decode_step_noise < 0.05


def test_prefill_steps_leave_the_decode_step_and_its_noise_alone():
    speed = SpeedEstimator()
    speed.seed(1000.0, 100.0, 0.05)
    speed.observe(0, 4, 0.05)
    before = (speed.decode_step_s, speed.decode_step_noise)
    speed.observe(500, 4, 0.9)
    assert (speed.decode_step_s, speed.decode_step_noise) == before


def test_one_stall_moves_the_noise_no_more_than_a_step_twice_as_long():
    """A step ten times the reported one (the process was descheduled) counts as a 100 % deviation."""
    stalled, doubled = SpeedEstimator(), SpeedEstimator()
    for speed, slow_step in ((stalled, 0.5), (doubled, 0.1)):
        speed.seed(1000.0, 100.0, 0.05)
        for _ in range(100):
            speed.observe(0, 4, 0.05)
        speed.observe(0, 4, slow_step)
    assert stalled.decode_step_noise == pytest.approx(doubled.decode_step_noise)
    assert stalled.decode_step_noise == pytest.approx(0.05**0.5, rel=0.01)
