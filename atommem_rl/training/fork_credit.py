"""Step-level credit from forked episodes (GRPO's ``fork_credit``): what the memory an episode built was worth,
apart from how its answer went.

Why. GRPO's terminal reward gives every step of an episode the same advantage, R - mean_group(R): an episode
that stored the right facts and then answered wrongly pushes its storing steps down as much as its answer
(AtomMem names this as its limitation). The environment is deterministic for a seed and an action sequence, so
the state an episode reached when its answer phase began can be rebuilt exactly (``run_rollouts(replay=...)``:
reset with the episode's seed, its recorded actions applied) and answered again.

Algorithm (Monte Carlo values at one fork point, as VinePPO estimates values by rollouts instead of a critic).
For every episode e of a group, with return R_e and fork point t_e (its first answer-phase step):

1. K forks restart from the state before step t_e and are sampled on by the policy to the end: returns
   F_e1..F_eK (the replayed steps' rewards included, so they compare with R_e). V_e = mean_j F_ej estimates the
   value of e's memory at answer time.
2. Q_e = (R_e + K V_e) / (K + 1): all K + 1 continuations from that state (the episode's own included).
3. The steps before t_e (reading the stream, writing memory) get A = Q_e - mean_group(Q): how much better this
   memory was than the group's. The steps from t_e on (answering) get A = R_e - V_e: how much better this
   answer was than the policy's other answers from the same memory (leave-one-out: the forks do not include
   the episode's own continuation, so the baseline is independent of it).
4. An episode without a fork point (no answer phase reached, or no step before it) has no forks: Q_e = R_e and
   every step gets Q_e - mean_group(Q), GRPO's advantage.

With K = 0 this is GRPO's (Dr. GRPO, no std scaling) advantage for every step. A group whose returns are all
equal can still carry signal: its memories may differ in value (some forks answer right).

Cost: K extra answer phases per episode (one generation round for a one-step answer phase), no extra
reading steps: the replay applies recorded actions without the policy.
"""

from __future__ import annotations

from collections.abc import Sequence


def fork_point(steps: Sequence[dict]) -> int | None:
    """Index of an episode's first answer-phase step, when steps come before it (else None: nothing to split)."""
    for i, step in enumerate(steps):
        if step.get("phase") == "answer":
            return i if i > 0 else None
    return None


def fork_plan(records: Sequence[dict], forks: int, seed: int) -> tuple[list[int], dict[int, dict]]:
    """The forks of this process's episodes: (owner episode of each fork, ``run_rollouts`` replay spec keyed by
    fork index). Episode k was reset with ``seed + k`` (``run_rollouts``), so its forks are too."""
    if forks < 0:
        raise ValueError(f"forks must be >= 0, got {forks}")
    owners: list[int] = []
    replay: dict[int, dict] = {}
    for k, rec in enumerate(records):
        t = fork_point(rec.get("steps") or [])
        if t is None or rec.get("crashed"):
            continue
        actions = [s["completion"] for s in rec["steps"][:t]]
        for _ in range(forks):
            replay[len(owners)] = {"seed": seed + k, "actions": actions}
            owners.append(k)
    return owners, replay


def fork_values(owners: Sequence[int], fork_returns: Sequence[float], episodes: int) -> list[float | None]:
    """V_e per episode: the mean return of its forks (None for an episode without forks)."""
    sums, counts = [0.0] * episodes, [0] * episodes
    for k, r in zip(owners, fork_returns, strict=True):
        sums[k] += float(r)
        counts[k] += 1
    return [s / c if c else None for s, c in zip(sums, counts, strict=True)]


def pooled_values(returns: Sequence[float], values: Sequence[float | None], forks: int) -> list[float]:
    """Q_e = (R_e + K V_e) / (K + 1), or R_e where an episode has no forks."""
    return [r if v is None else (r + forks * v) / (forks + 1) for r, v in zip(returns, values, strict=True)]


def step_advantages(returns: Sequence[float], values: Sequence[float | None], fork_points: Sequence[int | None],
                    step_counts: Sequence[int], group_baseline: Sequence[float], forks: int) -> list[list[float]]:
    """Per-step advantages of each episode (see the module docstring). ``group_baseline[e]`` is mean_group(Q)
    of e's group (computed over all processes)."""
    q = pooled_values(returns, values, forks)
    out = []
    for r, v, t, n, qe, b in zip(returns, values, fork_points, step_counts, q, group_baseline, strict=True):
        if v is None or t is None:
            out.append([qe - b] * n)
        else:
            out.append([qe - b if i < t else r - v for i in range(n)])
    return out
