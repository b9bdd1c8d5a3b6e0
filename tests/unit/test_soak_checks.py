"""The soak's answer check: a tie broken the other way passes apart, anything else that differs is wrong; and its
warm-up asks distinct prompt lengths."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import soak  # noqa: E402


def _choice(tokens: list[str], chosen: list[float], tops: list[dict[str, float]]) -> dict:
    ids = [ord(token) for token in tokens]
    return {"token_ids": ids, "logprobs": {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops}}


TOPS = [{"a": -1.0, "b": -3.0}, {"c": -2.0, "d": -2.05, "g": -2.1}, {"e": -3.0, "f": -4.0}]
REFERENCE = _choice(["a", "c", "e"], [-1.0, -2.0, -3.0], TOPS)


def verdict(answer: dict) -> str:
    return soak.compare_answer(answer, REFERENCE)[0]


def test_the_same_answer_within_one_bfloat16_step_is_the_same():
    assert verdict(_choice(["a", "c", "e"], [-1.06, -2.0, -2.94], TOPS)) == "same"


def test_a_tie_broken_the_other_way_is_a_near_tie():
    # Position 1: both computations have c and d within a step of each other; this one chose d.
    answer = _choice(["a", "d", "x"], [-1.0, -2.0, -0.5], [TOPS[0], {"c": -2.04, "d": -2.0, "g": -2.1}, {"x": -0.5}])
    assert verdict(answer) == "near tie"


def test_a_tie_of_three_broken_to_the_third_is_a_near_tie():
    # The reference ranked c, d, g within a step; this one chose g (its second is not the reference's second).
    answer = _choice(["a", "g", "x"], [-1.0, -2.0, -0.5], [TOPS[0], {"g": -2.0, "c": -2.03, "h": -2.05}, {"x": -0.5}])
    assert verdict(answer) == "near tie"


def test_a_token_the_reference_did_not_rank_is_wrong():
    answer = _choice(["a", "z", "x"], [-1.0, -2.0, -0.5], [TOPS[0], {"z": -2.0, "c": -2.04}, {"x": -0.5}])
    assert verdict(answer) == "wrong"


def test_the_same_candidates_with_moved_logprobs_are_wrong():
    # d and c tie in the reference, but this computation puts d 0.5 above c: its distribution moved.
    answer = _choice(["a", "d", "x"], [-1.0, -1.5, -0.5], [TOPS[0], {"d": -1.5, "c": -2.0}, {"x": -0.5}])
    assert verdict(answer) == "wrong"


def test_a_drift_before_the_first_difference_is_wrong():
    assert verdict(_choice(["a", "c", "e"], [-1.3, -2.0, -3.0], TOPS)) == "wrong"


def test_a_shorter_answer_is_wrong():
    assert verdict(_choice(["a", "c"], [-1.0, -2.0], TOPS[:2])) == "wrong"


def test_warmup_lengths_are_distinct_and_span_the_contexts():
    lengths = soak.warmup_lengths(96, 6000)
    assert len(set(lengths)) == 96 and lengths[0] == 16 and lengths[-1] == 6000
    assert soak.warmup_lengths(1, 6000) == [6000]
