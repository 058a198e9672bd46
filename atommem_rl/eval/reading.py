"""Parts every memory method is built from: the reader (its prompt, fitting items to its window, answering
every question of a task), the episode record, a fresh store, the ROAM relation-label prompt and parser, and
``drive``, which steps many methods' generators in lockstep through one backend.

This layer sits below the methods (``eval/methods.py``) and the graph-memory pipeline (``extraction/``), which
both build on it; it imports neither.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from atommem_rl.tasks.schema import Task

from atommem_rl.inference.chat_backends import Backend, Request

if TYPE_CHECKING:
    from .settings import EvalSettings


READER_SYSTEM = ("Answer the question using only the context. Reply with a short answer (a name, place, "
                 "date or number) and nothing else.")


@dataclass
class Item:
    text: str
    sources: list[str] = field(default_factory=list)


def reader_messages(context: str, question: str) -> list[dict]:
    return [{"role": "system", "content": READER_SYSTEM},
            {"role": "user", "content": f"# Context\n{context}\n\n# Question\n{question}\n\nAnswer:"}]


def clean_answer(text: str) -> str:
    for line in (text or "").splitlines():
        line = line.strip()
        if line:
            line = re.sub(r"^(answer\s*:\s*)", "", line, flags=re.IGNORECASE).strip()
            return line.rstrip(".")[:200]
    return ""


def fit_items(backend: Backend, items: list[Item], question: str, budget: int) -> tuple[list[Item], int]:
    """Keep items (best first) while the reader prompt fits ``budget`` tokens; returns (kept, dropped)."""
    base = backend.count(backend.render(reader_messages("", question)))
    kept, used = [], base
    for it in items:
        n = backend.count(it.text) + 1
        if used + n > budget:
            room = budget - used - 8
            if room > 32:  # keep the head of the item that does not fit (counted as dropped)
                kept.append(Item(backend.truncate(it.text, room), it.sources))
                return kept, len(items) - len(kept) + 1
            break
        kept.append(it)
        used += n
    return kept, len(items) - len(kept)


def reader_budget(backend: Backend, s: EvalSettings) -> int:
    window = backend.context_window if s.context_tokens is None else min(s.context_tokens, backend.context_window)
    return window - s.reader_max_new_tokens - 8


# ------------------------------------------------------------------------------ episode records
class Episode:
    """What one method did on one task: predictions, what each answer saw, memory, viewer steps."""

    def __init__(self, task: Task, record_steps: bool, memory_cap: int):
        self.task = task
        self.predictions: dict[str, str] = {}
        self.shown: dict[str, list[Item]] = {}
        self.ops: dict[str, int] = {}
        self.steps: list[dict] | None = [] if record_steps else None
        self.memory: list[dict] = []
        self.extra: dict[str, Any] = {}
        self.memory_cap = memory_cap

    def op(self, name: str, n: int = 1) -> None:
        self.ops[name] = self.ops.get(name, 0) + n

    def step(self, kind: str, text: str, actions: list[str], memory: list[dict] | None = None,
             retrieved: list[str] | None = None, answer: str | None = None) -> None:
        if self.steps is None:
            return
        mem = memory or []
        self.steps.append({"kind": kind, "input": text[:4000], "actions": [a[:1000] for a in actions],
                           "memory": mem[-self.memory_cap:], "memory_total": len(mem),
                           "retrieved": retrieved or [], "answer": answer})


def store_memory(store, handles: dict[str, str]) -> list[dict]:
    out = []
    for a in store.snapshot():
        out.append({"handle": handles.get(a["id"], a["id"]), "text": a["text"], "role": a["role"],
                    "relations": {handles.get(k, k): v for k, v in a["relations"].items()},
                    "sources": a["source_ids"]})
    return out


def new_store(s: EvalSettings, embedder):
    from atommem_rl.memory.store import AtomStore
    from envs.core import IN_MEMORY_EXACT_BELOW, _default_client

    # exact reads as in the environments: the same retrieval for every method, and repeatable runs
    return AtomStore(f"eval-{uuid.uuid4().hex[:12]}", client=_default_client(), embedder=embedder, max_chars=4000,
                     exact_below=IN_MEMORY_EXACT_BELOW)



def answer_all(ep: Episode, contexts: dict[str, list[Item]], backend: Backend, s: EvalSettings, key,
                memory: list[dict] | None = None):
    """Generator step: one reader call per question over its items; fills predictions."""
    budget = reader_budget(backend, s)
    reqs, qids = [], []
    for q in ep.task.questions:
        items, dropped = fit_items(backend, contexts[q.id], q.question, budget)
        if dropped:
            ep.extra["items_dropped"] = ep.extra.get("items_dropped", 0) + dropped
        ep.shown[q.id] = items
        reqs.append(Request(reader_messages("\n".join(i.text for i in items), q.question), s.reader_max_new_tokens, key))
        qids.append(q.id)
    outs = yield reqs
    for qid, q, out in zip(qids, ep.task.questions, outs):
        ep.predictions[qid] = clean_answer(out)
        ep.step("answer", f"{qid}: {q.question}", [out], memory, [i.text for i in ep.shown[qid]], ep.predictions[qid])


ROAM_SYSTEM = (
    "You label how a NEW memory relates to each OLDER memory. Labels:\n"
    "IND: independent, about different things.\nEQV: equivalent, the same content.\n"
    "OSN: the old memory is subsumed by the new one (the new one is more complete).\n"
    "NSO: the new memory is subsumed by the old one.\n"
    "CON: conflict, the new memory replaces the old one (e.g. a change over time).\n"
    "Reply with one line per older memory: <number>: <label>.")
_ROAM_LINE = re.compile(r"(\d+)\s*[:.)\-]\s*\(?\s*(IND|EQV|OSN|NSO|CON)\b", re.IGNORECASE)


def parse_roam(text: str, n: int) -> tuple[dict[int, str], bool]:
    """{candidate number (1-based): short label}; missing numbers are IND."""
    found = {int(a): b.upper() for a, b in _ROAM_LINE.findall(text or "") if 1 <= int(a) <= n}
    return {i: found.get(i, "IND") for i in range(1, n + 1)}, bool(found)



def drive(generators: dict[Any, Any], backend: Backend | None) -> dict[Any, Any]:
    """Step method generators in lockstep: each round, every open episode's requests go into one
    ``backend.generate`` call. Returns {key: the generator's return value}."""
    pending: dict[Any, list[Request]] = {}
    done: dict[Any, Any] = {}
    for k, g in generators.items():
        try:
            pending[k] = next(g)
        except StopIteration as stop:
            done[k] = stop.value
    while pending:
        keys = list(pending)
        flat = [r for k in keys for r in pending[k]]
        outs = backend.generate(flat) if flat else []
        pos = 0
        nxt = {}
        for k in keys:
            n = len(pending[k])
            part, pos = outs[pos:pos + n], pos + n
            try:
                nxt[k] = generators[k].send(part)
            except StopIteration as stop:
                done[k] = stop.value
        pending = nxt
    return done
