"""bench/ttft_floor.py: the oracle replay of an engine's scheduler is exact (so the floor it reports is the
floor of the named unknowns, not of the replay), and the named unknowns order as measured."""
from __future__ import annotations

from bench import routing_des as des
from bench import ttft_floor as tf


def test_replay_is_exact_with_hindsight_and_phase_is_the_missing_signal() -> None:
    rec = tf.Recorder(4.0)
    des.simulate(des.unique_prompts(1, 34.88, 16, des.SLO_MS), "predicted_ttft", 4.0, rec)
    assert len(rec.done) > 200
    rows = tf.analyse(rec.done)
    assert {r[0] for r in rows} == {"0-h200-8b", "1-h200-8b", "2-l40s-8b", "3-l40s-8b"}
    for eng, n, online, cells, hind in rows:
        (blind, _), (blind_fill, _), (phase, _), (phase_fill, _) = cells
        assert hind < 0.005, (eng, hind)  # exact state + exact phase + the real co-scheduled tokens = the TTFT
        assert phase_fill <= phase < blind, (eng, cells)  # knowing where the step is matters most
        assert blind_fill <= blind
        assert 0.0 < online < 1.0
