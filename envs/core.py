"""The memory POMDP shared by every environment (AtomMem's formulation, DESIGN.md section 1).

An episode streams a task's blocks (documents or dialogue sessions) to the policy in chunks of at
most ``chunk_tokens`` tokens of the policy's tokenizer. At step t the observation (chat messages:
system = rules and tool schemas, user = the step's prompt) shows

    the question(s) | the scratchpad | the memory views retrieved for the current query |
    the results of the previous action | chunk t

where the current query is the policy's own ``read_memory`` queries of the previous step, or the
question(s) when it issued none (``auto_retrieve``). The action is the policy's raw text with any
number of Qwen3 ``<tool_call>`` blocks. The calls run in order as one transition; each failing call
(unknown tool, bad arguments, unknown handle, budget exhausted, capacity refused) returns an error
line in the next prompt and leaves the memory exactly as it was. After the last chunk comes the
answer phase: all pending questions at once (``answer_mode="all"``) or one question per step
(``"each"``); the policy may read (``answer_read_budget`` per step) and calls ``answer`` (in at most
``answer_max_new_tokens`` completion tokens when set: ``info["max_new_tokens"]`` tells the generator). Answering
every question ends the episode (terminated); ``max_steps``, ``max_answer_steps`` or
``max_episode_tokens`` cut it (truncated). The terminal reward is the mean answer score (EM, F1,
LoCoMo F1 or an LLM judge), plus optional shaping (evidence recall at answer time, relation-label
accuracy against gold labels); steps with malformed tool calls cost ``format_penalty``, steps with
any failed call ``error_penalty``.

Atoms are shown as stable handles M1, M2, ... (never store ids). Each created atom is attributed,
hidden from the policy, to the task units of the current chunk it restates (term overlap): that is
how evidence recall, the confounder-token share and relation accuracy are measured.

Prompt assembly respects ``max_prompt_tokens`` exactly (the rendered chat template, counted in the
policy's tokens): memory views, then the scratchpad, then old results are shortened with visible
marks; the current chunk, the questions and the rules are never cut (a configuration whose chunk
cannot fit raises at reset, before any step).

This module holds the episode loop (reset, step, observe); each concern lives in its own module:
config.py (EnvConfig), tools.py (schemas, argument and handle checks), actions.py (what each tool does),
capacity.py (refuse or evict), attribution.py (hidden evidence bookkeeping), chunking.py, views.py
(retrieval for the prompt), prompt.py (building and fitting the prompt), reward.py, episode_store.py.
"""

from __future__ import annotations

import random
from typing import Any

from atommem_rl import scoring
from atommem_rl.memory.atom import Relation
from atommem_rl.memory.errors import MemoryStoreError, StoreUnavailableError
from atommem_rl.memory.store import AtomStore
from atommem_rl.tasks.schema import Task

from .actions import answer, create_memory, delete_memory, label_relation, read_memory, update_memory, write_scratchpad
from .attribution import attribute, check_relation, note_answer_views, unit_terms
from .episode_store import IN_MEMORY_EXACT_BELOW, default_client, exact_below, open_store, write_behind
from .chunking import Chunk, make_chunks
from .config import ABLATIONS, EnvConfig, EnvConfigError
from .parser import parse_tool_calls
from .prompt import PromptBuilder, result_line
from .reward import finish
from .sanitize import clean_str, clip, deheading, defang
from .tokens import PolicyTokens, as_tokens
from .tools import OPS, TOOL_OP, ToolError, check_args, new_handle, tool_schemas
from .views import current_views

# the names other modules import from here (kept where they were before the split)
_default_client = default_client
__all__ = ["ABLATIONS", "Chunk", "EnvConfig", "EnvConfigError", "IN_MEMORY_EXACT_BELOW", "MemoryEnv", "OPS",
           "TOOL_OP", "ToolError", "deheading", "defang", "tool_schemas"]


class MemoryEnv:
    """The shared core; subclasses render their blocks (``render_block``) and name themselves."""

    kind = "documents"
    name = "memory"

    def __init__(self, task: Task | dict, **config):
        self.task = task if isinstance(task, Task) else Task.from_dict(task)
        self.config = EnvConfig.from_kwargs(**config)
        c = self.config
        self.tokens: PolicyTokens = as_tokens(c.tokenizer)
        if isinstance(c.embedder, str):
            from atommem_rl.memory.embeddings import make_embedder

            self.embedder = make_embedder(c.embedder)
        else:
            self.embedder = c.embedder
        self.client = c.client if c.client is not None else default_client()
        self.parser = c.parser or (lambda text: parse_tool_calls(text, c.max_calls))
        self.judge = scoring.LLMJudge(c.judge_url, c.judge_model) if c.reward == "judge" else None
        self.tools = tool_schemas(c.disable)
        self.tool_names = [t["function"]["name"] for t in self.tools]
        self.prompt = PromptBuilder(c, self.tools, self.tokens)
        self.store: AtomStore | None = None
        self.done = True
        self._chunks_cache: dict[int | None, list[Chunk]] = {}
        self.units = self.task.units()
        self._unit_terms = unit_terms(self.units)
        self._gold_labels = {(r.new, r.old): Relation.parse(r.label) for r in self.task.relations}

    def _write_behind(self) -> int:
        """The store's write-behind batch for this env's client (envs/episode_store.py; ``atommem bench env`` reports it)."""
        return write_behind(self.client, self.config)

    def _exact_below(self) -> int:
        return exact_below(self.client, self.config)

    # ---------------------------------------------------------------- subclass hooks
    def render_block(self, block) -> tuple[str, list[tuple[str | None, str]]]:
        """(header line, [(unit id or None, line)]) for one block."""
        raise NotImplementedError

    def unit_separator(self) -> str:
        return "\n"

    def _open_store(self) -> AtomStore:
        """The episode's store: a fresh namespace (a live agent's env reopens its own instead)."""
        return open_store(self.client, self.embedder, self.config)

    # ---------------------------------------------------------------- Gymnasium API
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[list[dict], dict]:
        self.close()
        self.seed = seed
        self.rng = random.Random(seed)
        self.chunks = self._make_chunks(seed)
        self.store = None
        if "store" not in self.config.disable:
            self.store = self._open_store()
        self.handles: dict[str, str] = {}  # handle -> atom id
        self.handle_of: dict[str, str] = {}  # atom id -> handle
        self.last_shown: dict[str, int] = {}  # atom id -> step it was last shown (eviction order)
        self.scratchpad = ""
        self.step_index = 0
        self.chunk_index = 0
        self.phase = "chunks" if self.chunks else "answer"
        self.answers: dict[str, str] = {}
        self.answer_steps = 0
        self.pending_queries: list[str] = []
        self.last_results: list[str] = []
        self.ops = {op: 0 for op in OPS}
        self.tool_errors = 0
        self.format_errors = 0
        self.tokens_used = {"prompt": 0, "completion": 0}
        self.answer_shown_units: set[str] = set()
        self.answer_view_tokens = {"total": 0, "confounder": 0}
        self.relation_checks = {"labelled": 0, "gold": 0, "correct": 0}
        self._extra_sources: dict[str, set[str]] = {}
        self._shown = 0
        self._last_prompt_tokens = 0
        self.done = False
        self.outcome: dict[str, Any] = {}
        n_ans = self.config.max_answer_steps or (len(self.task.questions) + 2)
        self.max_answer_steps = n_ans
        self.max_steps = self.config.max_steps or (len(self.chunks) + n_ans)
        self._check_floor()
        if self.config.evidence_bonus and not all(q.evidence for q in self.task.questions):  # recall needs gold
            raise EnvConfigError(f"evidence_bonus needs gold evidence, and task {self.task.id!r} has a question "
                                 "without it (docs/OWN_DATA.md)")
        obs = self._observe()
        return obs, self._info(results=[])

    def _check_floor(self) -> None:
        """Configuration check before the first step: the longest chunk with the rules and questions
        (nothing optional) must fit ``max_prompt_tokens``, so no step can ever need to cut a chunk."""
        if not self.chunks:
            return
        longest = max(range(len(self.chunks)), key=lambda i: self.chunks[i].tokens)
        tail = self.prompt.chunk_tail(longest, len(self.chunks), self.chunks[longest].text)
        self.prompt.check_floor(self.prompt.question_text(self._reading_questions()), tail)

    def step(self, action: Any) -> tuple[list[dict], float, bool, bool, dict]:
        if self.done:
            raise RuntimeError("the episode is over: call reset() first")
        if isinstance(action, bytes):
            action = action.decode("utf-8", errors="replace")
        if isinstance(action, str):
            action = clean_str(action)
            # exact up to 32k characters; beyond that (a runaway generation) about 4 characters a token
            self.tokens_used["completion"] += self.tokens.count(action[:32_000]) + max(0, len(action) - 32_000) // 4
        reward = 0.0
        try:
            calls, parse_errors = self.parser(action)
        except Exception as exc:  # a replaceable parser must not take the env down either
            calls, parse_errors = [], [f"could not parse the action: {type(exc).__name__}"]
        results: list[tuple[int, dict]] = []  # (block index, result), sorted at the end
        for err in parse_errors:
            msg = getattr(err, "message", str(err))
            results.append((getattr(err, "index", 0), {"name": None, "ok": False, "message": msg}))
        if parse_errors:
            self.format_errors += 1
            reward -= self.config.format_penalty
        answering = self.phase == "answer"
        reads_left = self.config.answer_read_budget if answering else self.config.read_budget
        self.pending_queries = []
        for call in sorted(calls, key=lambda c: c.index):
            try:
                if call.name == "read_memory":
                    if reads_left <= 0:
                        raise ToolError(f"read budget exhausted ({self.config.answer_read_budget if answering else self.config.read_budget} per step)")
                    reads_left -= 1
                out = self._execute(call)
                self.ops[TOOL_OP[call.name]] += 1
                results.append((call.index, {"name": call.name, "ok": True, **out}))
            except StoreUnavailableError:
                raise  # the backend is down, not the policy's doing: the rollout engine retries the episode
            except (ToolError, MemoryStoreError) as exc:
                self.tool_errors += 1
                message = self._as_handles(str(exc)) if isinstance(exc, MemoryStoreError) else str(exc)
                results.append((call.index, {"name": call.name, "ok": False, "message": clip(message, 300)}))
        self.tool_errors += len(parse_errors)
        # why a penalty beyond the format one: a failed call changes nothing, so without a cost the terminal
        # reward leaves such calls free and RL drifts into them (measured in docs/BENCHMARKS.md, "Learning
        # signal", sixth run: 2.8 failed calls per held-out episode after 12 GRPO steps, from 0.06)
        if any(not r["ok"] for _, r in results):
            reward -= self.config.error_penalty
        results = [r for _, r in sorted(results, key=lambda x: x[0])]
        if not results:
            results.append({"name": None, "ok": True, "message": "no tool call found in your action; nothing changed"})
        # advance
        self.step_index += 1
        terminated = truncated = False
        if self.phase == "chunks":
            self.chunk_index += 1
            if self.chunk_index >= len(self.chunks):
                self.phase = "answer"
        else:
            self.answer_steps += 1
            if all(q.id in self.answers for q in self.task.questions):
                terminated = True
            elif self.answer_steps >= self.max_answer_steps:
                truncated = True
        if not terminated and self.step_index >= self.max_steps:
            truncated = True
        self.last_results = [result_line(i, r) for i, r in enumerate(results)]
        obs = self._observe() if not (terminated or truncated) else self._final_observation()
        if (self.config.max_episode_tokens is not None and not terminated
                and self.tokens_used["prompt"] + self.tokens_used["completion"] > self.config.max_episode_tokens):
            truncated = True
        if terminated or truncated:
            self.done = True
            reward += self._finish(terminated)
        info = self._info(results=results)
        return obs, reward, terminated, truncated, info

    def _as_handles(self, message: str) -> str:
        """A store error names atoms by store id; the policy knows them only as handles [M1], ... (store ids
        are random, so leaving them would also make prompts differ between runs of one seed)."""
        for aid in sorted((a for a in self.handle_of if a in message), key=len, reverse=True):
            message = message.replace(aid, self.handle_of[aid])
        return message

    def close(self) -> None:
        if self.store is not None:
            try:
                self.store.drop()
            except MemoryStoreError:
                pass
            self.store = None

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    # ---------------------------------------------------------------- chunking
    def _make_chunks(self, seed: int | None) -> list[Chunk]:
        key = seed if self.config.shuffle_blocks else None
        if key in self._chunks_cache:
            return self._chunks_cache[key]
        blocks = list(self.task.blocks)
        if self.config.shuffle_blocks:
            random.Random(seed).shuffle(blocks)
        chunks = make_chunks(blocks, self.render_block, self.tokens, self.config.chunk_tokens)
        if self.config.max_chunks is not None:
            chunks = chunks[: self.config.max_chunks]
        self._chunks_cache[key] = chunks
        return chunks

    # ---------------------------------------------------------------- tools
    def _execute(self, call) -> dict:
        args = check_args(call, self.config, self.tool_names)
        name, store = call.name, self.store
        if name == "answer":
            return answer(args, self.phase, self._pending_questions(), self.task.questions, self.answers)
        if name == "write_scratchpad":
            self.scratchpad, out = write_scratchpad(args["content"], self.config.scratchpad_tokens, self.tokens)
            return out
        if self.phase == "answer" and name == "create_memory":
            raise ToolError("create_memory is not available in the answer phase")
        assert store is not None
        if name == "create_memory":
            return create_memory(args, store, self.config, self._attribute, self.handles, self.handle_of,
                                 self.last_shown, self.step_index)
        if name == "read_memory":
            return read_memory(args, self.pending_queries)
        if name == "update_memory":
            return update_memory(args, store, self.handles, self.handle_of, self._extra_sources, self._attribute)
        if name == "delete_memory":
            return delete_memory(args, store, self.handles, self.handle_of)
        if name == "label_relation":
            return label_relation(args, store, self.handles, self.handle_of, self._check_relation)
        raise ToolError(f"unknown tool {name!r}")  # pragma: no cover - check_args filters

    def _attribute(self, content: str) -> list[str]:
        return attribute(content, self.chunks, self.chunk_index, self._unit_terms)

    def _check_relation(self, new: str, old: str, rel: Relation) -> None:
        check_relation(new, old, rel, self.store, self._extra_sources, self._gold_labels,
                       bool(self.task.meta.get("relations_exhaustive")), self.relation_checks)

    def _reading_questions(self):
        """The questions a reading (chunk) step shows: none when they are hidden until the answer phase."""
        return [] if self.config.questions == "hidden" else self.task.questions

    def _pending_questions(self):
        open_qs = [q for q in self.task.questions if q.id not in self.answers]
        if self.config.answer_mode == "each":
            return open_qs[:1]
        return open_qs

    # ---------------------------------------------------------------- observation
    def _observe(self) -> list[dict]:
        qs = self._pending_questions() if self.phase == "answer" else self._reading_questions()
        chunk = self.chunks[self.chunk_index].text if self.phase == "chunks" else ""
        label, views = current_views(self.store, self.pending_queries, qs, self.config, fallback=chunk)
        if self.phase == "chunks":
            tail = self.prompt.chunk_tail(self.chunk_index, len(self.chunks), self.chunks[self.chunk_index].text)
        else:
            tail = self.prompt.answer_tail(len(qs), self.max_answer_steps - self.answer_steps)
        messages, self._shown, self._last_prompt_tokens = self.prompt.fit(
            self.prompt.question_text(qs), self.prompt.memory_lines(views, self.handle_of), label, tail,
            len(self.store) if self.store is not None else 0, self.scratchpad, self.last_results, self.phase == "answer")
        for v in views[: self._shown]:
            self.last_shown[v.id] = self.step_index
        if self.phase == "answer":
            note_answer_views(views[: self._shown], self.store, self._extra_sources, self.units,
                              self.tokens.count_memo, self.answer_shown_units, self.answer_view_tokens)
        self.tokens_used["prompt"] += self._last_prompt_tokens
        return messages

    def _final_observation(self) -> list[dict]:
        self._last_prompt_tokens = 0
        self._shown = 0
        return self.prompt.final(self.last_results, self.phase == "answer")

    # ---------------------------------------------------------------- outcome
    def _finish(self, terminated: bool) -> float:
        shaped, outcome = finish(self.config, self.task.questions, self.answers, self.judge,
                                 self.task.evidence_ids(), self.answer_shown_units, self.relation_checks,
                                 self.answer_view_tokens, terminated, episode=self._episode_record)
        self.outcome.update(outcome)
        return shaped

    def _episode_record(self) -> dict:
        """What a custom reward function (``reward: package.module:function``) sees of the episode."""
        return {"task_id": self.task.id, "source": self.task.source, "kind": self.task.kind,
                "steps": self.step_index, "ops": dict(self.ops), "tool_errors": self.tool_errors,
                "format_errors": self.format_errors, "tokens": dict(self.tokens_used), "scratchpad": self.scratchpad,
                "memory": [a["text"] for a in self.store.snapshot() if a.get("role") != "deleted"]
                if self.store is not None else []}

    def _info(self, results: list[dict]) -> dict:
        info = {
            "task_id": self.task.id,
            "phase": self.phase,
            "step": self.step_index,
            "chunk": self.chunk_index,
            "chunks": len(self.chunks),
            "ops": dict(self.ops),
            "tool_errors": self.tool_errors,
            "format_errors": self.format_errors,
            "tokens": dict(self.tokens_used),
            "prompt_tokens": getattr(self, "_last_prompt_tokens", 0),
            "memory_size": len(self.store) if self.store is not None else 0,
            "results": results,
            "open_questions": [q.id for q in self._pending_questions()] if self.phase == "answer" else [],
            "answer_steps_left": self.max_answer_steps - self.answer_steps,
            "max_new_tokens": self.config.answer_max_new_tokens if self.phase == "answer" else None,  # for obs's reply
            "tools": self.tool_names,
            "relation_checks": dict(self.relation_checks),
            "evidence_recall": None,
            "confounder_token_share": None,
        }
        if self.done:
            info.update({k: v for k, v in self.outcome.items()})
        return info

    # ---------------------------------------------------------------- conveniences
    def preload(self, texts: list[str]) -> list[str]:
        """Store atoms before the first step (benchmarks, warm-started memories); returns their
        handles. Not a policy action: it costs no step and is not counted in ``ops``."""
        if self.store is None:
            raise ValueError("this environment has no store (the 'store' ablation)")
        atoms = self.store.create_many([{"text": t} for t in texts])
        return [new_handle(self.handles, self.handle_of, a.id) for a in atoms]

    def memory_snapshot(self) -> list[dict]:
        return self.store.snapshot() if self.store is not None else []

    def atom_of(self, handle: str) -> str | None:
        return self.handles.get(handle)
