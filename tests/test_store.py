"""The atom store on real Chroma: CRUD, batches, history, bad input, isolation."""

from __future__ import annotations

import pytest

from atommem_rl.memory.atom import Role
from atommem_rl.memory.embeddings import HashingEmbedder
from atommem_rl.memory.errors import (
    AtomNotFoundError,
    InvalidAtomError,
    InvalidMetadataError,
    InvalidRelationError,
    MemoryStoreError,
)
from atommem_rl.memory.store import AtomDraft, AtomStore


def chroma_state(store: AtomStore) -> dict:
    """Everything Chroma holds for the namespace, to compare before/after a failed call."""
    return store.chroma_contents()


def test_create_read_update_delete(store):
    a = store.create("Ann works at Acme as an engineer", participants=["Ann"], time="2023-01-05",
                     metadata={"source": "doc1", "page": 3})
    b = store.create("Bob lives in Lisbon", participants=["Bob"], time=("2023-02-01", "2023-02-28"))
    # store-assigned ids are a<seq>-<writer>: unique across writers of one namespace
    assert (a.id, b.id) == (f"a1-{store.writer}", f"a2-{store.writer}")
    assert a.role is Role.PRIMARY and "acm" in a.keywords
    hits = store.read("Where does Ann work?", k=2)
    assert [h.id for h in hits][0] == a.id and hits[0].score > hits[1].score

    updated = store.update(a.id, "Ann works at Globex as a manager", time="2023-06-01")
    assert updated.text.startswith("Ann works at Globex")
    assert [h.text for h in updated.history] == ["Ann works at Acme as an engineer"]
    assert updated.history[0].replaced_on == "2023-06-01"
    assert "previously: Ann works at Acme as an engineer (until 2023-06-01)" in store.view(a.id).text
    assert store.get(a.id).metadata == {"source": "doc1", "page": 3}

    store.delete(b.id)
    assert b.id not in store and len(store) == 1
    assert all(h.id != b.id for h in store.read("Bob Lisbon", k=5))
    with pytest.raises(AtomNotFoundError, match="deleted"):
        store.get(b.id)
    assert store.get_any(b.id).role is Role.DELETED  # kept for the episode's log
    assert [e["op"] for e in store.log] == ["create", "create", "read", "update", "delete", "read"]


def test_filters_by_participant_and_time(store):
    store.create("Ann visited Paris", participants=["Ann"], time="2023-03-10")
    store.create("Ann visited Rome", participants=["Ann"], time="2023-07-10")
    store.create("Bob visited Paris", participants=["Bob"], time="2023-03-11")
    store.create("Someone visited Paris")  # no participants, no time
    ids = lambda views: sorted(v.atom.text for v in views)
    assert ids(store.read("visited Paris", k=10, participants=["Ann"])) == ["Ann visited Paris", "Ann visited Rome"]
    assert ids(store.read("visited", k=10, time_window=("2023-03-01", "2023-03-31"))) == [
        "Ann visited Paris", "Bob visited Paris"]
    assert ids(store.read("visited", k=10, participants=["Ann", "Bob"], time_window="2023-07-10")) == [
        "Ann visited Rome"]


def test_namespaces_are_isolated(namespace):
    emb = HashingEmbedder(64)
    one, two = AtomStore(namespace + "-a", embedder=emb), AtomStore(namespace + "-b", embedder=emb)
    one.create("secret of episode one")
    assert len(two) == 0 and two.read("secret of episode one", k=5) == []
    reopened = AtomStore(namespace + "-a", embedder=emb)  # same namespace: same atoms
    assert [a.text for a in reopened.atoms()] == ["secret of episode one"]


@pytest.mark.parametrize(
    "text, error",
    [("", InvalidAtomError), ("   \n\t", InvalidAtomError), (None, InvalidAtomError), (42, InvalidAtomError),
     ("x" * 100_000, InvalidAtomError), ("nul\x00byte", InvalidAtomError)],
)
def test_bad_text_is_refused_and_nothing_changes(store, text, error):
    aid = store.create("an existing fact").id
    before = chroma_state(store)
    with pytest.raises(error):
        store.create(text)
    with pytest.raises(error):
        store.update(aid, text)
    assert chroma_state(store) == before and store.get(aid).text == "an existing fact"


@pytest.mark.parametrize(
    "meta",
    [{"nested": {"a": 1}}, {"empty": []}, {"mixed": [1, "a"]}, {"obj": object()}, {"": 1}, {3: "x"},
     {"_am_role": "primary"}, {"nan": float("nan")}, {"lists": [[1]]}, "not a dict"],
)
def test_metadata_chroma_cannot_store_is_refused(store, meta):
    with pytest.raises(InvalidMetadataError):
        store.create("fact", metadata=meta)
    assert store.collection.count() == 0 and len(store) == 0


def test_unknown_and_deleted_ids(store):
    a = store.create("fact one")
    for call in (lambda: store.get("a99"), lambda: store.update("a99", "x"), lambda: store.delete("a99"),
                 lambda: store.relate("a99", a.id, "conflict"), lambda: store.relate(a.id, 7, "conflict")):
        with pytest.raises(AtomNotFoundError):
            call()
    store.delete(a.id)
    with pytest.raises(AtomNotFoundError):
        store.delete(a.id)
    with pytest.raises(AtomNotFoundError):
        store.update(a.id, "resurrect")


def test_bad_ids_keywords_times_and_reads(store):
    with pytest.raises(InvalidAtomError):
        store.create("fact", id="has space")
    store.create("fact", id="x1")
    with pytest.raises(InvalidAtomError, match="already exists"):
        store.create("other", id="x1")
    with pytest.raises(InvalidAtomError):
        store.create("fact", participants=[""])
    with pytest.raises(InvalidAtomError):
        store.create("fact", time="yesterday")
    with pytest.raises(InvalidAtomError):
        store.create("fact", time=("2023-05-02", "2023-05-01"))
    with pytest.raises(InvalidAtomError):
        store.read("  ")
    with pytest.raises(InvalidAtomError):
        store.read("q", k=0)
    assert len(store) == 1


def test_batch_over_chroma_limit_is_split_not_refused(store):
    n = store.batch_size + 17  # 5461 + 17 here
    atoms = store.create_many([AtomDraft(text=f"fact number {i} about item{i}") for i in range(n)])
    assert len(atoms) == n == store.collection.count() == len(store)
    assert store.read("fact number 5470 about item5470", k=1)[0].atom.text.endswith("item5470")


def test_invalid_draft_in_a_batch_writes_nothing(store):
    drafts = [AtomDraft(text=f"fact {i}") for i in range(10)] + [AtomDraft(text=" ")]
    with pytest.raises(InvalidAtomError):
        store.create_many(drafts)
    assert store.collection.count() == 0 and len(store) == 0 and store.clock == 0


def test_failed_chroma_batch_is_rolled_back(store):
    """Chroma fails on the second of three batches: the first batch is removed again."""
    store.create("kept from before")
    before = chroma_state(store)

    class FailSecondAdd:  # a real collection whose second add raises, to reach the rollback path
        def __init__(self, col):
            self._col, self.calls = col, 0

        def add(self, **kw):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("simulated Chroma failure")
            return self._col.add(**kw)

        def __getattr__(self, name):
            return getattr(self._col, name)

    real = store.collection
    store.collection, store.batch_size = FailSecondAdd(real), 4
    with pytest.raises(MemoryStoreError):
        store.create_many([AtomDraft(text=f"new fact {i}") for i in range(10)])
    store.collection = real
    assert chroma_state(store) == before and len(store) == 1
    assert [a.id for a in store.create_many([AtomDraft(text="after")])] == [f"a2-{store.writer}"]


def test_namespace_validation():
    for bad in ("", "-x", "x-", "a b", "x" * 300, None):
        with pytest.raises(InvalidAtomError):
            AtomStore(bad)


def test_relation_input_errors(store):
    a, b = store.create("Ann lives in Oslo"), store.create("Ann lives in Bergen")
    with pytest.raises(InvalidRelationError, match="unknown relation"):
        store.relate(b.id, a.id, "contradicts")
    with pytest.raises(InvalidRelationError):
        store.relate(b.id, a.id, 3)
    with pytest.raises(InvalidRelationError, match="itself"):
        store.relate(a.id, a.id, "equivalent")
    assert store.get(a.id).relations == {} and store.get(b.id).relations == {}
