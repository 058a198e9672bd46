"""The graph-memory pipeline (AtomMem with events, profiles and RWR) as eval methods.

Per task, block by block (a dialogue session or a document), in stream order:

1. extract: the block's windows through the extractor (``extractor.py``; one batched call per
   window, bounded repair/retry, invalid output counted and skipped);
2. verify: candidates by shared participants, hybrid similarity, model-labelled relations
   (``verify.py``); redundant facts are not written, updates are written with their CON/OSN link;
3. store: written facts become atoms (text, participants, stemmed keywords, time span, source turn
   ids, stream position); with ``events`` each joins or opens an event (``memory.events``
   ``create_in_event``); with ``profiles`` the facts' profile candidates are queued
   (``memory.profiles``) and flushed once at the end of the block with the session date, keeping
   history;
4. answer, after the last block, one call per question: retrieval with ``strategy`` (``graph``:
   participant/time filters, event compensation, RWR; ``hybrid``: its first stage only) and, with
   ``profiles``, the profiles of the participants the question names (else of the top facts'
   participants) first, then the facts with their time anchors, in one context.

Variants (``VARIANTS``): ``atommem_graph`` (everything), ``atommem_flat`` (facts only: no events,
profiles or graph), ``no_graph`` (events and profiles, hybrid retrieval: no RWR, no event
compensation), ``no_profile`` (graph retrieval, no profiles). Every call (extraction, retries,
verification, answering) goes through the chat backend (``atommem_rl.inference.chat_backends``) and is counted per task. Settings from
``EvalSettings`` (so ``atommem eval`` flags): the extractor's output budget is
``--policy-max-new-tokens`` and its window at most ``--chunk-tokens`` tokens (and 8 turns); answers
use ``--retrieval-k`` facts and ``--reader-max-new-tokens``.
"""

from __future__ import annotations

import datetime as dt
import itertools
from dataclasses import dataclass

from atommem_rl.memory.atom import Relation
from atommem_rl.memory.store import AtomDraft

from . import verify as V
from .extractor import ExtractSettings, add_stats, block_date, extract_block


@dataclass(frozen=True)
class Variant:
    events: bool
    profiles: bool
    strategy: str  # memory.retrieval strategy at answer time


VARIANTS = {
    "atommem_graph": Variant(events=True, profiles=True, strategy="graph"),
    "atommem_flat": Variant(events=False, profiles=False, strategy="hybrid"),
    "no_graph": Variant(events=True, profiles=True, strategy="hybrid"),
    "no_profile": Variant(events=True, profiles=False, strategy="graph"),
}
PROFILE_CHARS = 400
PROFILES_SHOWN = 2


def _sources_of(store, view) -> list[str]:
    out = set(view.atom.source_ids)
    for e in view.evidence_ids:
        a = store.get_any(e)
        if a is not None:
            out.update(a.source_ids)
    return sorted(out)


def _profile_items(prof, question: str, views) -> list:
    from atommem_rl.eval.reading import Item
    from atommem_rl.memory.retrieval import mentioned_participants

    names = prof.participants()
    if not names:
        return []
    chosen = mentioned_participants(question, names)
    if not chosen:  # the participants of the best facts
        chosen = list(dict.fromkeys(p for v in views for p in v.atom.participants if p in names))
    items = []
    for name in chosen[:PROFILES_SHOWN]:
        try:
            text = prof.render(name, PROFILE_CHARS)
            recs = prof.profile(name)
        except Exception:  # a name the layer does not know: nothing to show
            continue
        if text and recs:
            items.append(Item(text, sorted({x for r in recs.values() for x in r.get("sources") or ()})))
    return items


def run_pipeline(ep, backend, s, key, embedder, variant: Variant, xs: ExtractSettings | None = None,
                 vs: V.VerifySettings | None = None):
    """Generator for the eval harness (``reading.drive``); see the module docstring."""
    from atommem_rl.eval.reading import Item, answer_all, new_store, store_memory
    from atommem_rl.memory.events import EventLayer, create_in_event
    from atommem_rl.memory.profiles import ProfileLayer
    from atommem_rl.memory.retrieval import retrieve

    # the extractor is the memory-writing model: it gets the policy's output budget and chunk size
    xs = xs or ExtractSettings(max_new_tokens=s.policy_max_new_tokens, window_tokens=s.chunk_tokens)
    vs = vs or V.VerifySettings()
    task = ep.task
    store = new_store(s, embedder)
    layer = prof = None
    handles: dict[str, str] = {}
    counter = itertools.count(1)
    stats: dict[str, int] = dict.fromkeys(("write", "update", "redundant", "verify_calls", "verify_unparsed"), 0)
    position = {u.id: i for i, u in enumerate(u for b in task.blocks for u in b.units)}
    last_day = None
    try:
        layer = EventLayer(store) if variant.events else None
        prof = ProfileLayer(store) if variant.profiles else None
        for block in task.blocks:
            results = yield from extract_block(task, block, backend, xs, key)
            add_stats(stats, results)
            facts = [f for r in results for f in r.facts]
            planned = V.plan(store, facts, vs)
            reqs, index = V.requests(planned, vs, key)
            replies = (yield reqs) if reqs else []
            stats["verify_calls"] = stats.get("verify_calls", 0) + len(reqs)
            stats["verify_unparsed"] = stats.get("verify_unparsed", 0) + V.read_labels(planned, index, replies)
            actions = [f"extract: {r.replies[-1][:400]}" for r in results if r.replies]
            day = block_date(block) or last_day
            for p in planned:
                what = V.decision(p)
                stats[what] = stats.get(what, 0) + 1
                if prof is not None:
                    for item in p.fact.profile:
                        try:
                            prof.queue(item.participant, item.attribute, item.value, kind=item.kind,
                                       time=p.fact.time[0] if p.fact.time else day, source_ids=p.fact.source_turns)
                        except Exception:  # an invalid candidate is counted, never fatal
                            stats["invalid_profile"] = stats.get("invalid_profile", 0) + 1
                if what == "redundant":
                    actions.append(f"redundant: {p.fact.text}")
                    continue
                draft = AtomDraft(text=p.fact.text, participants=p.fact.participants, keywords=p.keywords,
                                  time=p.fact.time, source_ids=p.fact.source_turns,
                                  metadata={"turn": min(position.get(t, 0) for t in p.fact.source_turns)})
                try:
                    atom = create_in_event(store, layer, draft)[0] if layer is not None else store.create_many([draft])[0]
                except Exception as exc:  # a fact the store refuses (e.g. too long): counted, skipped
                    stats["store_refused"] = stats.get("store_refused", 0) + 1
                    actions.append(f"refused {type(exc).__name__}: {p.fact.text}")
                    continue
                handles[atom.id] = f"F{next(counter)}"
                ep.op("create")
                for (view, _), label in zip(p.candidates, p.labels):
                    if label in (Relation.CONFLICT, Relation.OLD_SUBSUMED_BY_NEW) and view.id in store:
                        try:
                            store.relate(atom.id, view.id, label)
                            ep.op("relate")
                        except Exception:  # a refused label (cycle) is the store's rule
                            stats["relate_refused"] = stats.get("relate_refused", 0) + 1
                actions.append(f"{what}: {handles[atom.id]} {p.fact.text}")
            if prof is not None and prof.pending:
                report = prof.flush(day or dt.date(1970, 1, 1))
                for d, n in report.counts.items():
                    stats[f"profile_{d}"] = stats.get(f"profile_{d}", 0) + n
            last_day = day
            if ep.steps is not None:
                ep.step("session", f"block {block.id}: {len(facts)} facts extracted", actions,
                        store_memory(store, handles))
        ep.memory = store_memory(store, handles)
        ctx = {}
        for q in task.questions:
            views = retrieve(store, q.question, s.retrieval_k, variant.strategy) if len(store) else []
            items = _profile_items(prof, q.question, views) if prof is not None else []
            items += [Item((f"[{v.atom.time}] " if v.atom.time else "") + v.text, _sources_of(store, v)) for v in views]
            ctx[q.id] = items
        ep.op("read", len(task.questions))
        for k in ("facts", "write", "update", "redundant", "invalid_facts", "invalid_windows", "retries"):
            if stats.get(k):
                ep.op(k, stats[k])
        ep.extra["pipeline"] = stats
        ep.extra["events"] = len(layer) if layer is not None else 0
        yield from answer_all(ep, ctx, backend, s, key, ep.memory if ep.steps is not None else None)
    finally:
        for part in (prof, layer):
            if part is not None:
                try:
                    part.drop()
                except Exception:  # dropping is cleanup; the store drop below still runs
                    pass
        store.drop()
