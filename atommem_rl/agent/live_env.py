"""The memory environment of a live agent: the training environment's steps (chunking, prompts, tool
calls applied to the store, scratchpad), on a named namespace that outlives the process, fed by
observations as they come and asked questions one at a time.

``envs.core.MemoryEnv`` plays one episode of a task known in advance; ``LiveEnv`` is that environment
with three changes and nothing else: its store is the named namespace, reopened with its atoms,
roles and relations (``_open_store``) and never dropped on close; its scratchpad, handles and step
count are kept in the namespace's agent record (``state.py``) after every step; and it alternates
``feed(blocks)`` (reading steps until the blocks' chunks are consumed, no question shown) with
``ask(question)`` (answer-phase steps until the answer tool is called or the answer steps run out).
Every step is ``MemoryEnv.step``: the same tool loop as training, rollouts and evaluation.
"""

from __future__ import annotations

from typing import Any

from atommem_rl.memory.store import AtomStore
from atommem_rl.tasks.schema import Block, Question, Task
from envs.attribution import unit_terms
from envs.chunking import make_chunks
from envs.core import MemoryEnv
from envs.episode_store import exact_below, write_behind
from envs.tools import new_handle

from .state import AgentState

_NO_ANSWER = "-"  # the gold answer of a live question: nobody knows it (the score is not used)


class LiveEnv(MemoryEnv):
    """One agent's environment on ``namespace`` (config: ``envs.core.EnvConfig`` fields, with ``client``)."""

    kind = "live"
    name = "live"

    def __init__(self, namespace: str, **config: Any):
        self.namespace = namespace
        idle = Task(id=namespace, kind="documents", blocks=[],
                    questions=[Question(id="Q1", question="(none yet)", answers=[_NO_ANSWER])])
        super().__init__(idle, **config)
        self.config.max_episode_tokens = None  # a live agent has no episode to cut short
        self.reading = True
        self.state = AgentState(self.client, namespace)
        self.reset(seed=0)  # reopens the namespace (_open_store); no chunk, so no prompt yet
        self._restore()

    # ---------------------------------------------------------------- MemoryEnv hooks
    def render_block(self, block):
        from envs.dialogue import DialogueEnv
        from envs.documents import DocumentEnv

        kind = DialogueEnv if any(u.speaker for u in block.units) else DocumentEnv
        return kind.render_block(self, block)

    def _open_store(self) -> AtomStore:
        return AtomStore(self.namespace, client=self.client, embedder=self.embedder,
                         max_chars=self.config.max_atom_chars, write_behind=write_behind(self.client, self.config),
                         exact_below=exact_below(self.client, self.config))

    def _reading_questions(self):
        return []  # a live agent reads before anyone asks

    def _observe(self) -> list[dict]:
        if self.reading and self.phase == "answer":
            return []  # the observation is consumed: no answer phase until ask()
        return super()._observe()

    def step(self, action: Any):
        out = super().step(action)
        self._save()
        return out

    def close(self) -> None:
        """Flush and let go of the namespace (its atoms and record stay)."""
        if self.store is not None:
            self.store.close()
            self.store = None

    # ---------------------------------------------------------------- the agent's side
    @property
    def idle(self) -> bool:
        """No step to take: the observation is consumed, or the question answered (or out of steps)."""
        return self.done or (self.reading and self.phase == "answer")

    @property
    def blocks_seen(self) -> int:
        return int(self.state.data.get("blocks", 0))

    def feed(self, blocks: list[Block]) -> tuple[list[dict], dict] | None:
        """Start reading ``blocks`` (their unit ids unique among them); the first observation, or None
        when they render to nothing."""
        chunks = make_chunks(blocks, self.render_block, self.tokens, self.config.chunk_tokens)
        self.state.save(blocks=self.blocks_seen + len(blocks))
        if not chunks:
            return None
        self.units = {u.id: u for b in blocks for u in b.units}
        self._unit_terms = unit_terms(self.units)
        self.chunks, self.chunk_index, self.phase, self.done, self.reading = chunks, 0, "chunks", False, True
        self._check_floor()  # the longest chunk fits max_prompt_tokens, as at reset
        self._start(len(chunks))
        return self._observe(), self._info(results=[])

    def ask(self, question: str) -> tuple[list[dict], dict]:
        """Start the answer phase for ``question``; its first observation."""
        self.task.questions = [Question(id="Q1", question=question, answers=[_NO_ANSWER])]
        self.units, self._unit_terms = {}, {}
        self.phase, self.done, self.reading = "answer", False, False
        self.answers, self.answer_steps, self.outcome = {}, 0, {}
        self.answer_shown_units, self.answer_view_tokens = set(), {"total": 0, "confounder": 0}
        self.max_answer_steps = self.config.max_answer_steps or 3  # one question + 2, as in training
        self._start(self.max_answer_steps)
        return self._observe(), self._info(results=[])

    def _start(self, steps: int) -> None:
        self.pending_queries, self.last_results = [], []
        self.tokens_used = {"prompt": 0, "completion": 0}
        self.max_steps = self.step_index + steps + 1

    def _restore(self) -> None:
        """Scratchpad, handles and step count from the record; atoms it does not name (written by
        another writer) get the next handles in creation order."""
        d = self.state.data
        self.handles = dict(d.get("handles", {}))
        self.handle_of = {a: h for h, a in self.handles.items()}
        self.scratchpad = d.get("scratchpad", "")
        self.step_index = int(d.get("steps", 0))
        if self.store is not None:
            for a in self.store.snapshot():
                if a["id"] not in self.handle_of:
                    new_handle(self.handles, self.handle_of, a["id"])

    def _save(self) -> None:
        self.state.save(scratchpad=self.scratchpad, handles=self.handles, steps=self.step_index)

    def delete(self) -> None:
        """Drop the namespace: its atoms and its record."""
        if self.store is not None:
            self.store.drop()
            self.store = None
        self.state.drop()
