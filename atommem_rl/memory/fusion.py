"""ROAM's fused views: one compact text per Primary atom that folds in its evidence.

A Primary atom P keeps as evidence (transitively):
  * atoms it superseded (P labelled them ``conflict``): temporal changes, shown as
    ``previously: <old text> (until <date P starts>)``, most recent first, chained;
  * its own earlier texts from ``update`` (history), shown the same way;
  * atoms labelled equivalent to it: never shown (a paraphrase adds nothing);
  * atoms in a subsumption relation with it: shown as ``also: <text>`` only when they add terms P's
    view does not already contain (complementary details). By the label they should add nothing,
    but labels come from a model and may be wrong; the term check keeps the detail visible then.

The view is what retrieval returns, so redundant and outdated atoms never compete with the current
fact for the k slots, yet the change history stays answerable ("where did X live before?").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .atom import DEMOTES_NEW, DEMOTES_OLD, Atom, Relation, Role
from .roles import top_label

if TYPE_CHECKING:
    from .store import AtomStore

MAX_CHANGES = 3
MAX_DETAILS = 3
MAX_DEPTH = 8


def evidence_of(store: "AtomStore", atom: Atom) -> list[tuple[Atom, Relation]]:
    """Direct evidence of ``atom``: (evidence atom, the label that made it evidence)."""
    out = []
    for old_id, rel in atom.relations.items():
        old = store.get_any(old_id)
        if old is not None and old.role is Role.EVIDENCE and rel in DEMOTES_OLD:
            out.append((old, rel))
    for src_id in sorted(store._incoming.get(atom.id, ())):
        src = store.get_any(src_id)
        if src is None or src.role is not Role.EVIDENCE:
            continue
        rel = src.relations.get(atom.id)
        if rel in DEMOTES_NEW and top_label(src, store._atoms) in DEMOTES_NEW:
            out.append((src, rel))
    return out


def fused_view(store: "AtomStore", atom: Atom) -> tuple[str, list[str]]:
    """(view text, ids of all evidence folded or reachable) for a live atom."""
    if not atom.history and not atom.relations and not store._incoming.get(atom.id):
        return atom.text, []  # the common case on the read path: nothing to fold
    changes: list[str] = []
    for h in reversed(atom.history):
        changes.append(h.text + (f" (until {h.replaced_on})" if h.replaced_on else ""))
    details: list[str] = []
    covered = set(atom.keywords)
    evidence_ids: list[str] = []
    seen = {atom.id}

    def walk(node: Atom, depth: int) -> None:
        if depth > MAX_DEPTH:
            return
        for ev, rel in evidence_of(store, node):
            if ev.id in seen:
                continue
            seen.add(ev.id)
            evidence_ids.append(ev.id)
            if rel is Relation.CONFLICT:
                until = f" (until {node.time.start.isoformat()})" if node.time is not None else ""
                changes.append(ev.text + until)
            elif rel is not Relation.EQUIVALENT:
                extra = [k for k in ev.keywords if k not in covered]
                if extra:
                    details.append(ev.text)
                    covered.update(ev.keywords)
            walk(ev, depth + 1)

    walk(atom, 0)
    text = atom.text
    if changes:
        shown = "; ".join(changes[:MAX_CHANGES])
        more = f"; +{len(changes) - MAX_CHANGES} earlier" if len(changes) > MAX_CHANGES else ""
        text += f" [previously: {shown}{more}]"
    if details:
        shown = "; ".join(details[:MAX_DETAILS])
        more = f"; +{len(details) - MAX_DETAILS} more" if len(details) > MAX_DETAILS else ""
        text += f" [also: {shown}{more}]"
    return text, evidence_ids
