"""The rollback verdict: an arm regressing beyond the thresholds against the stable arm, and only then."""
from __future__ import annotations

from gateway.rollouts.config import RollbackConfig
from gateway.rollouts.rollback import ArmStats, Window, p90, verdict

CFG = RollbackConfig(min_requests=20)


def test_an_error_rate_five_times_the_stable_arms_rolls_back() -> None:
    why = verdict(ArmStats(40, 10, 0.1), ArmStats(400, 20, 0.1), CFG)
    assert why is not None and "error rate" in why


def test_a_small_absolute_difference_is_not_a_regression() -> None:
    # 4x the stable rate but only 1.5 points above it: under the 5-point margin
    assert verdict(ArmStats(1000, 20, 0.1), ArmStats(1000, 5, 0.1), CFG) is None


def test_no_verdict_before_min_requests_on_either_arm() -> None:
    assert verdict(ArmStats(19, 19, None), ArmStats(400, 0, 0.1), CFG) is None
    assert verdict(ArmStats(40, 40, None), ArmStats(19, 0, 0.1), CFG) is None


def test_a_ttft_p90_regression_rolls_back() -> None:
    why = verdict(ArmStats(40, 0, 0.9), ArmStats(400, 0, 0.2), CFG)
    assert why is not None and "TTFT" in why
    assert verdict(ArmStats(40, 0, 0.25), ArmStats(400, 0, 0.2), CFG) is None


def test_disabled_never_rolls_back() -> None:
    assert verdict(ArmStats(40, 40, None), ArmStats(400, 0, 0.1), RollbackConfig(enabled=False)) is None


def test_the_window_forgets_outcomes_older_than_window_s() -> None:
    w = Window(10.0)
    for t in range(5):
        w.add(float(t), False, None)
    w.add(12.0, True, 0.3)
    s = w.stats(12.0)
    assert (s.requests, s.errors, s.ttft_p90_s) == (4, 3, 0.3)  # t=0 and 1 fell out (older than 2.0)
    assert w.stats(100.0).requests == 0


def test_p90_is_nearest_rank() -> None:
    assert p90([float(i) for i in range(1, 11)]) == 9.0
    assert p90([]) is None
    assert p90([0.5]) == 0.5
