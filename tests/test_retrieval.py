"""Retrieval strategies on small hand-built stores (real in-memory Chroma, HashingEmbedder)."""

import uuid

import pytest

from atommem_rl.memory.embeddings import HashingEmbedder
from atommem_rl.memory.keyword_index import KeywordIndex
from atommem_rl.memory.retrieval import STRATEGIES, memory_graph, mentioned_participants, retrieve
from atommem_rl.memory.store import AtomDraft, AtomStore


def _store(drafts):
    store = AtomStore(f"t-retr-{uuid.uuid4().hex[:8]}", embedder=HashingEmbedder(128))
    store.create_many(drafts)
    return store


@pytest.fixture()
def pets():
    drafts = [
        AtomDraft("Alice adopted a beagle puppy named Biscuit", participants=["Alice"], time="2023-05-08",
                  event_ids=["S1"], id="p1", metadata={"turn": 0}),
        AtomDraft("Alice has a beagle puppy called Biscuit", participants=["Alice"], time="2023-05-08",
                  event_ids=["S1"], id="p2", metadata={"turn": 1}),
        AtomDraft("Bob walks his beagle every morning", participants=["Bob"], time="2023-06-01",
                  event_ids=["S2"], id="p3", metadata={"turn": 2}),
        AtomDraft("Bob's beagle puppy chewed the sofa", participants=["Bob"], time="2023-06-01",
                  event_ids=["S2"], id="p4", metadata={"turn": 3}),
        AtomDraft("Alice gave away the beagle puppy", participants=["Alice"], time="2023-07-01",
                  event_ids=["S3"], id="p5", metadata={"turn": 4}),
        AtomDraft("Carol dislikes puppies", participants=["Carol"], time="2023-07-01",
                  event_ids=["S3"], id="p6", metadata={"turn": 5}),
    ]
    store = _store(drafts)
    store.relate("p2", "p1", "equivalent")  # p2 becomes evidence of p1
    store.delete("p5")
    yield store
    store.drop()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_only_primary_atoms_and_filters(pets, strategy):
    views = retrieve(pets, "beagle puppy", k=10, strategy=strategy)
    ids = [v.id for v in views]
    assert ids and "p2" not in ids and "p5" not in ids
    assert all(pets.get(i).role.value == "primary" for i in ids)
    assert len(ids) == len(set(ids)) and [v.score for v in views] == sorted((v.score for v in views), reverse=True)
    bob = retrieve(pets, "beagle puppy", k=10, strategy=strategy, participants=["Bob"])
    assert bob and {v.id for v in bob} <= {"p3", "p4"}
    june = retrieve(pets, "beagle puppy", k=10, strategy=strategy, time_window=("2023-05-01", "2023-05-31"))
    assert [v.id for v in june] == ["p1"]
    assert retrieve(pets, "beagle", k=10, strategy=strategy, participants=["Bob"],
                    time_window="2023-05-08") == []
    assert len(retrieve(pets, "beagle puppy", k=1, strategy=strategy)) == 1


def test_bad_arguments(pets):
    with pytest.raises(ValueError, match="unknown retrieval strategy"):
        retrieve(pets, "beagle", strategy="magic")
    with pytest.raises(ValueError):
        retrieve(pets, "  ", strategy="bm25")
    with pytest.raises(TypeError, match="unknown retrieval option"):
        retrieve(pets, "beagle", strategy="graph", nonsense=1)


def test_keyword_index_rebuilds_on_writes_only(pets):
    idx = KeywordIndex(pets)
    assert [aid for aid, _ in idx.search("sofa", 5)] == ["p4"]
    key = idx._key
    pets.read("sofa", 2)  # a read bumps store.version but changes no atom
    idx.refresh()
    assert idx._key == key
    pets.create("Carol bought a new sofa", participants=["Carol"], id="p7")
    assert {aid for aid, _ in idx.search("sofa", 5)} == {"p4", "p7"}
    assert [aid for aid, _ in idx.search("sofa", 5, candidates={"p7"})] == ["p7"]
    assert idx.search("zebra", 5) == []


def test_graph_cached_per_write(pets):
    g1 = memory_graph(pets)
    assert memory_graph(pets) is g1
    pets.read("beagle", 2)
    assert memory_graph(pets) is g1
    pets.create("Bob's beagle learned to sit", participants=["Bob"], event_ids=["S2"], id="p8")
    g2 = memory_graph(pets)
    assert g2 is not g1 and "p8" in g2.index and "p2" not in g2.index  # Primary atoms only


def test_mentioned_participants():
    names = ["Caroline", "Melanie", "Jo Ann"]
    assert mentioned_participants("What did Caroline's dog eat?", names) == ["Caroline"]
    assert mentioned_participants("Did jo ever call?", names) == []  # first names need 3+ letters
    assert mentioned_participants("Where did Jo Ann and MELANIE go?", names) == ["Melanie", "Jo Ann"]
    assert mentioned_participants("Is Carolines a word?", names) == []


def test_graph_finds_multi_hop_bridge_that_dense_misses():
    # The answer turn (b3) shares no word with the question; it is reachable only through the turns
    # around it (temporal edges) and the entity "beth" it shares with the seed's neighbour.
    drafts = [
        AtomDraft("Alice: my sister Beth visited me last weekend", participants=["Alice"], event_ids=["S1"], id="b1"),
        AtomDraft("Bob: nice! what does Beth do these days?", participants=["Bob"], event_ids=["S1"], id="b2"),
        AtomDraft("Alice: marine biologist at the Lisbon aquarium", participants=["Alice"], event_ids=["S1"], id="b3"),
        AtomDraft("Bob: cool, I love aquariums", participants=["Bob"], event_ids=["S1"], id="b4"),
        AtomDraft("Carol: my sister Dana works at a bakery", participants=["Carol"], event_ids=["S2"], id="d1"),
        AtomDraft("Dan: where does your sister live now?", participants=["Dan"], event_ids=["S2"], id="d2"),
        AtomDraft("Carol: she lives in Porto with her cat", participants=["Carol"], event_ids=["S2"], id="d3"),
        AtomDraft("Erin: my sister works at the bank where Alice works", participants=["Erin"], event_ids=["S3"], id="d4"),
        AtomDraft("Frank: Alice does work a lot", participants=["Frank"], event_ids=["S3"], id="d5"),
        AtomDraft("Gina: where do you work these days?", participants=["Gina"], event_ids=["S3"], id="d6"),
    ]
    store = _store(drafts)
    try:
        q = "Where does Alice's sister work?"
        dense = [v.id for v in retrieve(store, q, k=4, strategy="dense")]
        graph = [v.id for v in retrieve(store, q, k=4, strategy="graph")]
        no_walk = [v.id for v in retrieve(store, q, k=4, strategy="graph", alpha=0.0)]
        assert "b3" not in dense and "b3" not in no_walk  # first stage alone misses it
        assert "b3" in graph  # RWR from the seeds reaches it
    finally:
        store.drop()
