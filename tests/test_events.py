"""The event layer on real Chroma: placement (join vs new), explicit ids, summaries, search, a reopen
in a new process, bad input and a write Chroma refuses."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap

import pytest

from atommem_rl.memory.chroma_clients import make_client
from atommem_rl.memory.embeddings import HashingEmbedder
from atommem_rl.memory.errors import AtomNotFoundError, InvalidAtomError, MemoryStoreError
from atommem_rl.memory.events import EventLayer, EventNotFoundError, create_in_event
from atommem_rl.memory.store import AtomDraft, AtomStore

from .conftest import REPO

HIKE = [
    "Caroline went hiking at Mount Tamalpais with her dog",
    "Caroline's dog got tired during the Mount Tamalpais hike",
    "Caroline took photos of her dog at the summit of Mount Tamalpais",
]
POTTERY = ["Melanie signed up for a pottery class", "Melanie's pottery class starts next Monday"]


@pytest.fixture
def mem(namespace):
    store = AtomStore(namespace, client=make_client("memory"), embedder=HashingEmbedder(384))
    layer = EventLayer(store)
    yield store, layer
    for drop in (layer.drop, store.drop):
        try:
            drop()
        except MemoryStoreError:
            pass


def put(store, layer, text, who, day, **kw):
    return create_in_event(store, layer, AtomDraft(text=text, participants=[who], time=day), **kw)


def test_related_atoms_join_unrelated_start_new_events(mem):
    store, layer = mem
    hike = [put(store, layer, t, "Caroline", "2023-05-07") for t in HIKE]
    pottery = [put(store, layer, t, "Melanie", "2023-05-08") for t in POTTERY]
    other = put(store, layer, "Caroline is researching adoption agencies", "Caroline", "2023-05-08")

    hike_ids = {ev.id for _, ev in hike}
    assert len(hike_ids) == 1, "the three hiking facts form one event"
    assert len({ev.id for _, ev in pottery}) == 1
    assert len(layer) == 3 and other[1].id not in hike_ids
    ev = layer.get(hike[0][1].id)
    assert ev.atom_ids == tuple(a.id for a, _ in hike)
    assert ev.participants == ("Caroline",)
    assert str(ev.time) == "2023-05-07"
    assert "tamalpai" in ev.keywords and "dog" in ev.keywords
    # extractive summary: one member's text verbatim plus the event's size and top keywords
    assert any(ev.summary.startswith(t) for t in HIKE) and "[+2 related:" in ev.summary
    # the store's own field carries the event id (created with it, never rewritten)
    for atom, e in hike + pottery + [other]:
        assert store.get(atom.id).event_ids == (e.id,)
        assert [x.id for x in layer.events_of(atom.id)] == [e.id]
    assert [e.id for e in layer.events()] == ["e1", "e2", "e3"]
    assert layer.events_of("a999") == []


def test_participants_and_time_window_are_hard_filters(mem):
    store, layer = mem
    _, first = put(store, layer, HIKE[0], "Caroline", "2023-05-07")
    _, other_person = put(store, layer, HIKE[1], "Melanie", "2023-05-07")  # same topic, other person
    _, months_later = put(store, layer, HIKE[1], "Caroline", "2023-09-01")  # same topic, far in time
    _, next_day = put(store, layer, HIKE[1], "Caroline", "2023-05-08")  # inside the 7-day window
    assert other_person.id != first.id and months_later.id != first.id
    assert next_day.id == first.id
    assert str(layer.get(first.id).time) == "2023-05-07..2023-05-08"  # span is the hull
    # a closed event takes no more atoms automatically
    layer.close(first.id)
    _, after_close = put(store, layer, HIKE[2], "Caroline", "2023-05-08")
    assert after_close.id != first.id


def test_place_does_not_write_and_scores_are_documented(mem):
    store, layer = mem
    a, ev = put(store, layer, HIKE[0], "Caroline", "2023-05-07")
    p = layer.place(AtomDraft(HIKE[1], participants=["Caroline"], time="2023-05-07"))
    assert (p.event_id, p.new) == (ev.id, False) and p.score >= layer.threshold
    q = layer.place({"text": "Melanie painted a sunset", "participants": ["Melanie"]})
    assert q.new and q.event_id == "e2" and "e2" not in layer
    assert len(layer) == 1 and len(store) == 1


def test_explicit_ids_caller_summary_and_reassign(mem):
    store, layer = mem
    a1 = store.create("Caroline flew to Paris", participants=["Caroline"], time="2023-06-01", event_ids=["trip"])
    a2 = store.create("Caroline ate croissants", participants=["Caroline"], time="2023-06-02", event_ids=["trip"])
    ev = layer.assign(a1)  # the atom's own event_ids name the event: it is created under that id
    assert ev.id == "trip" and ev.atom_ids == (a1.id,)
    ev = layer.assign(a2, summary="Caroline's trip to Paris in June 2023")
    assert ev.atom_ids == (a1.id, a2.id) and ev.summary_by == "caller"
    # a caller summary survives new members; set_summary replaces it
    a3, ev = create_in_event(store, layer, AtomDraft("Caroline visited the Louvre", participants=["Caroline"]),
                             event_id="trip")
    assert ev.summary == "Caroline's trip to Paris in June 2023" and a3.event_ids == ("trip",)
    assert layer.set_summary("trip", "Paris trip").summary == "Paris trip"
    # assigning again is idempotent; an explicit second event adds a membership
    assert layer.assign(a1).atom_ids == (a1.id, a2.id, a3.id)
    layer.assign(a1, "paris-food")
    assert [e.id for e in layer.events_of(a1.id)] == ["trip", "paris-food"]
    # search ranks events by summary similarity and can filter by participant
    hits = layer.search("trip to Paris", k=5)
    assert hits[0].event.id == "trip"
    assert layer.search("Paris", participants=["Nobody"]) == []


def test_bad_input_raises_documented_types_and_writes_nothing(mem):
    store, layer = mem
    a = store.create("Caroline likes tea", participants=["Caroline"])
    with pytest.raises(EventNotFoundError) as info:
        layer.get("e42")
    assert isinstance(info.value, AtomNotFoundError) and isinstance(info.value, MemoryStoreError)
    with pytest.raises(AtomNotFoundError):
        layer.assign("a404")
    with pytest.raises(InvalidAtomError):
        layer.assign(a, "bad id with spaces")
    with pytest.raises(InvalidAtomError):
        layer.assign(a, summary="   ")
    with pytest.raises(InvalidAtomError):
        layer.search("  ")
    with pytest.raises(InvalidAtomError):
        create_in_event(store, layer, AtomDraft(text=""))
    store.delete(a.id)
    with pytest.raises(AtomNotFoundError):
        layer.assign(a)
    assert len(layer) == 0 and layer.events() == [] and len(store) == 0


def test_a_write_chroma_refuses_leaves_the_layer_unchanged(mem, namespace):
    store, layer = mem
    put(store, layer, HIKE[0], "Caroline", "2023-05-07")
    before = layer.get("e1")
    # the same namespace through an embedder of another width: Chroma refuses its vectors
    narrow = EventLayer(AtomStore(namespace, client=store.client, embedder=HashingEmbedder(64)))
    assert narrow.get("e1") == before  # rebuilt from the collection
    with pytest.raises(MemoryStoreError):
        narrow.set_summary("e1", "a new summary")
    assert narrow.get("e1") == before
    assert EventLayer(store).get("e1") == before


def test_reopen_in_a_new_process(tmp_path, namespace):
    path = str(tmp_path / "db")
    store = AtomStore(namespace, client=make_client("persistent", path=path), embedder=HashingEmbedder(384))
    layer = EventLayer(store)
    for t in HIKE:
        put(store, layer, t, "Caroline", "2023-05-07")
    put(store, layer, POTTERY[0], "Melanie", "2023-05-08", summary="Melanie takes up pottery")
    expected = [e.to_dict() for e in layer.events()]
    del store, layer
    gc.collect()

    script = textwrap.dedent(f"""
        import json
        from atommem_rl.memory.chroma_clients import make_client
        from atommem_rl.memory.store import AtomStore
        from atommem_rl.memory.events import EventLayer, create_in_event
        from atommem_rl.memory.store import AtomDraft
        store = AtomStore({namespace!r}, client=make_client("persistent", path={path!r}))
        layer = EventLayer(store)
        out = {{"events": [e.to_dict() for e in layer.events()],
               "of_a2": [e.id for e in layer.events_of(store.atoms()[1].id)],
               "search": layer.search("pottery class", k=1)[0].event.id}}
        # placement after the reopen uses the members' stored vectors
        out["joined"] = create_in_event(store, layer, AtomDraft({HIKE[1]!r}, participants=["Caroline"],
                                                               time="2023-05-07"))[1].id
        print(json.dumps(out))
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["events"] == expected
    assert out["of_a2"] == ["e1"] and out["search"] == "e2" and out["joined"] == "e1"
