"""The evaluated methods. Every LLM call goes through one :class:`~atommem_rl.inference.chat_backends.Backend`
(the same reader model for all of them) and is counted per task.

Reader methods build a context per question and ask the reader (one call per question):

    full_context   every block rendered in order; when it does not fit the reader's window (or
                   ``context_tokens``), whole lines are dropped from the middle and the dropped share
                   is reported (``context_truncated``)
    rag            raw chunks of ``rag_chunk_tokens`` in Chroma; the top ``retrieval_k`` (6, as in
                   AtomMem) per question
    append_all     every sentence or turn one atom, no management; top ``retrieval_k`` per question
    mem0           per incoming fact (sentence or turn) one LLM call chooses ADD, UPDATE, DELETE or
                   NOOP against the ``mem0_k`` most similar memories (mem0's update step); an
                   unparsable reply falls back to ADD (counted in ``parse_failures``)
    memagent       a memory of at most ``memagent_memory_tokens`` rewritten by one call per chunk of
                   ``memagent_chunk_tokens``, conditioned on the questions (MemAgent); the final
                   memory is the context
    roam           ROAM without training: per incoming fact, the ``roam_k`` most similar Primary atoms
                   (cosine >= ``roam_min_similarity``) are labelled IND/EQV/OSN/NSO/CON by one call;
                   the store's deterministic rules set roles; retrieval returns fused Primary views

Every method's store is an in-memory Chroma namespace whose unfiltered reads are exact cosine in
process (as in the environments; Chroma's HNSW returns near-tied neighbours in a run-dependent order).

The graph-memory pipeline (``atommem_rl/extraction/pipeline.py``; reader methods too): an extractor
call per window of turns writes verified atomic facts, then one reader call per question:

    atommem_graph  extraction, verification (hybrid candidates, model-labelled relations), events,
                   session-end profiles, hierarchical graph retrieval (filters, event compensation, RWR)
    atommem_flat   facts only: no events, profiles or graph (hybrid dense+BM25 retrieval)
    no_graph       events and profiles, hybrid retrieval (no RWR, no event compensation)
    no_profile     graph retrieval without profiles

Policy methods run the memory environment (``envs``) with a policy: ``oracle`` (gold evidence: the
upper bound), ``heuristic`` (no gold, no LLM), ``atommem`` (the model prompted with the AtomMem tools,
no training) and ``checkpoint:NAME`` (a trained checkpoint, same environment).

No method but the oracle sees gold: reader methods get :func:`public_task` (answers, evidence, unit
roles, facts, relations and meta removed) and policies other than the oracle are started with it.
Bookkeeping the metrics need (which units a memory came from) is recorded beside the method's
state and never shown to it.
"""

from __future__ import annotations

import copy
import itertools
import json
import re

from atommem_rl.tasks.schema import Task

from atommem_rl.inference.chat_backends import Backend, Request
from .reading import (ROAM_SYSTEM, Episode, Item, answer_all, clean_answer, drive, fit_items, new_store,  # noqa: F401
                      parse_roam, reader_budget, reader_messages, store_memory)
from .settings import (ALL_METHODS, EVAL_ENV_KEYS, LLM_METHODS, PIPELINE_METHODS, POLICY_METHODS,  # noqa: F401
                       READER_METHODS, EvalSettings)


# ------------------------------------------------------------------------------ public task view
def public_task(task: Task) -> Task:
    """The task as a non-oracle method may see it: the input stream and the questions only."""
    t = copy.deepcopy(task)
    for b in t.blocks:
        for u in b.units:
            u.role, u.fact = "context", None
    for q in t.questions:
        q.answers, q.evidence, q.category = [], [], None
    t.relations, t.meta = [], {}
    return t


def unit_lines(task: Task) -> list[tuple[str | None, str, str | None]]:
    """(unit id or None for a header, rendered line, atom text) for the whole stream, in order."""
    out = []
    for b in task.blocks:
        if task.kind == "dialogue":
            out.append((None, f"[Session {b.id}" + (f", {b.date}]" if b.date else "]"), None))
            for u in b.units:
                if u.text.strip():
                    line = f"{u.speaker or 'Speaker'}: {' '.join(u.text.split())}"
                    atom = f"{u.speaker or 'Speaker'}" + (f" ({b.date})" if b.date else "") + f": {' '.join(u.text.split())}"
                    out.append((u.id, line, atom))
        else:
            head = f"[{b.id}]" + (f" {b.title}" if b.title else "") + (f" ({b.date})" if b.date else "")
            out.append((None, head, None))
            for u in b.units:
                if u.text.strip():
                    s = " ".join(u.text.split())
                    out.append((u.id, s, f"{b.title}: {s}" if b.title else s))
    return out


def pack_chunks(backend: Backend, lines, limit: int) -> list[tuple[str, list[str]]]:
    """Whole lines packed into chunks of at most ``limit`` tokens (a longer line is its own chunk)."""
    chunks, cur, ids, used = [], [], [], 0
    for uid, line, _ in lines:
        n = backend.count(line) + 1
        if cur and used + n > limit:
            chunks.append(("\n".join(cur), ids))
            cur, ids, used = [], [], 0
        cur.append(line)
        used += n
        if uid:
            ids.append(uid)
    if cur:
        chunks.append(("\n".join(cur), ids))
    return chunks


# ------------------------------------------------------------------------------ the reader methods
def run_full_context(ep, backend, s, key, embedder):
    lines = unit_lines(ep.task)
    budget = reader_budget(backend, s)
    longest_q = max(ep.task.questions, key=lambda q: len(q.question)).question
    marker = "[... middle of the input cut to fit the context window ...]"
    # the marker line and a margin for tokens merging differently across joined lines
    room = budget - backend.count(backend.render(reader_messages("", longest_q))) - backend.count(marker) - 16
    costs = [backend.count(l) + 1 for _, l, _ in lines]
    total = sum(costs)
    keep = list(range(len(lines)))
    if total > room:  # drop whole lines from the middle
        head, tail, used = [], [], 0
        i, j = 0, len(lines) - 1
        while i <= j:
            if used + costs[i] > room:
                break
            head.append(i)
            used += costs[i]
            i += 1
            if i <= j and used + costs[j] <= room:
                tail.insert(0, j)
                used += costs[j]
                j -= 1
            elif i <= j:
                break
        keep = head + [-1] + tail
    text_lines, sources = [], []
    for k in keep:
        if k == -1:
            text_lines.append(marker)
            continue
        uid, line, _ = lines[k]
        text_lines.append(line)
        if uid:
            sources.append(uid)
    kept_tokens = sum(costs[k] for k in keep if k >= 0)
    ep.extra["context_tokens"] = kept_tokens
    ep.extra["context_truncated"] = 1.0 - kept_tokens / total if total else 0.0
    item = Item("\n".join(text_lines), sources)
    ep.step("context", item.text, [f"full context: {kept_tokens} of {total} tokens kept"])
    yield from answer_all(ep, {q.id: [item] for q in ep.task.questions}, backend, s, key)


def run_rag(ep, backend, s, key, embedder):
    store = new_store(s, embedder)
    try:
        chunks = pack_chunks(backend, unit_lines(ep.task), s.rag_chunk_tokens)
        atoms = store.create_many([{"text": t, "source_ids": ids} for t, ids in chunks])
        ep.op("index", len(atoms))
        handles = {a.id: f"C{i + 1}" for i, a in enumerate(atoms)}
        mem = store_memory(store, handles) if ep.steps is not None else None
        ep.step("index", f"{len(chunks)} chunks of up to {s.rag_chunk_tokens} tokens", [], mem)
        ctx = {q.id: [Item(v.text, list(v.atom.source_ids)) for v in store.read(q.question, s.retrieval_k)]
               for q in ep.task.questions}
        ep.op("read", len(ep.task.questions))
        ep.memory = store_memory(store, handles)
        yield from answer_all(ep, ctx, backend, s, key, mem)
    finally:
        store.drop()


def run_append_all(ep, backend, s, key, embedder):
    store = new_store(s, embedder)
    try:
        lines = [(u, a) for u, _, a in unit_lines(ep.task) if u]
        atoms = store.create_many([{"text": a, "source_ids": [u]} for u, a in lines]) if lines else []
        ep.op("create", len(atoms))
        handles = {a.id: f"M{i + 1}" for i, a in enumerate(atoms)}
        mem = store_memory(store, handles) if ep.steps is not None else None
        ep.step("index", f"{len(atoms)} sentences/turns stored as atoms", [], mem)
        ctx = {q.id: [Item(v.text, list(v.atom.source_ids)) for v in store.read(q.question, s.retrieval_k)]
               for q in ep.task.questions} if atoms else {q.id: [] for q in ep.task.questions}
        ep.op("read", len(ep.task.questions))
        ep.memory = store_memory(store, handles)
        yield from answer_all(ep, ctx, backend, s, key, mem)
    finally:
        store.drop()


MEM0_SYSTEM = (
    "You are a memory manager. You keep a list of memories about a long input. For a new fact, compare "
    "it with the existing similar memories and choose exactly one operation:\n"
    "ADD: new information not in memory.\n"
    "UPDATE: an existing memory is about the same thing and the new fact adds to or changes it; give its id "
    "and the merged text.\n"
    "DELETE: the new fact contradicts an existing memory that is now wrong; give its id (the new fact is "
    "then stored).\n"
    "NOOP: the fact is already known or not worth keeping.\n"
    'Reply with one JSON object: {"event": "ADD|UPDATE|DELETE|NOOP", "id": "<memory id or empty>", '
    '"text": "<merged text for UPDATE>"}')
_EVENT = re.compile(r"\b(ADD|UPDATE|DELETE|NOOP|NONE)\b", re.IGNORECASE)


def parse_mem0(text: str, n_candidates: int) -> tuple[str, int | None, str, bool]:
    """(event, candidate index or None, text, parsed) from a mem0-style reply."""
    obj = None
    m = re.search(r"\{.*?\}", text or "", re.DOTALL)
    if m:
        try:
            obj = json.loads(m.group(0))
        except json.JSONDecodeError:
            obj = None
    if isinstance(obj, dict) and isinstance(obj.get("event"), str):
        ev = obj["event"].strip().upper()
        raw_id, new_text = obj.get("id"), obj.get("text") if isinstance(obj.get("text"), str) else ""
    else:
        mm = _EVENT.search(text or "")
        if not mm:
            return "ADD", None, "", False
        ev = mm.group(1).upper()
        ids = re.findall(r"\bid\D{0,6}(\d+)", text or "", re.IGNORECASE)
        raw_id, new_text = (ids[0] if ids else None), ""
    ev = "NOOP" if ev == "NONE" else ev
    if ev not in ("ADD", "UPDATE", "DELETE", "NOOP"):
        return "ADD", None, "", False
    idx = None
    try:
        idx = int(str(raw_id).strip().strip("[]")) if raw_id not in (None, "") else None
    except ValueError:
        idx = None
    if ev in ("UPDATE", "DELETE") and (idx is None or not 0 <= idx < n_candidates):
        return "ADD", None, "", False
    return ev, idx, new_text.strip(), True


def run_mem0(ep, backend, s, key, embedder):
    store = new_store(s, embedder)
    extra_sources: dict[str, set[str]] = {}
    handles: dict[str, str] = {}
    counter = itertools.count(1)
    try:
        for uid, _, fact in [x for x in unit_lines(ep.task) if x[0]]:
            cands = store.read(fact, s.mem0_k) if len(store) else []
            listing = "\n".join(f"[{i}] {v.atom.text}" for i, v in enumerate(cands)) or "(none)"
            msgs = [{"role": "system", "content": MEM0_SYSTEM},
                    {"role": "user", "content": f"Existing similar memories:\n{listing}\n\nNew fact: {fact}\n\nOperation:"}]
            (out,) = yield [Request(msgs, s.manager_max_new_tokens, key, role="manage")]
            ev, idx, new_text, ok = parse_mem0(out, len(cands))
            if not ok:
                ep.op("parse_failures")
            ep.op(ev.lower())
            if ev in ("ADD", "DELETE"):
                if ev == "DELETE":
                    store.delete(cands[idx].id)
                a = store.create(fact, source_ids=[uid])
                handles[a.id] = f"M{next(counter)}"
            elif ev == "UPDATE":
                target = cands[idx].atom
                store.update(target.id, new_text or f"{target.text}; {fact}")
                extra_sources.setdefault(target.id, set()).add(uid)
            if ep.steps is not None:
                ep.step("fact", fact, [out, f"-> {ev}" + (f" [{idx}]" if idx is not None else "")],
                        _with_extra(store_memory(store, handles), extra_sources, handles))
        ep.memory = _with_extra(store_memory(store, handles), extra_sources, handles)
        ctx = {}
        for q in ep.task.questions:
            views = store.read(q.question, s.retrieval_k) if len(store) else []
            ctx[q.id] = [Item(v.text, sorted(set(v.atom.source_ids) | extra_sources.get(v.id, set()))) for v in views]
        yield from answer_all(ep, ctx, backend, s, key, ep.memory if ep.steps is not None else None)
    finally:
        store.drop()


def _with_extra(mem: list[dict], extra: dict[str, set[str]], handles: dict[str, str]) -> list[dict]:
    inv = {h: aid for aid, h in handles.items()}
    for m in mem:
        more = extra.get(inv.get(m["handle"], ""), set())
        if more:
            m["sources"] = sorted(set(m["sources"]) | more)
    return mem


MEMAGENT_SYSTEM = ("You read a long input chunk by chunk and keep a memory of at most {n} tokens that will be "
                   "used to answer the questions. Rewrite the memory: keep what matters for the questions and "
                   "add what the new chunk says about them. Reply with the new memory only.")


def run_memagent(ep, backend, s, key, embedder):
    chunks = pack_chunks(backend, unit_lines(ep.task), s.memagent_chunk_tokens)
    qtext = "\n".join(f"{q.id}: {q.question}" for q in ep.task.questions)
    memory = ""
    for i, (chunk, _) in enumerate(chunks):
        msgs = [{"role": "system", "content": MEMAGENT_SYSTEM.format(n=s.memagent_memory_tokens)},
                {"role": "user", "content": f"# Questions\n{qtext}\n\n# Current memory\n{memory or '(empty)'}\n\n"
                                            f"# New chunk ({i + 1} of {len(chunks)})\n{chunk}\n\nNew memory:"}]
        (out,) = yield [Request(msgs, s.memagent_memory_tokens, key, role="manage")]
        memory = backend.truncate(out.strip(), s.memagent_memory_tokens)
        ep.op("rewrite")
        ep.step("chunk", chunk, [out], [{"handle": "memory", "text": memory, "role": "primary", "relations": {},
                                         "sources": []}])
    ep.memory = [{"handle": "memory", "text": memory, "role": "primary", "relations": {}, "sources": []}]
    ctx = {q.id: [Item(memory or "(empty memory)", [])] for q in ep.task.questions}
    ep.extra["no_sources"] = True
    yield from answer_all(ep, ctx, backend, s, key, ep.memory)


def run_roam(ep, backend, s, key, embedder):
    from atommem_rl.memory.atom import Relation

    store = new_store(s, embedder)
    handles: dict[str, str] = {}
    counter = itertools.count(1)
    try:
        for uid, _, fact in [x for x in unit_lines(ep.task) if x[0]]:
            cands = [v for v in (store.read(fact, s.roam_k) if len(store) else []) if v.score >= s.roam_min_similarity]
            atom = store.create(fact, source_ids=[uid])
            handles[atom.id] = f"M{next(counter)}"
            ep.op("create")
            actions = []
            if cands:
                listing = "\n".join(f"{i + 1}. {v.atom.text}" for i, v in enumerate(cands))
                msgs = [{"role": "system", "content": ROAM_SYSTEM},
                        {"role": "user", "content": f"NEW: {fact}\nOLDER:\n{listing}\n\nLabels:"}]
                (out,) = yield [Request(msgs, s.manager_max_new_tokens, key, role="label")]
                labels, ok = parse_roam(out, len(cands))
                if not ok:
                    ep.op("parse_failures")
                actions.append(out)
                for i, v in enumerate(cands, 1):
                    rel = Relation.parse(labels[i])
                    if v.id in store and atom.id in store:
                        try:
                            store.relate(atom.id, v.id, rel)
                            ep.op("relate")
                            actions.append(f"{rel.value}({handles[atom.id]}, {handles.get(v.id, v.id)})")
                        except Exception as exc:  # a refused label (cycle) is the rules' decision
                            actions.append(f"refused {rel.value}: {type(exc).__name__}")
            if ep.steps is not None:
                ep.step("fact", fact, actions, store_memory(store, handles))
        ep.memory = store_memory(store, handles)
        ctx = {q.id: [Item(v.text, sorted({*v.atom.source_ids, *[sid for e in v.evidence_ids
                                                                  for sid in (store.get_any(e).source_ids if store.get_any(e) else ())]}))
                       for v in store.read(q.question, s.retrieval_k)] if len(store) else []
               for q in ep.task.questions}
        yield from answer_all(ep, ctx, backend, s, key, ep.memory if ep.steps is not None else None)
    finally:
        store.drop()


def _pipeline(name: str):
    def run(ep, backend, s, key, embedder):
        from atommem_rl.extraction.pipeline import VARIANTS, run_pipeline  # heavy: imported when run

        return (yield from run_pipeline(ep, backend, s, key, embedder, VARIANTS[name]))

    return run


READERS = {"full_context": run_full_context, "rag": run_rag, "append_all": run_append_all, "mem0": run_mem0,
           "memagent": run_memagent, "roam": run_roam, **{m: _pipeline(m) for m in PIPELINE_METHODS}}
