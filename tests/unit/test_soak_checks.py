"""The soak's answer check: a tie broken the other way passes apart, anything else that differs is wrong; and its
warm-up asks distinct prompt lengths."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import soak  # noqa: E402


def _choice(tokens: list[int], chosen: list[float], tops: list[dict[str, float]]) -> dict:
    return {"token_ids": tokens, "logprobs": {"token_logprobs": chosen, "top_logprobs": tops}}


REFERENCE = _choice([5, 7, 9], [-1.0, -2.0, -3.0], [{"a": -1.0, "b": -3.0}, {"c": -2.0, "d": -2.05}, {"e": -3.0, "f": -4.0}])


def test_the_same_answer_within_one_bfloat16_step_is_the_same():
    answer = _choice([5, 7, 9], [-1.06, -2.0, -2.94], REFERENCE["logprobs"]["top_logprobs"])
    assert soak.compare_answer(answer, REFERENCE) == "same"


def test_a_tie_broken_the_other_way_is_a_near_tie():
    # Position 1: the same two candidates on top in both, within a step of each other, the other one chosen.
    answer = _choice([5, 8, 1], [-1.0, -2.0, -0.5], [{"a": -1.0, "b": -3.0}, {"c": -2.04, "d": -2.0}, {"x": -0.5}])
    assert soak.compare_answer(answer, REFERENCE) == "near tie"


def test_a_flat_distribution_with_other_candidates_is_wrong():
    # The reference's top two lie within the tie margin, but the answer ranked another token second: its
    # distribution moved (the old check, which looked at the reference's top two only, called this a tie).
    answer = _choice([5, 8, 1], [-1.0, -2.0, -0.5], [{"a": -1.0, "b": -3.0}, {"c": -2.04, "z": -2.0}, {"x": -0.5}])
    assert soak.compare_answer(answer, REFERENCE) == "wrong"


def test_the_same_candidates_with_moved_logprobs_are_wrong():
    answer = _choice([5, 8, 1], [-1.0, -1.5, -0.5], [{"a": -1.0, "b": -3.0}, {"c": -2.0, "d": -1.5}, {"x": -0.5}])
    assert soak.compare_answer(answer, REFERENCE) == "wrong"


def test_a_drift_before_the_first_difference_is_wrong():
    answer = _choice([5, 7, 9], [-1.3, -2.0, -3.0], REFERENCE["logprobs"]["top_logprobs"])
    assert soak.compare_answer(answer, REFERENCE) == "wrong"


def test_a_shorter_answer_is_wrong():
    answer = _choice([5, 7], [-1.0, -2.0], REFERENCE["logprobs"]["top_logprobs"][:2])
    assert soak.compare_answer(answer, REFERENCE) == "wrong"


def test_warmup_lengths_are_distinct_and_span_the_contexts():
    lengths = soak.warmup_lengths(96, 6000)
    assert len(set(lengths)) == 96 and lengths[0] == 16 and lengths[-1] == 6000
    assert soak.warmup_lengths(1, 6000) == [6000]
