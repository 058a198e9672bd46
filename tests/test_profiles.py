"""Temporal profiles on real Chroma: each flush decision, history kept, rendering, a failed flush,
a reopen in a new process and bad input."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from atommem_rl.memory.chroma_clients import make_client
from atommem_rl.memory.embeddings import HashingEmbedder
from atommem_rl.memory.errors import AtomNotFoundError, InvalidAtomError, MemoryStoreError
from atommem_rl.memory.profiles import ProfileLayer, UnknownParticipantError, normalise
from atommem_rl.memory.store import AtomStore

from .conftest import REPO


@pytest.fixture
def store(namespace):
    s = AtomStore(namespace, client=make_client("memory"), embedder=HashingEmbedder(384))
    yield s
    for name in (s.namespace, s.namespace + ".profiles"):
        try:
            s.client.delete_collection("atommem-" + name)
        except Exception:
            pass


def test_normalise():
    assert normalise("  Favorite_Food ") == normalise("favorite-food") == "favorite food"
    assert normalise("Sushi!") == normalise("SUSHI") == "sushi"
    assert normalise("San  Francisco, CA.") == "san francisco ca"


def test_queue_writes_nothing_until_flush(store):
    prof = ProfileLayer(store)
    prof.queue("Caroline", "lives in", "Boston", time="2023-01-10", source_ids=["s1:3"])
    assert len(prof.pending) == 1
    with pytest.raises(UnknownParticipantError):  # nothing stored yet
        prof.profile("Caroline")
    assert ProfileLayer(store).participants() == []
    report = prof.flush("2023-01-10")
    assert report.counts == {"redundant": 0, "update": 0, "revise_history": 0, "create": 1}
    assert prof.pending == ()
    assert prof.profile("caroline") == {  # participants match case-insensitively
        "lives in": {"value": "Boston", "since": "2023-01-10", "kind": "trait", "sources": ["s1:3"],
                     "last_seen": "2023-01-10", "history": []},
    }


def test_each_decision_and_history_kept(store):
    prof = ProfileLayer(store)
    prof.queue("Caroline", "lives in", "Boston", time="2023-03-01", source_ids=["s1"])
    prof.queue("Caroline", "favorite food", "sushi", kind="preference")  # no time: the session's
    assert prof.flush("2023-03-01").counts["create"] == 2

    # session 2: redundant (normalised equal), update, revise_history, create
    prof.queue("Caroline", "Lives_In", "  boston. ", time="2023-04-02", source_ids=["s2"])
    prof.queue("Caroline", "favorite food", "ramen", time="2023-04-03", source_ids=["s2b"], kind="preference")
    prof.queue("Caroline", "lives in", "Chicago", time="2022-06-01", source_ids=["s2c"])  # the past
    prof.queue("Caroline", "job", "counselor", source_ids=["s2d"])
    report = prof.flush("2023-04-05")
    assert report.counts == {"redundant": 1, "update": 1, "revise_history": 1, "create": 1}
    # applied in time order: the revision (2022) first, the session-time create last
    assert [d for _, d in report.decisions] == ["revise_history", "redundant", "update", "create"]

    p = prof.profile("Caroline")
    assert p["lives in"]["value"] == "Boston" and p["lives in"]["since"] == "2023-03-01"
    assert p["lives in"]["sources"] == ["s1", "s2"] and p["lives in"]["last_seen"] == "2023-04-02"
    assert p["lives in"]["history"] == [
        {"value": "Chicago", "since": "2022-06-01", "until": "2023-03-01", "sources": ["s2c"], "kind": "trait"},
    ]
    assert p["favorite food"]["value"] == "ramen" and p["favorite food"]["since"] == "2023-04-03"
    assert p["favorite food"]["history"] == [
        {"value": "sushi", "since": "2023-03-01", "until": "2023-04-03", "sources": [], "kind": "preference"},
    ]
    assert p["job"]["since"] == "2023-04-05"

    # session 3: another update keeps every old version; a revision inside an old version splits it;
    # a past value equal to the version in force then is redundant (its sources join that version)
    prof.queue("Caroline", "lives in", "Denver", time="2023-08-01")
    prof.queue("Caroline", "lives in", "Austin", time="2022-09-01", source_ids=["s3a"])
    prof.queue("Caroline", "lives in", "chicago", time="2022-07-01", source_ids=["s3b"])
    report = prof.flush("2023-08-02")
    assert [d for _, d in report.decisions] == ["redundant", "revise_history", "update"]
    hist = prof.profile("Caroline")["lives in"]["history"]
    assert [(h["value"], h["since"], h["until"]) for h in hist] == [
        ("Chicago", "2022-06-01", "2022-09-01"),
        ("Austin", "2022-09-01", "2023-03-01"),
        ("Boston", "2023-03-01", "2023-08-01"),
    ]
    assert hist[0]["sources"] == ["s2c", "s3b"]
    assert prof.profile("Caroline")["lives in"]["value"] == "Denver"


def test_render_is_compact_and_bounded(store):
    prof = ProfileLayer(store)
    prof.queue("Melanie", "hobby", "pottery", time="2023-05-01")
    prof.queue("Melanie", "hobby", "painting", time="2023-06-01")
    prof.queue("Melanie", "kids", "two", time="2023-05-02")
    prof.flush("2023-06-01")
    text = prof.render("melanie")
    assert text.splitlines() == [
        "Profile of Melanie:",
        "- hobby: painting (since 2023-06-01; before: pottery until 2023-06-01)",
        "- kids: two (since 2023-05-02)",
    ]
    short = prof.render("Melanie", max_chars=60)
    assert len(short) <= 60 and "kids: two" in short and "hobby" not in short
    assert len(prof.render("Melanie", max_chars=5)) == 5


def test_bad_input_raises_documented_types_and_queues_nothing(store):
    prof = ProfileLayer(store, participants=["Caroline", "Melanie"])
    for kwargs in (
        dict(participant="Caroline", attribute="", value="x"),
        dict(participant="Caroline", attribute=" -- ", value="x"),
        dict(participant="Caroline", attribute="job", value="   "),
        dict(participant="Caroline", attribute="job", value="?!"),
        dict(participant="", attribute="job", value="nurse"),
        dict(participant="Caroline", attribute="job", value="nurse", kind="opinion"),
        dict(participant="Caroline", attribute="job", value="nurse", time="yesterday"),
        dict(participant="Caroline", attribute="job", value="nurse", source_ids=[""]),
    ):
        with pytest.raises(InvalidAtomError):
            prof.queue(**kwargs)
    with pytest.raises(UnknownParticipantError) as info:
        prof.queue("Bob", "job", "chef")
    assert isinstance(info.value, AtomNotFoundError) and isinstance(info.value, MemoryStoreError)
    assert prof.pending == ()
    assert prof.profile("melanie") == {} and prof.render("Melanie") == ""  # on the roster, no facts yet
    with pytest.raises(UnknownParticipantError):
        prof.profile("Bob")
    with pytest.raises(UnknownParticipantError):
        ProfileLayer(store).render("Bob")
    prof.queue("Caroline", "job", "nurse")
    with pytest.raises(InvalidAtomError):
        prof.flush("not a date")
    assert len(prof.pending) == 1  # a refused flush keeps the queue


def test_failed_flush_leaves_profiles_and_queue_as_they_were(store, namespace):
    prof = ProfileLayer(store)
    prof.queue("Caroline", "lives in", "Boston", time="2023-03-01")
    prof.flush("2023-03-01")
    # the same namespace through an embedder of another width: Chroma refuses the vectors
    narrow = ProfileLayer(AtomStore(namespace, client=store.client, embedder=HashingEmbedder(64)))
    before = narrow.profile("Caroline")
    narrow.queue("Caroline", "lives in", "Denver", time="2023-08-01")
    narrow.queue("Caroline", "job", "counselor")
    queued = narrow.pending
    with pytest.raises(MemoryStoreError):
        narrow.flush("2023-08-02")
    assert narrow.pending == queued and narrow.profile("Caroline") == before
    assert ProfileLayer(store).profile("Caroline") == before  # Chroma unchanged too


class WideUnlessBoom(HashingEmbedder):
    """A real embedder that returns vectors of the wrong width for a chunk mentioning BOOM."""

    def embed(self, texts):
        return HashingEmbedder(64).embed(texts) if any("BOOM" in t for t in texts) else super().embed(texts)


def test_a_later_chunk_failing_restores_the_earlier_chunks(store):
    prof = ProfileLayer(store, embedder=WideUnlessBoom(384))
    prof.queue("Caroline", "lives in", "Boston", time="2023-03-01")
    prof.flush("2023-03-01")
    prof.batch_size = 1  # one record per Chroma call, so the update lands before the failing create
    prof.queue("Caroline", "lives in", "Denver", time="2023-08-01")
    prof.queue("Caroline", "motto", "BOOM", time="2023-08-02")
    with pytest.raises(MemoryStoreError):
        prof.flush("2023-08-02")
    reopened = ProfileLayer(store, embedder=WideUnlessBoom(384))
    assert reopened.profile("Caroline")["lives in"]["value"] == "Boston"
    assert "motto" not in reopened.profile("Caroline") and len(prof.pending) == 2
    stored = store.client.get_collection("atommem-" + store.namespace + ".profiles").get(include=["embeddings"])
    assert len(stored["ids"]) == 1 and np.asarray(stored["embeddings"]).shape == (1, 384)


def test_reopen_in_a_new_process(tmp_path, namespace):
    path = str(tmp_path / "db")
    store = AtomStore(namespace, client=make_client("persistent", path=path), embedder=HashingEmbedder(384))
    prof = ProfileLayer(store)
    prof.queue("Caroline", "lives in", "Boston", time="2023-03-01", source_ids=["s1"])
    prof.queue("Caroline", "lives in", "Denver", time="2023-08-01", source_ids=["s2"])
    prof.queue("Melanie", "hobby", "pottery", kind="preference")
    prof.flush("2023-08-01")
    expected = {p: prof.profile(p) for p in ("Caroline", "Melanie")}
    del store, prof
    gc.collect()

    script = textwrap.dedent(f"""
        import json
        from atommem_rl.memory.chroma_clients import make_client
        from atommem_rl.memory.store import AtomStore
        from atommem_rl.memory.profiles import ProfileLayer
        prof = ProfileLayer(AtomStore({namespace!r}, client=make_client("persistent", path={path!r})))
        out = {{"profiles": {{p: prof.profile(p) for p in prof.participants()}}}}
        prof.queue("Caroline", "lives in", "denver!", time="2023-09-01")  # keeps working after a reopen
        out["counts"] = prof.flush("2023-09-01").counts
        print(json.dumps(out))
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["profiles"] == expected
    assert out["profiles"]["Caroline"]["lives in"]["history"][0]["value"] == "Boston"
    assert out["counts"]["redundant"] == 1
