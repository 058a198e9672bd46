"""Step-wise demonstrations for SFT: one (prompt, assistant-with-tool-calls) example per episode step.

Interchange format (JSONL, one row per step)::

    {"messages": [{"role": "system", ...}, {"role": "user", ...},
                  {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                   "function": {"name": "create_memory", "arguments": {"content": "..."}}}]}],
     "tools": [<JSON schemas of the tools the environment offered at that step>], "meta": {...}}

``messages`` is the step's observation (the environment's chat messages) followed by the policy's
action as an assistant message whose ``<tool_call>`` blocks are parsed into ``tool_calls``, so the
chat template renders them in Qwen3's canonical format. Rows may hold several turns (e.g. teacher
traces with ``tool`` messages); SFT puts loss on assistant tokens only.

Sources: a JSONL file written by anything (``demonstrations: FILE`` in the SFT recipe), or
episodes run here with a demonstration policy on tasks (:func:`generate`): the oracle policy, or a
teacher model behind an OpenAI-compatible endpoint with rejection sampling (an episode is kept only
when its terminal reward reaches ``min_reward``; up to ``samples`` tries per task).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

ROLES = ("system", "user", "assistant", "tool")


class DemonstrationError(ValueError):
    """A demonstration file or row is invalid (the message names the file and line)."""


def assistant_message(action: str) -> dict | None:
    """The policy's raw text -> an assistant message with parsed ``tool_calls`` (None if malformed)."""
    from envs.parser import OPEN, parse_tool_calls

    calls, errors = parse_tool_calls(action)
    if errors:
        return None
    text = action.split(OPEN, 1)[0] if OPEN in action else action
    if "</think>" in text:
        text = text.split("</think>", 1)[1]
    msg: dict[str, Any] = {"role": "assistant", "content": text.strip()}
    if calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in calls]
    return msg


def step_row(observation: list[dict], action: str, tools: list[dict], meta: dict | None = None) -> dict | None:
    """One interchange row for one step, or None when the action's tool calls do not parse."""
    msg = assistant_message(action)
    if msg is None:
        return None
    row = {"messages": [dict(m) for m in observation] + [msg], "tools": tools}
    if meta:
        row["meta"] = meta
    return row


def check_row(row: Any, where: str) -> dict:
    if not isinstance(row, dict):
        raise DemonstrationError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    msgs = row.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise DemonstrationError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise DemonstrationError(f"{where}: messages[{i}] needs a role in {ROLES}")
    if not any(m["role"] == "assistant" for m in msgs):
        raise DemonstrationError(f"{where}: no assistant message to learn from")
    tools = row.get("tools", [])
    if isinstance(tools, str):
        tools = json.loads(tools)
    if not isinstance(tools, list):
        raise DemonstrationError(f"{where}: 'tools' must be a list of JSON schemas")
    return row


def read_rows(path: str | os.PathLike) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise DemonstrationError(f"demonstrations file not found: {p}")
    rows = []
    with p.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DemonstrationError(f"{p}:{n}: not JSON: {exc}") from None
            rows.append(check_row(row, f"{p}:{n}"))
    if not rows:
        raise DemonstrationError(f"{p}: no demonstrations")
    return rows


def write_rows(rows: Iterable[dict], path: str | os.PathLike) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(p)
    return p


def to_dataset(rows: list[dict]):
    """A ``datasets.Dataset`` with ``messages`` and ``tools`` columns that SFTTrainer renders faithfully.

    Arrow merges the keys of every struct in a column, so per-tool JSON schemas and per-call arguments
    (different keys in every row) would come back padded with nulls and render wrongly; they are
    stored as JSON strings instead, which both SFTTrainer (``tools``) and the Qwen3 template
    (``arguments is string``) accept as they are.
    """
    from datasets import Dataset

    def norm_msg(m: dict) -> dict:
        out = {"role": m["role"], "content": m.get("content") if isinstance(m.get("content"), str) else ""}
        if m.get("tool_calls"):
            out["tool_calls"] = [{"type": "function", "function": {
                "name": (c.get("function") or c)["name"],
                "arguments": _json_str((c.get("function") or c).get("arguments", {}))}} for c in m["tool_calls"]]
        if m.get("name"):
            out["name"] = m["name"]
        return out

    return Dataset.from_list([{"messages": [norm_msg(m) for m in r["messages"]],
                               "tools": _json_str(r.get("tools") or [])} for r in rows])


def _json_str(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# ------------------------------------------------------------------ demonstrations from rollouts
_TOOLS_HEAD = "\n\n# Tools\n\nYou may call one or more functions"


def split_tools(messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
    """Move the Qwen3 tools section the environment writes into its system message back into schemas.

    The environments embed the tool schemas in the system message exactly as the Qwen3 chat template
    renders ``tools=``; taking them out (and passing them as ``tools``) renders the same tokens, and
    keeps the schemas as data in the row. Returns (messages, None) when there is no such section.
    """
    if not messages or messages[0].get("role") != "system":
        return messages, None
    content = messages[0].get("content") or ""
    head = content.find(_TOOLS_HEAD)
    opening = "XML tags:\n<tools>"  # the first "<tools>" is inside the sentence that precedes the block
    if head < 0 or opening not in content[head:]:
        return messages, None
    block = content[head:].split(opening, 1)[1].split("</tools>", 1)[0]
    try:
        tools = [json.loads(line) for line in block.splitlines() if line.strip()]
    except json.JSONDecodeError:
        return messages, None
    return [{**messages[0], "content": content[:head]}] + [dict(m) for m in messages[1:]], tools


def rows_from_trajectory(traj: dict) -> list[dict]:
    """Interchange rows for every step of one rollout trajectory (``atommem_rl.rollout`` format)."""
    rows = []
    for i, step in enumerate(traj.get("steps") or []):
        if not step.get("prompt"):
            raise DemonstrationError(f"trajectory {traj.get('task_id')}: step {i} has no prompt "
                                     "(rollouts must record prompts)")
        messages, tools = split_tools(step["prompt"])
        row = step_row(messages, step.get("completion") or "", tools or [],
                       meta={"task_id": traj.get("task_id"), "step": i, "phase": step.get("phase"),
                             "score": traj.get("score")})
        if row is not None:
            rows.append(row)
    return rows


def generate(tasks: list, policy: str = "oracle", policy_kwargs: dict | None = None,
             env_config: dict | None = None, samples: int = 1, min_reward: float | None = None,
             seed: int = 0, batch_size: int = 8) -> tuple[list[dict], dict]:
    """Rows from episodes of a demonstration policy (``atommem_rl.rollout``), rejection-sampled by reward.

    Each task is tried up to ``samples`` times (different environment seeds; a sampling teacher gives
    different episodes); the first episode whose terminal score reaches ``min_reward`` (any when
    None) is kept, the others are dropped.
    """
    from atommem_rl.rollout import make_policy, run_rollouts

    for t in tasks if policy == "oracle" else ():  # said before any episode, not as crashed episodes
        t.require_evidence("the oracle's demonstrations (demo_policy: model takes a teacher instead)")
    pending = {t.id: t for t in tasks}
    kept: dict[str, dict] = {}
    episodes, scores = 0, []
    for s in range(samples):
        todo = [t for t in tasks if t.id in pending]
        if not todo:
            break
        trajs = run_rollouts(todo, make_policy(policy, **(policy_kwargs or {})), env_config,
                             batch_size=batch_size, seed=seed + 100_003 * s)
        for tr in trajs:
            if tr.get("skipped"):  # a store outage outlasted the retries: no episode ran
                continue
            episodes += 1
            score = float(tr.get("score") or 0.0)
            scores.append(score)
            if tr.get("crashed"):
                continue
            if min_reward is None or score >= min_reward:
                kept[tr["task_id"]] = tr
                pending.pop(tr["task_id"], None)
    rows = [r for t in tasks if t.id in kept for r in rows_from_trajectory(kept[t.id])]
    return rows, {"tasks": len(tasks), "episodes": episodes, "kept": len(kept), "rows": len(rows),
                  "mean_score": sum(scores) / max(len(scores), 1)}
