"""Held-out statistics shared by the quickstart, its report and scripts/confirm_heldout.py: the mean and
standard error of per-episode scores, paired differences on the same tasks, and the beyond-noise verdict
(more than 2 standard errors of the paired difference away from 0)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def mean_se(xs: list[float]) -> dict:
    """Mean and standard error of the mean (sample std / sqrt(n))."""
    n = len(xs)
    if n == 0:
        return {"n": 0, "mean": None, "se": None}
    m = sum(xs) / n
    var = sum((x - m) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return {"n": n, "mean": m, "se": math.sqrt(var / n)}


def verdict(diff: dict) -> str:
    """Is a paired difference (``mean_se`` of per-task differences) beyond noise: more than 2 SE from 0?"""
    if diff["mean"] - 2 * diff["se"] > 0:
        return "beyond noise"
    if diff["mean"] + 2 * diff["se"] < 0:
        return "WORSE, beyond noise"
    return "NOT beyond noise (within 2 standard errors)"


def paired_summary(sft: dict, grpo: dict, diff: dict) -> str:
    """One line for the held-out EM of SFT and GRPO (``mean_se``) and their paired difference with its
    verdict; printed by scripts/learning_signal.sh and scripts/confirm_heldout.py."""
    return (f"SFT {sft['mean']:.3f} ± {sft['se']:.3f}, GRPO {grpo['mean']:.3f} ± {grpo['se']:.3f} over "
            f"{diff['n']} episodes; GRPO - SFT {diff['mean']:+.3f} ± {diff['se']:.3f}: {verdict(diff)}")


PAIRS = (("checkpoint:sft", "checkpoint:base"), ("checkpoint:grpo", "checkpoint:sft"),
         ("checkpoint:grpo", "checkpoint:base"))


def episode_scores(trajectories: str | Path) -> dict[str, dict[str, dict[str, float]]]:
    """{method: {task id: {"em", "f1"}}}: each held-out episode's scores (the mean over its questions)."""
    per: dict[str, dict[str, dict[str, float]]] = {}
    for line in Path(trajectories).read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        qs = r["questions"]
        if qs:
            per.setdefault(r["method"], {})[r["task_id"]] = {
                "em": sum(q["em"] for q in qs) / len(qs), "f1": sum(q["f1"] for q in qs) / len(qs)}
    return per


def episode_stats(trajectories: str | Path, pairs=PAIRS) -> dict:
    """Per method: mean and standard error over held-out episodes of the episode's EM and F1
    (mean over its questions), plus the paired differences ``a - b`` on the same tasks for each
    (a, b) in ``pairs`` whose methods both ran (keyed "grpo - sft": the names after ``checkpoint:``)."""
    per = episode_scores(trajectories)
    out = {m: {k: mean_se([v[k] for v in by.values()]) for k in ("em", "f1")} for m, by in per.items()}
    for a, b in pairs:
        if a in per and b in per:
            common = sorted(set(per[a]) & set(per[b]))
            out[f"{a.split(':')[1]} - {b.split(':')[1]}"] = {
                k: mean_se([per[a][t][k] - per[b][t][k] for t in common]) for k in ("em", "f1")}
    return out
