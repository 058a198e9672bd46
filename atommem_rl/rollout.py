"""Rollouts: run a policy on tasks, every active episode of a step batched into one policy call.

Algorithm. ``run_rollouts(tasks, policy, env_config, batch_size)`` keeps up to ``batch_size``
episodes open; each iteration collects the current observation of every open episode, asks the
policy for all actions at once (``policy.act(batch)``: one generation call for a model policy),
steps each environment, records the step (prompt messages, completion, reward, tool results), and
replaces finished episodes with new tasks. An exception inside an environment step is a *crash*: it
is counted, the traceback is recorded in the trajectory, and the episode is closed (the policy can
never cause one: the environments turn every bad action into an error observation).

Trajectories (one JSON object per episode) hold the task id, per-step records
``{"prompt": messages, "completion": text, "reward": x, "results": [...], "phase": ...}`` and the
outcome (score, em, f1, per-question predictions, evidence recall, relation accuracy, confounder
token share, op counts, tokens). ``summarize`` gives the JSON that ``atommem rollout`` prints
(DESIGN.md section 4).

Launch: ``atommem rollout --tasks FILE --policy oracle --out runs/oracle.jsonl``.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from envs import make_env
from envs.core import OPS

from .policies.base import Policy
from .tasks.schema import Task


def make_policy(name: str, **kw) -> Policy:
    """oracle | heuristic | random | fuzz | model (keywords go to the policy's constructor)."""
    if name == "oracle":
        from .policies.oracle import OraclePolicy

        return OraclePolicy(**kw)
    if name == "heuristic":
        from .policies.heuristic import HeuristicPolicy

        return HeuristicPolicy(**kw)
    if name == "random":
        from .policies.scripted import RandomPolicy

        return RandomPolicy(**kw)
    if name == "fuzz":
        from .policies.scripted import FuzzPolicy

        return FuzzPolicy(**kw)
    if name == "model":
        from .policies.model import ModelPolicy

        return ModelPolicy(**kw)
    raise ValueError(f"unknown policy {name!r}; expected oracle, heuristic, random, fuzz or model")


def run_rollouts(tasks: Iterable[Task], policy: Policy, env_config: dict | None = None, *,
                 batch_size: int = 8, seed: int = 0, record_prompts: bool = True,
                 on_episode=None) -> list[dict]:
    """Run one episode per task; returns the trajectories (also passed to ``on_episode`` as they end)."""
    env_config = dict(env_config or {})
    queue = list(tasks)
    queue.reverse()
    active: dict[int, dict] = {}
    done: list[dict] = []
    counter = 0

    def open_next() -> None:
        nonlocal counter
        task = queue.pop()
        key = counter
        counter += 1
        rec = {"task_id": task.id, "source": task.source, "kind": task.kind, "policy": policy.name, "steps": [],
               "crashed": False, "started": time.perf_counter()}
        env = make_env(task, **env_config)  # a configuration error raises here: the caller's bug
        obs, info = env.reset(seed=seed + key)
        policy.start(key, task)
        active[key] = {"env": env, "obs": obs, "info": info, "rec": rec, "return": 0.0}

    def close(key: int, info: dict | None) -> None:
        st = active.pop(key)
        rec = st["rec"]
        env = st["env"]
        info = info or st["info"]
        rec["return"] = st["return"]
        rec["seconds"] = time.perf_counter() - rec.pop("started")
        for k in ("score", "em", "f1", "questions", "evidence_recall", "relation_accuracy",
                  "confounder_token_share", "terminated", "ops", "tool_errors", "format_errors", "tokens",
                  "relation_checks", "judge_errors"):
            if k in info:
                rec[k] = info[k]
        rec.setdefault("score", 0.0)
        rec.setdefault("em", 0.0)
        rec.setdefault("f1", 0.0)
        rec["memory"] = env.memory_snapshot() if record_prompts else None
        env.close()
        policy.end(key)
        done.append(rec)
        if on_episode is not None:
            on_episode(rec)

    while queue or active:
        while queue and len(active) < batch_size:
            open_next()
        keys = list(active)
        batch = [(k, active[k]["obs"], active[k]["info"]) for k in keys]
        actions = policy.act(batch)
        for k, action in zip(keys, actions):
            st = active[k]
            try:
                obs, reward, terminated, truncated, info = st["env"].step(action)
            except Exception:  # noqa: BLE001 - a crash is a finding, recorded and counted
                st["rec"]["crashed"] = True
                st["rec"]["traceback"] = traceback.format_exc()
                close(k, None)
                continue
            st["return"] += reward
            st["rec"]["steps"].append({
                "phase": st["info"].get("phase"),
                "prompt": st["obs"] if record_prompts else None,
                "completion": action,
                "reward": reward,
                "results": info.get("results"),
                "prompt_tokens": st["info"].get("prompt_tokens"),
            })
            st["obs"], st["info"] = obs, info
            if terminated or truncated:
                close(k, info)
    return done


def summarize(trajectories: list[dict], policy: str) -> dict:
    """The ``atommem rollout`` summary (DESIGN.md section 4); em and f1 in 0-1."""
    n = len(trajectories)
    ops = {op: 0 for op in OPS}
    tokens = {"prompt": 0, "completion": 0}
    tool_errors = 0
    for t in trajectories:
        for op, c in (t.get("ops") or {}).items():
            ops[op] = ops.get(op, 0) + c
        for k in tokens:
            tokens[k] += (t.get("tokens") or {}).get(k, 0)
        tool_errors += t.get("tool_errors", 0)

    def mean(key):
        vals = [t[key] for t in trajectories if t.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    return {
        "episodes": n,
        "policy": policy,
        "mean_reward": mean("return") or 0.0,
        "em": mean("em") or 0.0,
        "f1": mean("f1") or 0.0,
        "crashes": sum(1 for t in trajectories if t.get("crashed")),
        "tool_errors": tool_errors,
        "ops": ops,
        "tokens": tokens,
        "evidence_recall": mean("evidence_recall"),
        "relation_accuracy": mean("relation_accuracy"),
        "confounder_token_share": mean("confounder_token_share"),
        "truncated": sum(1 for t in trajectories if t.get("terminated") is False),
    }


def write_jsonl(records: Iterable[dict], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, default=str) + "\n")  # ASCII: completions may hold lone surrogates


def load_policy_kwargs(spec: str | None) -> dict[str, Any]:
    return json.loads(spec) if spec else {}
