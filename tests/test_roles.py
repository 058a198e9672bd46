"""Role derivation from ROAM labels (atommem_rl/memory/roles.py) on plain dicts of atoms, no Chroma:
the rules of docs/DESIGN.md section 1, the one-label-per-pair rule, priority, deletion and the cycle refusal."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from atommem_rl.memory.atom import Atom, Relation, Role
from atommem_rl.memory.errors import InvalidRelationError
from atommem_rl.memory.roles import (deletion, derive_role, incoming_index, parse_label, rederive, relabel,
                                     top_label, would_cycle)

P, E, D = Role.PRIMARY, Role.EVIDENCE, Role.DELETED


def mirror(*ids: str) -> dict[str, Atom]:
    return {i: Atom(id=i, text=f"fact {i}") for i in ids}


def relate(atoms: dict[str, Atom], new: str, old: str, label: str, clock: int = 1) -> dict[str, Role]:
    """What AtomStore.relate does with relabel's decision: commit the staged atoms."""
    staged, changed = relabel(atoms[new], atoms[old], Relation(label), atoms, incoming_index(atoms.values()), clock)
    atoms.update(staged)
    return changed


def roles_of(atoms: dict[str, Atom]) -> dict[str, Role]:
    return {i: a.role for i, a in atoms.items()}


@pytest.mark.parametrize("label", ["conflict", "old_subsumed_by_new"])
def test_a_label_that_outdates_or_subsumes_demotes_the_old_atom(label):
    atoms = mirror("old", "new")
    assert relate(atoms, "new", "old", label) == {"old": E}
    assert roles_of(atoms) == {"old": E, "new": P}
    assert atoms["new"].relations == {"old": Relation(label)}  # the label is held by the new atom


@pytest.mark.parametrize("label", ["equivalent", "new_subsumed_by_old"])
def test_a_label_that_says_the_new_atom_is_covered_demotes_the_new_atom(label):
    atoms = mirror("old", "new")
    assert relate(atoms, "new", "old", label) == {"new": E}
    assert roles_of(atoms) == {"old": P, "new": E}


def test_independent_changes_no_role():
    atoms = mirror("a", "b")
    assert relate(atoms, "b", "a", "independent") == {}
    assert roles_of(atoms) == {"a": P, "b": P}


def test_relabel_is_pure_and_stamps_the_clock():
    atoms = mirror("a", "b")
    before = copy.deepcopy(atoms)
    incoming = incoming_index(atoms.values())
    staged, changed = relabel(atoms["b"], atoms["a"], Relation.CONFLICT, atoms, incoming, clock=7)
    assert atoms == before and incoming == {}  # nothing the caller passed in was touched
    assert changed == {"a": E}
    assert {i: (a.role, a.updated_at) for i, a in staged.items()} == {"a": (E, 7), "b": (P, 7)}


def test_relating_a_pair_again_either_way_replaces_its_label():
    atoms = mirror("a", "b")
    relate(atoms, "b", "a", "conflict")
    assert relate(atoms, "a", "b", "independent") == {"a": P}  # b's conflict label about a is gone
    assert atoms["b"].relations == {} and atoms["a"].relations == {"b": Relation.INDEPENDENT}
    assert roles_of(atoms) == {"a": P, "b": P}


def test_the_winning_label_is_the_highest_priority_one_about_an_active_atom():
    atoms = mirror("x", "y")
    n = Atom(id="n", text="fact n", relations={"x": Relation.EQUIVALENT, "y": Relation.CONFLICT})
    atoms["n"] = n
    assert top_label(n, atoms) is Relation.CONFLICT  # conflict outranks equivalent
    assert derive_role(n, atoms, incoming_index(atoms.values())) is P  # so n is not covered by x
    gone = {"y": Atom(id="y", text="fact y", role=D)}
    assert top_label(n, atoms, gone) is Relation.EQUIVALENT  # labels about deleted atoms do not count
    assert derive_role(n, atoms, incoming_index(atoms.values()), gone) is E


def test_deleting_the_atom_that_demoted_another_makes_it_primary_again():
    atoms = mirror("a", "b")
    relate(atoms, "b", "a", "conflict")
    assert deletion(atoms["b"], atoms, incoming_index(atoms.values())) == {"b": D, "a": P}


def test_deleting_an_evidence_atom_changes_only_its_own_role():
    atoms = mirror("a", "b")
    relate(atoms, "b", "a", "conflict")
    assert deletion(atoms["a"], atoms, incoming_index(atoms.values())) == {"a": D}


def test_a_label_closing_a_demotion_cycle_is_refused_and_changes_nothing():
    atoms = mirror("a", "b", "c")
    relate(atoms, "b", "a", "conflict")  # b keeps a as evidence
    relate(atoms, "c", "b", "old_subsumed_by_new")  # c keeps b
    before = copy.deepcopy(atoms)
    with pytest.raises(InvalidRelationError, match="cycle"):
        relate(atoms, "a", "c", "conflict")  # a would keep c: a -> c -> b -> a
    assert atoms == before
    # the same loop through a new-side label: c equivalent to a means a keeps c
    assert would_cycle("c", "a", Relation.EQUIVALENT, atoms, incoming_index(atoms.values()),
                       {"c": {**atoms["c"].relations, "a": Relation.EQUIVALENT}, "a": {}})
    # the opposite direction adds no loop, and neither does an independent label
    assert not would_cycle("a", "c", Relation.EQUIVALENT, atoms, incoming_index(atoms.values()),
                           {"a": {"c": Relation.EQUIVALENT}, "c": dict(atoms["c"].relations)})
    assert relate(atoms, "a", "c", "independent") == {}


def test_a_deleted_atom_breaks_the_loop():
    atoms = mirror("a", "b", "c")
    relate(atoms, "b", "a", "conflict")
    relate(atoms, "c", "b", "conflict")
    for aid, role in deletion(atoms["b"], atoms, incoming_index(atoms.values())).items():
        atoms[aid] = dataclasses.replace(atoms[aid], role=role)
    assert relate(atoms, "a", "c", "conflict") == {"c": E}  # c -> b -> a no longer exists


def test_roles_are_a_function_of_the_labels_alone():
    """A mirror rebuilt from stored atoms (a reopened store) re-derives exactly the roles it holds."""
    atoms = mirror("a", "b", "c", "d")
    relate(atoms, "b", "a", "conflict")
    relate(atoms, "c", "b", "equivalent")
    relate(atoms, "d", "c", "independent")
    assert roles_of(atoms) == {"a": E, "b": P, "c": E, "d": P}
    assert rederive(atoms, atoms, incoming_index(atoms.values())) == {}
    wrong = {**atoms, "a": Atom(id="a", text="fact a", role=P, relations={})}
    assert rederive(wrong, wrong, incoming_index(wrong.values())) == {"a": E}


def test_parse_label_refuses_unknown_labels_and_self_relations():
    assert parse_label("conflict", "b", "a") is Relation.CONFLICT
    with pytest.raises(InvalidRelationError):
        parse_label("contradicts", "b", "a")
    with pytest.raises(InvalidRelationError, match="itself"):
        parse_label("conflict", "a", "a")
