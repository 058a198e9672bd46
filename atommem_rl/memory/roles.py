"""Atom roles derived from ROAM relation labels: pure functions, no Chroma.

A role is never a stored decision: it follows from the labels between *active* atoms, so a label, a
deletion or a reopened store always yields the same roles. ``label(new, old)`` is held by the new
atom (``new.relations[old.id]``). The rules (:func:`derive_role`):

    deleted    a deleted atom stays deleted;
    evidence   its own winning label says an older active atom covers it (equivalent,
               new-subsumed-by-old), or an active atom holds a label about it that outdates or
               subsumes it (conflict, old-subsumed-by-new);
    primary    otherwise (independent labels change nothing).

An atom's winning label (:func:`top_label`) is the highest-priority one it holds about an active
atom: conflict > old-subsumed-by-new > equivalent > new-subsumed-by-old > independent. A label that
would make atoms demote each other in a cycle is refused (:func:`would_cycle`), so no atom can end up
kept as evidence of itself.

Every function reads ``atoms`` (id -> the committed Atom), ``incoming`` (old id -> ids of atoms that
hold a label about it, as :func:`incoming_index` builds it) and ``staged`` (id -> the Atom as a
pending write would leave it; staged atoms take precedence and may add labels ``incoming`` does not
know yet). The store applies what they return.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Set

from .atom import DEMOTES_NEW, DEMOTES_OLD, PRIORITY, Atom, Relation, Role
from .errors import InvalidRelationError

Atoms = Mapping[str, Atom]
Incoming = Mapping[str, Set[str]]
_NONE: Mapping[str, Atom] = {}
_NO_IDS: frozenset[str] = frozenset()


def parse_label(label: str | Relation, new_id: str, old_id: str) -> Relation:
    """The relation ``label(new, old)`` names; InvalidRelationError for an unknown label or a self-label."""
    try:
        rel = Relation.parse(label)
    except ValueError as exc:
        raise InvalidRelationError(str(exc)) from None
    if new_id == old_id:
        raise InvalidRelationError(f"an atom cannot be related to itself ({new_id!r})")
    return rel


def incoming_index(atoms: Iterable[Atom]) -> dict[str, set[str]]:
    """old id -> ids of the atoms holding a label about it (deleted holders included)."""
    out: dict[str, set[str]] = {}
    for atom in atoms:
        for old in atom.relations:
            out.setdefault(old, set()).add(atom.id)
    return out


def demoters(atom_id: str, atoms: Atoms, incoming: Incoming,
             staged: Mapping[str, Atom] = _NONE) -> Iterator[tuple[Atom, Relation]]:
    """(atom, label) for every active atom holding a label *about* ``atom_id``."""
    for src in incoming.get(atom_id, _NO_IDS) | {s for s, a in staged.items() if atom_id in a.relations}:
        a = staged.get(src, atoms.get(src))
        if a is not None and a.active and atom_id in a.relations:
            yield a, a.relations[atom_id]


def top_label(atom: Atom, atoms: Atoms, staged: Mapping[str, Atom] = _NONE) -> Relation | None:
    """The highest-priority label ``atom`` holds about an active atom (None: no such label)."""
    best = None
    for old_id, rel in atom.relations.items():
        old = staged.get(old_id, atoms.get(old_id))
        if old is None or not old.active:
            continue
        if best is None or PRIORITY[rel] > PRIORITY[best]:
            best = rel
    return best


def derive_role(atom: Atom, atoms: Atoms, incoming: Incoming, staged: Mapping[str, Atom] = _NONE) -> Role:
    """Evidence when its own winning label says it is covered by an older atom (EQV, NSO), or
    when an active atom labelled it outdated or subsumed (CON, OSN); Primary otherwise."""
    if not atom.active:
        return Role.DELETED
    if top_label(atom, atoms, staged) in DEMOTES_NEW:
        return Role.EVIDENCE
    if any(rel in DEMOTES_OLD for _, rel in demoters(atom.id, atoms, incoming, staged)):
        return Role.EVIDENCE
    return Role.PRIMARY


def rederive(ids: Iterable[str], atoms: Atoms, incoming: Incoming, *, staged: Mapping[str, Atom] | None = None,
             overrides: Mapping[str, Role] | None = None) -> dict[str, Role]:
    """New roles of the active atoms among ``ids``, only those that differ from their committed role.
    ``overrides`` forces roles first (a deletion: the deleted atom no longer demotes anyone)."""
    staged = dict(staged or {})
    for aid, role in (overrides or {}).items():
        staged[aid] = dataclasses.replace(staged.get(aid, atoms[aid]), role=role)
    out = {}
    for aid in ids:
        atom = staged.get(aid, atoms.get(aid))
        if atom is None or not atom.active:
            continue
        role = derive_role(atom, atoms, incoming, staged)
        if role is not atoms[aid].role:
            out[aid] = role
    return out


def would_cycle(new_id: str, old_id: str, rel: Relation, atoms: Atoms, incoming: Incoming,
                links: Mapping[str, Mapping[str, Relation]]) -> bool:
    """Would ``rel(new, old)`` close a loop in the demotion graph (edge a -> b: a keeps b as evidence)?

    ``links`` overrides the outgoing labels of the atoms being related (with the new label in). Every
    CON/OSN and EQV/NSO label between active atoms counts, whether or not it currently wins, so no
    later change can form a loop.
    """
    if rel is Relation.INDEPENDENT:
        return False
    winner, covered = (new_id, old_id) if rel in DEMOTES_OLD else (old_id, new_id)

    def live(aid: str) -> bool:
        atom = atoms.get(aid)
        return atom is not None and atom.active

    def outgoing(aid: str) -> Mapping[str, Relation]:
        return links.get(aid, atoms[aid].relations)

    def successors(aid: str) -> Iterable[str]:
        for other, r in outgoing(aid).items():
            if r in DEMOTES_OLD and live(other):
                yield other
        for src in incoming.get(aid, _NO_IDS) | {s for s, lbl in links.items() if aid in lbl}:
            if live(src) and outgoing(src).get(aid) in DEMOTES_NEW:
                yield src

    stack, seen = [covered], set()
    while stack:  # is there already a path covered -> ... -> winner?
        cur = stack.pop()
        if cur == winner:
            return True
        if cur not in seen:
            seen.add(cur)
            stack.extend(successors(cur))
    return False


def relabel(new: Atom, old: Atom, rel: Relation, atoms: Atoms, incoming: Incoming,
            clock: int) -> tuple[dict[str, Atom], dict[str, Role]]:
    """Recording ``rel(new, old)``: the atoms as it leaves them (stamped ``updated_at=clock``) and the
    roles that change (id -> role). A pair carries one label, so one ``old`` held about ``new`` goes.
    Raises InvalidRelationError, and changes nothing, when the label would close a demotion cycle."""
    links = {new.id: dict(new.relations), old.id: dict(old.relations)}
    links[old.id].pop(new.id, None)  # one label per pair
    links[new.id][old.id] = rel
    if would_cycle(new.id, old.id, rel, atoms, incoming, links):
        raise InvalidRelationError(f"{rel.value}({new.id}, {old.id}) would make atoms demote each other in a cycle")
    staged = {aid: dataclasses.replace(atoms[aid], relations=rels, updated_at=clock) for aid, rels in links.items()}
    changed = rederive({new.id, old.id}, atoms, incoming, staged=staged)
    for aid, role in changed.items():
        staged[aid] = dataclasses.replace(staged.get(aid, atoms[aid]), role=role, updated_at=clock)
    return staged, changed


def deletion(atom: Atom, atoms: Atoms, incoming: Incoming) -> dict[str, Role]:
    """Deleting ``atom``: id -> new role for it (deleted) and for the atoms it labelled or was labelled
    by that change (an atom it had demoted may become Primary again)."""
    changed = {atom.id: Role.DELETED}
    affected = set(atom.relations) | incoming.get(atom.id, _NO_IDS)
    changed.update(rederive(affected, atoms, incoming, overrides=changed))
    return changed
