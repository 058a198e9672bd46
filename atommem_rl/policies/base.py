"""The policy interface the rollout runner drives.

A policy acts on a *batch* of active episodes at once (the model policy turns the batch into one
generation call; scripted policies loop). Each episode is identified by a key:

    policy.start(key, task)                  a new episode begins (scripted policies read gold here)
    policy.act([(key, observation, info)])   -> one assistant text per entry, same order
    policy.end(key)                          the episode is over

``observation`` is the environment's chat messages; ``info`` is the environment's info dict of the
previous step (its ``results`` restate, in structured form, the "Results of your last action"
section the prompt shows; its ``max_new_tokens``, when set, caps the reply: :func:`step_token_limit`).
Policies return raw assistant text with Qwen3 ``<tool_call>`` blocks.
"""

from __future__ import annotations

import re
from typing import Any

from envs.parser import format_tool_call


class PolicyUnavailable(ConnectionError):
    """The policy cannot act for any episode (its generation server failed past its retries). It ends the
    run instead of crashing the batch's episodes: a crashed episode scores 0, and in training that 0
    would enter the advantages as if the policy had earned it (``rollout.act_or_crash`` re-raises it)."""


class Policy:
    name = "policy"

    def start(self, key: Any, task) -> None:
        pass

    def act(self, batch: list[tuple[Any, list[dict], dict]]) -> list[str]:
        return [self.act_one(key, obs, info) for key, obs, info in batch]

    def act_one(self, key: Any, observation: list[dict], info: dict) -> str:  # pragma: no cover
        raise NotImplementedError

    def end(self, key: Any) -> None:
        pass

    def stats(self) -> dict:
        return {}


def step_token_limit(info: dict | None, default: int) -> int:
    """The completion-token limit of the step ``info`` precedes: the generator's own ``default``, or the
    environment's smaller one (``info["max_new_tokens"]``, set in the answer phase by ``answer_max_new_tokens``)."""
    env_limit = (info or {}).get("max_new_tokens")
    return int(default) if env_limit is None else min(int(default), int(env_limit))


def calls_text(calls: list[tuple[str, dict]]) -> str:
    return "\n".join(format_tool_call(n, a) for n, a in calls)


_SECTION = re.compile(r"^# (.+)$", re.MULTILINE)


def sections(observation: list[dict]) -> dict[str, str]:
    """The user prompt split by its ``# Heading`` lines: {first word of heading (lower): body}."""
    text = observation[-1]["content"] if observation else ""
    out: dict[str, str] = {}
    marks = list(_SECTION.finditer(text))
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        key = m.group(1).split()[0].lower().rstrip("s:")
        out[key] = text[m.end():end].strip("\n")
    return out


_MEM_LINE = re.compile(r"^\[(M\d+)\] (.*)$", re.MULTILINE)


def memory_lines(observation: list[dict]) -> dict[str, str]:
    """Handle -> shown text of the memory views in the prompt."""
    return dict(_MEM_LINE.findall(sections(observation).get("memory", "")))
