"""Verification before storing: which extracted facts are written, and how they relate to memory.

Algorithm (per block of new facts, against the store as it was before the block):

1. Candidates, filtered by shared metadata: the store's ``read`` with the fact's participants as a
   filter (an atom naming any of them; no filter when the fact names nobody), ``fetch`` nearest by
   embedding. Time is deliberately *not* a filter: an update ("moved to Berlin in 2021") is later
   than the fact it replaces, and that pair is the one that must be found.
2. Hybrid similarity ``h = w_cos * cosine + w_jac * Jaccard(keywords)`` (the event layer's weights,
   0.7/0.3; keywords are the store's stemmed terms); candidates with ``h >= threshold`` are kept,
   best ``k`` per fact.
3. One model call per ``pairs_per_call`` (new fact, candidate) pairs labels each pair with one of
   ROAM's five relations (IND, EQV, OSN, NSO, CON; the reply format and parser of the ``roam`` eval
   method). An unlabelled pair is IND (counted in ``verify_unparsed``).
4. Decision per fact by its highest-priority label (CON > OSN > EQV > NSO > IND):
   EQV/NSO -> redundant, not written; CON/OSN -> written, and the label recorded with
   ``store.relate`` so the store's rules demote the old atom to Evidence (the update tuple);
   IND or no candidate -> written. A fact whose normalised text repeats an earlier fact of the same
   block is redundant without a call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from atommem_rl.inference.chat_backends import Request
from atommem_rl.memory import text as _text
from atommem_rl.memory.atom import DEMOTES_NEW, DEMOTES_OLD, PRIORITY, Relation
from atommem_rl.memory.events import jaccard
from atommem_rl.memory.store import AtomStore, MemoryView

from .schema import Fact

SYSTEM = (
    "You compare NEW facts with OLD stored facts. For each numbered pair give one label:\n"
    "IND: independent, about different things.\nEQV: equivalent, the same content.\n"
    "OSN: the old fact is subsumed by the new one (the new one is more complete).\n"
    "NSO: the new fact is subsumed by the old one (nothing new).\n"
    "CON: conflict, the new fact replaces the old one (e.g. a change over time).\n"
    "Reply with one line per pair: <number>: <label>.")


@dataclass
class VerifySettings:
    fetch: int = 8
    k: int = 3
    w_cos: float = 0.7
    w_jac: float = 0.3
    threshold: float = 0.3
    pairs_per_call: int = 12
    max_new_tokens_per_pair: int = 5


@dataclass
class Planned:
    fact: Fact
    keywords: tuple[str, ...]
    candidates: list[tuple[MemoryView, float]] = field(default_factory=list)
    labels: list[Relation] = field(default_factory=list)
    duplicate: bool = False


def fact_keywords(store: AtomStore, f: Fact) -> tuple[str, ...]:
    """Stemmed terms of the fact's text and keywords (the store's keyword form)."""
    return _text.keywords(f.text + " " + " ".join(f.keywords), store.keyword_limit)


def plan(store: AtomStore, facts: list[Fact], s: VerifySettings) -> list[Planned]:
    """Steps 1-2 and the in-block duplicate check."""
    out, seen = [], set()
    for f in facts:
        p = Planned(f, fact_keywords(store, f))
        norm = " ".join(_text.words(f.text))
        if norm in seen:
            p.duplicate = True
        seen.add(norm)
        if not p.duplicate and len(store):
            views = store.read(f.text, s.fetch, participants=f.participants or None)
            scored = [(v, s.w_cos * v.score + s.w_jac * jaccard(p.keywords, v.atom.keywords)) for v in views]
            p.candidates = sorted([x for x in scored if x[1] >= s.threshold], key=lambda x: -x[1])[: s.k]
        out.append(p)
    return out


def requests(planned: list[Planned], s: VerifySettings, key: Any) -> tuple[list[Request], list[list[tuple[int, int]]]]:
    """Step 3: the labelling calls and, per call, which (fact index, candidate index) each line is."""
    pairs = [(i, j) for i, p in enumerate(planned) for j in range(len(p.candidates))]
    reqs, index = [], []
    for start in range(0, len(pairs), s.pairs_per_call):
        part = pairs[start:start + s.pairs_per_call]
        lines = [f"{n}. NEW: {planned[i].fact.text}\n   OLD: {planned[i].candidates[j][0].atom.text}"
                 for n, (i, j) in enumerate(part, 1)]
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "\n".join(lines) + "\n\nLabels:"}]
        reqs.append(Request(msgs, s.max_new_tokens_per_pair * len(part) + 4, key, role="verify"))
        index.append(part)
    return reqs, index


def read_labels(planned: list[Planned], index: list[list[tuple[int, int]]], replies: list[str]) -> int:
    """Fill ``labels``; returns how many calls had no parsable label at all."""
    from atommem_rl.eval.reading import parse_roam

    for p in planned:
        p.labels = [Relation.INDEPENDENT] * len(p.candidates)
    unparsed = 0
    for part, reply in zip(index, replies):
        labels, ok = parse_roam(reply, len(part))
        unparsed += not ok
        for n, (i, j) in enumerate(part, 1):
            planned[i].labels[j] = Relation.parse(labels[n])
    return unparsed


def decision(p: Planned) -> str:
    """Step 4: ``write``, ``update`` (written with CON/OSN links) or ``redundant``."""
    if p.duplicate:
        return "redundant"
    if not p.labels:
        return "write"
    top = max(p.labels, key=PRIORITY.__getitem__)
    if top in DEMOTES_OLD:
        return "update"
    if top in DEMOTES_NEW:
        return "redundant"
    return "write"
