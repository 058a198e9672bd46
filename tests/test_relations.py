"""ROAM relation semantics: every label, the priority rule, outdated atoms never Primary, fusion."""

from __future__ import annotations

import pytest

from atommem_rl.memory.atom import Relation, Role
from atommem_rl.memory.errors import InvalidRelationError


def roles(store, *atoms):
    return [store.get(a.id).role for a in atoms]


def primary_ids(store, query, k=10):
    return {v.id for v in store.read(query, k=k)}


@pytest.mark.parametrize(
    "label, new_role, old_role",
    [
        ("independent", Role.PRIMARY, Role.PRIMARY),
        ("equivalent", Role.EVIDENCE, Role.PRIMARY),
        ("old_subsumed_by_new", Role.PRIMARY, Role.EVIDENCE),
        ("new_subsumed_by_old", Role.EVIDENCE, Role.PRIMARY),
        ("conflict", Role.PRIMARY, Role.EVIDENCE),
    ],
)
def test_each_label_sets_roles_and_never_rewrites_text(store, label, new_role, old_role):
    old = store.create("Ann lives in Oslo", participants=["Ann"])
    new = store.create("Ann now lives in Bergen, Norway", participants=["Ann"])
    store.relate(new.id, old.id, label)
    assert roles(store, new, old) == [new_role, old_role]
    assert store.get(old.id).text == "Ann lives in Oslo" and store.get(new.id).text.startswith("Ann now")
    assert store.get(new.id).relations == {old.id: Relation.parse(label)}
    # evidence is never returned as a Primary view, but is reachable with include_evidence
    expected_primary = {a.id for a, r in ((new, new_role), (old, old_role)) if r is Role.PRIMARY}
    assert primary_ids(store, "Ann lives") == expected_primary
    assert {v.id for v in store.read("Ann lives", k=10, include_evidence=True)} == {old.id, new.id}


def test_short_codes_and_names_parse():
    assert Relation.parse("CON") is Relation.CONFLICT
    assert Relation.parse("old-subsumed-by-new") is Relation.OLD_SUBSUMED_BY_NEW
    assert Relation.parse("NEW_SUBSUMED_BY_OLD") is Relation.NEW_SUBSUMED_BY_OLD
    assert Relation.parse(" eqv ") is Relation.EQUIVALENT


def test_priority_conflict_beats_equivalent(store):
    """A new atom labelled CON with one atom and EQV with another stays Primary (CON wins)."""
    a = store.create("Ann works at Acme")
    b = store.create("Ann is employed by Acme")
    new = store.create("Ann left Acme and joined Globex")
    store.relate(new.id, b.id, "equivalent")
    assert store.get(new.id).role is Role.EVIDENCE  # EQV alone makes it evidence of b
    store.relate(new.id, a.id, "conflict")
    assert roles(store, new, a, b) == [Role.PRIMARY, Role.EVIDENCE, Role.PRIMARY]


@pytest.mark.parametrize(
    "labels, expected_new",
    [
        (["new_subsumed_by_old", "independent"], Role.EVIDENCE),
        (["new_subsumed_by_old", "equivalent"], Role.EVIDENCE),
        (["equivalent", "old_subsumed_by_new"], Role.PRIMARY),
        (["old_subsumed_by_new", "conflict"], Role.PRIMARY),
        (["independent", "independent"], Role.PRIMARY),
    ],
)
def test_priority_order_decides_the_new_atoms_role(store, labels, expected_new):
    olds = [store.create(f"old fact {i} about Ann") for i in range(len(labels))]
    new = store.create("new fact about Ann")
    for old, label in zip(olds, labels):
        store.relate(new.id, old.id, label)
    assert store.get(new.id).role is expected_new
    for old, label in zip(olds, labels):
        demoted = Relation.parse(label) in (Relation.CONFLICT, Relation.OLD_SUBSUMED_BY_NEW)
        assert store.get(old.id).role is (Role.EVIDENCE if demoted else Role.PRIMARY)


def test_outdated_atoms_never_come_back_as_primary(store):
    v1 = store.create("Ann lives in Oslo", participants=["Ann"], time="2021-01-01")
    v2 = store.create("Ann lives in Bergen", participants=["Ann"], time="2022-03-01")
    v3 = store.create("Ann lives in Tromso", participants=["Ann"], time="2023-09-15")
    store.relate(v2.id, v1.id, "conflict")
    store.relate(v3.id, v2.id, "conflict")
    for q in ("Ann lives in Oslo", "Ann lives in Bergen", "Where does Ann live?"):
        hits = store.read(q, k=10)
        assert [h.id for h in hits] == [v3.id]
    view = store.read("Where does Ann live?", k=1)[0]
    # the fused view carries the current value and the change history, most recent first
    assert view.text == ("Ann lives in Tromso [previously: Ann lives in Bergen (until 2023-09-15); "
                         "Ann lives in Oslo (until 2022-03-01)]")
    assert set(view.evidence_ids) == {v1.id, v2.id}


def test_fused_view_folds_complementary_details_not_duplicates(store):
    main = store.create("Ann adopted a dog named Max")
    dup = store.create("Ann has adopted a dog called Max")
    detail = store.create("Ann's dog Max is a golden retriever puppy")
    store.relate(dup.id, main.id, "equivalent")
    store.relate(detail.id, main.id, "new_subsumed_by_old")
    text = store.read("Ann dog", k=3)[0].text
    assert text.startswith("Ann adopted a dog named Max")
    assert "golden retriever" in text and "Ann has adopted" not in text  # detail folded, duplicate not


def test_relabelling_a_pair_replaces_the_label(store):
    a, b = store.create("fact A"), store.create("fact B")
    store.relate(b.id, a.id, "conflict")
    assert roles(store, a, b) == [Role.EVIDENCE, Role.PRIMARY]
    store.relate(a.id, b.id, "conflict")  # the reverse judgement replaces the first one
    assert roles(store, a, b) == [Role.PRIMARY, Role.EVIDENCE]
    assert store.get(b.id).relations == {}
    store.relate(a.id, b.id, "independent")
    assert roles(store, a, b) == [Role.PRIMARY, Role.PRIMARY]


def test_demotion_cycles_are_refused(store):
    a, b, c = (store.create(f"fact {x}") for x in "ABC")
    store.relate(b.id, a.id, "conflict")  # b keeps a
    store.relate(c.id, b.id, "old_subsumed_by_new")  # c keeps b
    before = [store.get(x.id).to_dict() for x in (a, b, c)]
    with pytest.raises(InvalidRelationError, match="cycle"):
        store.relate(a.id, c.id, "conflict")  # a would keep c: a loop
    with pytest.raises(InvalidRelationError, match="cycle"):
        store.relate(c.id, a.id, "equivalent")  # c would be evidence of a: a loop
    assert [store.get(x.id).to_dict() for x in (a, b, c)] == before


def test_deleting_the_winner_restores_the_demoted_atom(store):
    old = store.create("Ann lives in Oslo")
    new = store.create("Ann lives in Bergen")
    store.relate(new.id, old.id, "conflict")
    changed = {k: v for k, v in {old.id: store.get(old.id).role}.items()}
    assert changed == {old.id: Role.EVIDENCE}
    store.delete(new.id)
    assert store.get(old.id).role is Role.PRIMARY
    assert [v.id for v in store.read("Ann lives", k=5)] == [old.id]


def test_roles_survive_a_reopen(store):
    from atommem_rl.memory.store import AtomStore

    old, new = store.create("Ann lives in Oslo"), store.create("Ann lives in Bergen")
    store.relate(new.id, old.id, "conflict")
    again = AtomStore(store.namespace, client=store.client, embedder=store.embedder)
    assert again.get(old.id).role is Role.EVIDENCE
    assert again.view(new.id).text == store.view(new.id).text
    third = again.create("Ann lives in Tromso")
    assert third.id == f"a3-{again.writer}"  # the sequence continues from the reopened atoms
    again.relate(third.id, new.id, "conflict")
    assert again.get(new.id).role is Role.EVIDENCE
