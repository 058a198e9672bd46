"""Scoring against hand-computed examples of the official HotpotQA and LoCoMo rules."""

from __future__ import annotations

import math

import pytest

from atommem_rl import scoring as S


def test_hotpotqa_normalisation_and_em():
    assert S.normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert S.normalize_answer("An apple, a day") == "apple day"
    assert S.exact_match("the Beatles.", ["Beatles"]) == 1.0
    assert S.exact_match("Beatles band", "Beatles") == 0.0
    assert S.exact_match("Paris", ["Lyon", "paris"]) == 1.0
    assert S.exact_match(None, "x") == 0.0 and S.exact_match(42, "42") == 1.0


def test_hotpotqa_f1_hand_computed():
    # pred "new york city" vs gold "the city of new york": normalised gold "city of new york" (4 tokens);
    # common = {new, york, city} = 3; P = 3/3, R = 3/4, F1 = 2*1*0.75/1.75 = 6/7
    assert S.f1("New York City", "the city of New York") == pytest.approx(6 / 7)
    # yes/no must match exactly: "yes it is" vs "yes" scores 0, not the token F1 of 0.5
    assert S.f1("yes it is", "yes") == 0.0
    assert S.f1("no", "no") == 1.0
    assert S.f1("Barack Obama", ["Obama", "Barack Hussein Obama"]) == pytest.approx(max(2 / 3, 0.8))


def test_locomo_rules_hand_computed():
    # Porter stemming: "running dogs" vs "run dog" -> identical stems -> 1.0
    assert S.locomo_f1("running dogs", "run dog", 4) == 1.0
    # category 1: gold split on commas, each sub-answer takes its best prediction part
    # gold "Paris, Rome": pred "Paris" -> sub F1 (1 + 0) / 2 = 0.5
    assert S.locomo_f1("Paris", "Paris, Rome", 1) == pytest.approx(0.5)
    assert S.locomo_f1("Rome, Paris", "Paris, Rome", 1) == 1.0
    # category 3: only the gold before ";" counts
    assert S.locomo_f1("likely yes", "Likely yes; she loves art", 3) == 1.0
    # category 5: correct only when it says no information / not mentioned
    assert S.locomo_f1("This is not mentioned in the conversation", "x", 5) == 1.0
    assert S.locomo_f1("Paris", "x", 5) == 0.0
    # plain token F1 otherwise: "7 May 2023" vs "May 7, 2023" -> same tokens -> 1.0 (commas removed)
    assert S.locomo_f1("7 May 2023", "May 7, 2023", 2) == 1.0
    # partial: pred "a painting of sunset" -> tokens painting, of, sunset (3); gold "sunset" (1) -> P 1/3 R 1 -> 0.5
    assert S.locomo_f1("a painting of sunset", "sunset", 4) == pytest.approx(0.5)
    assert S.score_answer("locomo_f1", "sunset", ["sunrise", "Sunset"], category=4) == 1.0


def test_bleu1_hand_computed():
    # pred 2 tokens (cat sat), ref 4 (cat sat on mat): precision 1, brevity penalty exp(1 - 4/2)
    assert S.bleu1("the cat sat", "the cat sat on the mat") == pytest.approx(math.exp(-1))
    # pred longer than ref: no penalty; clipped counts: "cat cat cat" vs "cat" -> 1/3
    assert S.bleu1("cat cat cat", "cat") == pytest.approx(1 / 3)
    assert S.bleu1("dog", "cat") == 0.0
    assert S.bleu1("Paris", ["Lyon", "paris"]) == 1.0
    assert S.score_answer("bleu1", "cat", "cat") == 1.0


def test_relation_scores_hand_computed():
    pairs = [("conflict", "conflict"), ("equivalent", "conflict"), ("equivalent", "equivalent"),
             ("independent", "independent")]
    r = S.relation_scores(pairs)
    assert r["accuracy"] == 0.75
    # conflict: P 1/1, R 1/2 -> 2/3; equivalent: P 1/2, R 1/1 -> 2/3; independent: 1 -> macro (2/3+2/3+1)/3
    assert r["macro_f1"] == pytest.approx((2 / 3 + 2 / 3 + 1) / 3)
    assert S.relation_scores([])["accuracy"] is None
