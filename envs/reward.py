"""The terminal reward and the episode's outcome: each question's answer scored (EM, F1, LoCoMo F1, an LLM
judge, or the user's ``package.module:function``; an unanswered question scores 0 under the built-in ones), their mean as the score, plus optional shaping by evidence recall
at answer time (``evidence_bonus``) and relation-label accuracy (``relation_bonus``). Per-step format and
error penalties are the step's business (envs/core.py)."""

from __future__ import annotations

from typing import Any

from atommem_rl import scoring

from .config import EnvConfig


def finish(config: EnvConfig, questions: list, answers: dict[str, str], judge, gold_evidence: set[str],
           shown_units: set[str], relation_checks: dict[str, int],
           view_tokens: dict[str, int], terminated: bool, episode=None) -> tuple[float, dict[str, Any]]:
    """(shaped reward, outcome) of an episode that ended (``terminated``: every question answered, else
    cut short): the outcome holds the score, EM, F1, per-question records, evidence recall,
    relation accuracy, confounder-token share (None where nothing measures them) and, when the judge could
    not be reached, ``judge_errors`` (those questions score 0). With ``reward: package.module:function`` the
    user's function scores the episode (``episode``: a callable giving its record, built only then); the
    shaping terms are added to it the same way."""
    c = config
    outcome: dict[str, Any] = {}
    per_q = []
    for q in questions:
        pred = answers.get(q.id)
        cat = q.category if isinstance(q.category, int) else None
        em = scoring.exact_match(pred, q.answers) if pred is not None else 0.0
        f1 = scoring.f1(pred, q.answers) if pred is not None else 0.0
        if pred is None or scoring.is_custom_reward(c.reward):
            score = 0.0
        elif c.reward == "em":
            score = em
        elif c.reward == "f1":
            score = f1
        else:
            try:
                score = scoring.score_answer(c.reward, pred, q.answers, category=cat, question=q.question, judge=judge)
            except ConnectionError as exc:
                outcome.setdefault("judge_errors", []).append(str(exc)[:200])
                score = 0.0
        per_q.append({"id": q.id, "prediction": pred, "answers": q.answers, "em": em, "f1": f1, "score": score,
                      "category": q.category})
    n = max(1, len(per_q))
    score = sum(p["score"] for p in per_q) / n
    if scoring.is_custom_reward(c.reward):
        score, each = scoring.custom_reward(c.reward, [q.question for q in questions], [list(q.answers) for q in questions],
                                            [p["prediction"] for p in per_q], episode() if episode else {})
        for p, s in zip(per_q, each or [score] * len(per_q)):
            p["score"] = s
    recall = len(gold_evidence & shown_units) / len(gold_evidence) if gold_evidence else None
    rel = relation_checks
    rel_acc = rel["correct"] / rel["gold"] if rel["gold"] else None
    shaped = score + c.evidence_bonus * (recall or 0.0) + c.relation_bonus * (rel_acc or 0.0)
    tot = view_tokens["total"]
    outcome.update({
        "score": score, "em": sum(p["em"] for p in per_q) / n, "f1": sum(p["f1"] for p in per_q) / n,
        "questions": per_q, "evidence_recall": recall, "relation_accuracy": rel_acc,
        "confounder_token_share": (view_tokens["confounder"] / tot) if tot else None,
        "terminated": terminated,
    })
    return shaped, outcome
