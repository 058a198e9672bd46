"""Hidden evidence attribution: which task units an atom restates, never shown to the policy.

Each created (or updated) atom is attributed to the units of the current or previous chunk whose terms it
shares (term overlap). That is how the measurements that need gold data are taken: evidence recall and the
confounder-token share of the memory views shown at answer time, and relation-label accuracy against the
task's gold labels."""

from __future__ import annotations

from typing import Callable

from atommem_rl.memory import text as _text
from atommem_rl.memory.atom import Relation


def unit_terms(units: dict) -> dict[str, set[str]]:
    """The term set of every task unit (computed once per environment)."""
    return {uid: set(_text.terms(u.statement())) for uid, u in units.items()}


def attribute(content: str, chunks: list, chunk_index: int, terms_of: dict[str, set[str]]) -> list[str]:
    """Units of the current (or previous) chunk that ``content`` restates (hidden bookkeeping)."""
    terms = set(_text.terms(content))
    if not terms:
        return []
    cand: list[str] = []
    for ci in (chunk_index, chunk_index - 1):
        if 0 <= ci < len(chunks):
            cand.extend(chunks[ci].unit_ids)
    out = []
    for uid in dict.fromkeys(cand):
        ut = terms_of.get(uid) or set()
        if not ut:
            continue
        shared = len(ut & terms)
        if shared >= min(2, len(ut)) and shared / min(len(ut), len(terms)) >= 0.6:
            out.append(uid)
    return out


def sources(store, atom_id: str, extra_sources: dict[str, set[str]]) -> set[str]:
    """The units an atom was attributed to: its stored source ids plus those its updates added."""
    atom = store.get_any(atom_id)
    src = set(atom.source_ids) if atom is not None else set()
    return src | extra_sources.get(atom_id, set())


def check_relation(new: str, old: str, rel: Relation, store, extra_sources: dict[str, set[str]],
                   gold_labels: dict, exhaustive: bool, checks: dict[str, int]) -> None:
    """Count a label the policy gave in ``checks`` (labelled, gold, correct): the gold labels are those
    between the two atoms' source units; with ``exhaustive`` gold relations, attributed atoms with no gold
    label between their units are independent."""
    checks["labelled"] += 1
    new_src, old_src = sources(store, new, extra_sources), sources(store, old, extra_sources)
    golds = {gold_labels.get((a, b)) for a in new_src for b in old_src}
    golds.discard(None)
    if not golds and exhaustive and new_src and old_src:
        golds = {Relation.INDEPENDENT}
    if golds:
        checks["gold"] += 1
        checks["correct"] += int(rel in golds)


def note_answer_views(views: list, store, extra_sources: dict[str, set[str]], units: dict,
                      count: Callable[[str], int], shown_units: set[str], view_tokens: dict[str, int]) -> None:
    """Record the memory views shown in an answer-phase prompt: the units they (and the atoms they fuse)
    restate go into ``shown_units`` (evidence recall); their tokens into ``view_tokens`` (total, and
    confounder when any of those units is a confounder or distractor)."""
    for v in views:
        srcs = set(sources(store, v.id, extra_sources))
        for ev in v.evidence_ids:
            srcs |= sources(store, ev, extra_sources)
        shown_units |= srcs
        n = count(v.text)
        view_tokens["total"] += n
        if any(units[s].role in ("confounder", "distractor") for s in srcs if s in units):
            view_tokens["confounder"] += n
