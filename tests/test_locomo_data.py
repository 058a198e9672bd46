"""LoCoMo loader, turn-to-atom conversion and the retrieval benchmark on a tiny fixture."""

import argparse
import datetime as dt
import json
import re
import uuid
from pathlib import Path

import pytest

from atommem_rl.bench import retrieval as bench
from atommem_rl.data.locomo import (
    LocomoFormatError,
    atom_id,
    load_locomo,
    parse_session_date,
    turn_drafts,
)
from atommem_rl.memory.embeddings import HashingEmbedder
from atommem_rl.memory.store import AtomStore

FIXTURE = Path(__file__).parent / "fixtures" / "locomo_tiny.json"


def test_load_fixture():
    (conv,) = load_locomo(FIXTURE)
    assert conv.sample_id == "tiny-1"
    assert conv.speakers == ("Alice", "Bob")
    assert [s.index for s in conv.sessions] == [1, 2]
    assert conv.sessions[0].date == dt.datetime(2023, 5, 8, 13, 56)
    assert conv.sessions[1].date == dt.datetime(2024, 1, 1, 0, 5)
    assert [t.position for t in conv.turns] == list(range(8))
    assert [q.category for q in conv.qa] == [1, 2, 3, 4, 5, 4]
    assert conv.qa[3].answer == "3"  # numbers become strings
    assert conv.qa[4].answer is None and conv.qa[4].adversarial_answer == "bread"
    assert conv.qa[0].evidence == ("D1:1", "D1:3")
    assert conv.qa[0].category_name == "multi-hop"


def test_turn_drafts_and_store():
    (conv,) = load_locomo(FIXTURE)
    drafts = turn_drafts(conv)
    assert len(drafts) == 8
    d = drafts[2]
    assert d.text == "Alice: A beagle. Look at him at the park! [shares a photo: a photo of a beagle on the grass]"
    assert list(d.participants) == ["Alice"]
    assert d.time == dt.date(2023, 5, 8)
    assert list(d.event_ids) == ["S1"] and list(d.source_ids) == ["D1:3"]
    assert d.id == "D1:3" and d.metadata == {"session": 1, "turn": 2}
    assert "beagl" in d.keywords and "photo" in d.keywords
    assert drafts[4].event_ids == ["S2"] and drafts[4].time == dt.date(2024, 1, 1)
    store = AtomStore(f"t-locomo-{uuid.uuid4().hex[:8]}", embedder=HashingEmbedder(64))
    atoms = store.create_many(drafts)
    assert [a.id for a in store.atoms()] == [d.id for d in drafts]
    assert atoms[2].time.start == dt.date(2023, 5, 8)
    store.drop()


def test_atom_id_and_dates():
    assert atom_id("D12:3") == "D12:3"
    assert re.fullmatch(r"[A-Za-z0-9_.:-]+", atom_id("D1: 3/x"))
    assert parse_session_date("10:29 am on 9 August, 2023") == dt.datetime(2023, 8, 9, 10, 29)
    assert parse_session_date("12:30 pm on 3 Sept, 2022") == dt.datetime(2022, 9, 3, 12, 30)
    with pytest.raises(ValueError, match="unrecognised"):
        parse_session_date("yesterday")


def _write(tmp_path, obj, name="bad.json"):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return p


def test_malformed_inputs_name_file_and_record(tmp_path):
    good = json.loads(FIXTURE.read_text())
    p = _write(tmp_path, "{not json")
    with pytest.raises(LocomoFormatError, match=r"bad\.json: not valid JSON"):
        load_locomo(p)

    no_conv = [good[0], {"sample_id": "x9", "qa": []}]
    with pytest.raises(LocomoFormatError, match=r"bad\.json: record 1 \(sample_id 'x9'\).*conversation"):
        load_locomo(_write(tmp_path, no_conv))

    bad_turn = json.loads(FIXTURE.read_text())
    del bad_turn[0]["conversation"]["session_2"][1]["dia_id"]
    with pytest.raises(LocomoFormatError, match=r"record 0 \(sample_id 'tiny-1'\), session_2, turn 1: .*dia_id"):
        load_locomo(_write(tmp_path, bad_turn))

    bad_date = json.loads(FIXTURE.read_text())
    bad_date[0]["conversation"]["session_1_date_time"] = "sometime in May"
    with pytest.raises(LocomoFormatError, match=r"session_1_date_time: unrecognised LoCoMo date"):
        load_locomo(_write(tmp_path, bad_date))

    bad_cat = json.loads(FIXTURE.read_text())
    bad_cat[0]["qa"][2]["category"] = 9
    with pytest.raises(LocomoFormatError, match=r"qa 2: category must be 1-5"):
        load_locomo(_write(tmp_path, bad_cat))

    with pytest.raises(LocomoFormatError, match="no such file"):
        load_locomo(tmp_path / "missing.json")


def test_bench_output_shape(capsys):
    res = bench.run(str(FIXTURE), k=2, strategy="graph", embedder=HashingEmbedder(64))
    assert res["k"] == 2 and res["strategy"] == "graph"
    assert res["questions"] == 4  # categories 1-4 with evidence
    assert set(res["recall_at_k"]) == {"multi-hop", "temporal", "open-domain", "single-hop", "all"}
    assert all(0.0 <= v <= 100.0 for v in res["recall_at_k"].values())
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--dataset", "locomo", "--path", str(FIXTURE), "--k", "10", "--strategy", "bm25",
                              "--embedder", "hashing:64", "--json"])
    assert bench.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["strategy"] == "bm25" and out["questions"] == 4
    assert out["recall_at_k"]["all"] == 100.0  # every evidence turn shares a term with its question
