"""Adapter for TRL's ``GRPOTrainer(environment_factory=...)``: single-conversation mode for short
tasks. Chunks arrive through a ``next_chunk`` tool instead of one prompt per step; the other tools
are the step-wise environment's (same core, same validation, same handles and reward).

    from envs.trl_adapter import MemoryToolEnv, make_factory
    trainer = GRPOTrainer(..., environment_factory=make_factory(chunk_tokens=256))
    # dataset rows carry the task as JSON: {"prompt": [...], "task": "<task json>"}

TRL pools one instance per rollout, calls ``reset(**row)`` (the returned text is appended to the
prompt), exposes the public methods below as tools (their docstrings are the tool descriptions) and
calls ``get_reward()`` at the end. Every tool returns text and never raises on bad arguments.
"""

from __future__ import annotations

import json

from .core import MemoryEnv, ToolError
from .parser import ToolCall


class MemoryToolEnv:
    """One episode of the memory task as a set of tools."""

    config: dict = {}

    def __init__(self, **config):
        self.config = {**type(self).config, **config}
        self.env: MemoryEnv | None = None
        self.served = -1

    def reset(self, **row) -> str:
        from atommem_rl.tasks.schema import Task

        from . import make_env

        task = row.get("task")
        task = Task.from_dict(json.loads(task) if isinstance(task, str) else task)
        if self.env is not None:
            self.env.close()
        self.env = make_env(task, **self.config)
        self.env.reset(seed=row.get("seed"))
        self.served = -1
        qs = "\n".join(f"{q.id}: {q.question}" for q in task.questions)
        return (f"Questions:\n{qs}\nThe input has {len(self.env.chunks)} chunks: call next_chunk to read them one by one, "
                "store useful facts, then answer every question with the answer tool.")

    def _call(self, name: str, **arguments) -> str:
        env = self.env
        if env is None:
            return "error: the environment was not reset"
        try:
            out = env._execute(ToolCall(name=name, arguments=arguments))
            env.ops[{"create_memory": "create", "read_memory": "read", "update_memory": "update",
                     "delete_memory": "delete", "label_relation": "relate", "answer": "answer"}[name]] += 1
        except (ToolError, Exception) as exc:  # noqa: BLE001 - a tool never raises to the trainer
            env.tool_errors += 1
            return f"error: {exc}"
        if name == "read_memory":
            env.pending_queries = [arguments.get("query", "")]
            _, views = env._retrieve()
            env.pending_queries = []
            return "\n".join(f"[{env.handle_of.get(v.id, 'M?')}] {' '.join(v.text.split())}" for v in views) or "(nothing found)"
        return out.get("message", "ok")

    def next_chunk(self) -> str:
        """Return the next chunk of the input text (or a notice that the input is over)."""
        env = self.env
        if env is None:
            return "error: the environment was not reset"
        self.served += 1
        if self.served < len(env.chunks):
            env.chunk_index = self.served
            return env.chunks[self.served].text
        env.phase = "answer"
        return "No more input. Answer every question with the answer tool."

    def create_memory(self, content: str) -> str:
        """Store one atomic, self-contained fact.

        Args:
            content: the fact
        """
        return self._call("create_memory", content=content)

    def read_memory(self, query: str) -> str:
        """Return the stored memories that best match a query.

        Args:
            query: what to look for
        """
        return self._call("read_memory", query=query)

    def update_memory(self, id: str, content: str) -> str:
        """Replace the text of a memory.

        Args:
            id: handle of the memory, e.g. M3
            content: the new text
        """
        return self._call("update_memory", id=id, content=content)

    def delete_memory(self, id: str) -> str:
        """Remove a memory.

        Args:
            id: handle of the memory, e.g. M3
        """
        return self._call("delete_memory", id=id)

    def label_relation(self, new: str, old: str, label: str) -> str:
        """Label how a newer memory relates to an older one.

        Args:
            new: handle of the newer memory
            old: handle of the older memory
            label: independent, equivalent, old_subsumed_by_new, new_subsumed_by_old or conflict
        """
        return self._call("label_relation", new=new, old=old, label=label)

    def answer(self, question_id: str, answer: str) -> str:
        """Answer a question after reading the whole input.

        Args:
            question_id: e.g. Q1
            answer: a short answer
        """
        if self.env is not None and self.env.phase != "answer":
            return "error: read the whole input with next_chunk first"
        return self._call("answer", question_id=question_id, answer=answer)

    def get_reward(self) -> float:
        env = self.env
        if env is None:
            return 0.0
        terminated = all(q.id in env.answers for q in env.task.questions)
        env.done = True
        return float(env._finish(terminated))


def make_factory(**config):
    """A zero-argument class for ``environment_factory`` with the environment options bound."""
    return type("BoundMemoryToolEnv", (MemoryToolEnv,), {"config": dict(config)})
