"""The log-probability check that tells a text parting after a tie from a wrong one."""

from __future__ import annotations

from hpkv.bench.logprobs import _steps, check, power
from hpkv.bench.texts import compare_texts

SAME = [("a", -0.5, {"a": -0.5, "b": -1.5}), ("c", -0.2, {"c": -0.2, "d": -2.0})]


def test_equal_tokens_with_close_logprobs_are_right() -> None:
    near = [("a", -0.52, {"a": -0.52, "b": -1.5}), ("c", -0.19, {"c": -0.19, "d": -2.0})]
    right, first, diff, why = check(near, SAME, 0.1)
    assert (right, first, why) == (True, 2, "equal") and abs(diff - 0.02) < 1e-9
    assert not check(near, SAME, 0.01)[0]


def test_a_tie_in_both_runs_is_right_and_anything_else_is_wrong() -> None:
    ref = [("a", -0.5, {"a": -0.5, "b": -1.5}), ("c", -0.70, {"c": -0.70, "d": -0.72})]
    tie = [("a", -0.5, {"a": -0.5, "b": -1.5}), ("d", -0.70, {"d": -0.70, "c": -0.71})]
    right, first, _, why = check(tie, ref, 0.1)
    assert (right, first) == (True, 1) and "tie" in why
    # The same parting where the reference preferred its token by far: wrong.
    clear = [("a", -0.5, {"a": -0.5, "b": -1.5}), ("c", -0.1, {"c": -0.1, "d": -3.0})]
    right, _, _, why = check(tie, clear, 0.1)
    assert not right and "differ by 2.3 by token 1" in why
    # Candidates that agree, at a token where the reference's choice led by more than a tie: wrong.
    lead = [("a", -0.5, {"a": -0.5, "b": -1.5}), ("c", -0.5, {"c": -0.5, "d": -0.65})]
    right, _, _, why = check([lead[0], ("d", -0.56, {"d": -0.56, "c": -0.57})], lead, 0.1)
    assert not right and "not a tie" in why
    # A token the other run did not even rank: wrong.
    other = [("a", -0.5, {"a": -0.5, "b": -1.5}), ("z", -0.70, {"z": -0.70, "d": -0.71})]
    assert not check(other, ref, 0.1)[0]
    # Equal tokens whose log-probabilities moved beyond the tolerance before the parting: wrong.
    moved = [("a", -0.9, {"a": -0.9, "b": -1.5}), ("d", -0.70, {"d": -0.70, "c": -0.71})]
    assert not check(moved, ref, 0.1)[0]
    assert not check(SAME[:1], SAME, 0.1)[0]  # fewer tokens


def test_steps_read_vllms_streamed_logprobs() -> None:
    chunk = {"tokens": ["x", "y"], "token_logprobs": [-0.1, -0.3], "top_logprobs": [{"x": -0.1}, {"y": -0.3}]}
    assert _steps(chunk) == [("x", -0.1, {"x": -0.1}), ("y", -0.3, {"y": -0.3})]
    assert _steps(None) == []


def test_compare_texts_counts_ties_as_right_and_measures_the_checks_power() -> None:
    level = {"concurrency": 2.0}
    tie = [("a", -0.5, {"a": -0.5, "b": -1.5}), ("d", -0.70, {"d": -0.70, "c": -0.71})]
    ref_tie = [("a", -0.5, {"a": -0.5, "b": -1.5}), ("c", -0.70, {"c": -0.70, "d": -0.72})]
    far = [("q", -0.1, {"q": -0.1, "r": -4.0}), ("s", -0.1, {"s": -0.1})]
    none = {"system": "none", "level": level, "texts": ["ac", "qs"], "steps": [ref_tie, far],
            "turns": [(0, 0), (1, 0)]}  # fmt: skip
    hpkv = {"system": "hpkv", "level": level, "texts": ["ad", "qs"], "steps": [tie, far],
            "turns": [(0, 0), (1, 0)]}  # fmt: skip
    runs = [none, hpkv]
    compare_texts(runs, 0.1)
    assert hpkv["texts_equal_to_none"] == [1, 2]
    assert hpkv["texts_right"] == [2, 2] and hpkv["wrong"] == []
    assert [t["request"] for t in hpkv["ties"]] == [0]
    assert hpkv["check_power"] == [0, 2]  # each turn against the other user's (one turn each): never right
    assert power([far], [far], [0], 0.1) == 1
