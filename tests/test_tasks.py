"""Task generation and preparation: deterministic synthetic worlds, real benchmarks into tasks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atommem_rl.cli import main as cli
from atommem_rl.memory.atom import Relation
from atommem_rl.tasks import prepare
from atommem_rl.tasks.schema import Task, load_tasks
from atommem_rl.tasks.synth import QTYPES, generate_task, generate_tasks

from .conftest import DATA

FIXTURES = Path(__file__).parent / "fixtures"


def test_synth_is_deterministic_and_well_formed():
    a = [t.to_dict() for t in generate_tasks(4, seed=3, docs=15, questions=(1, 10), confounders=3)]
    b = [t.to_dict() for t in generate_tasks(4, seed=3, docs=15, questions=(1, 10), confounders=3)]
    c = [t.to_dict() for t in generate_tasks(4, seed=4, docs=15, questions=(1, 10), confounders=3)]
    assert a == b and a != c
    for d in a:
        t = Task.from_dict(json.loads(json.dumps(d)))
        units = t.units()
        assert 1 <= len(t.questions) <= 10
        for q in t.questions:
            assert q.answers and q.evidence and all(e in units for e in q.evidence)
            assert q.category in QTYPES
        for r in t.relations:
            assert r.new in units and r.old in units and Relation.parse(r.label)
        dates = [b.date for b in t.blocks]
        assert dates == sorted(dates)
        assert sum(u.role == "confounder" for u in units.values()) >= 3 * len(t.questions) - 2


def test_synth_covers_relation_kinds_and_question_types():
    tasks = generate_tasks(10, seed=0, docs=20, questions=5, confounders=2)
    labels = {r.label for t in tasks for r in t.relations}
    assert labels >= {"equivalent", "conflict", "old_subsumed_by_new", "new_subsumed_by_old"}
    assert {q.category for t in tasks for q in t.questions} == set(QTYPES)


@pytest.mark.parametrize("docs", [200, 800])
def test_synth_scales(docs):
    t = generate_task(0, 1, docs=docs, questions=10, confounders=8)
    assert len(t.blocks) == docs and len(t.questions) == 10


def test_synth_dialogue_kind():
    t = generate_task(0, 2, kind="dialogue", docs=8, questions=3)
    assert t.kind == "dialogue" and all(u.speaker for b in t.blocks for u in b.units)
    assert all(e in t.units() for q in t.questions for e in q.evidence)


def test_hotpotqa_tasks_keep_gold():
    raw = json.loads((DATA / "hotpotqa" / "hotpotqa_train_100.json").read_text())
    tasks = prepare.prepare_hotpotqa(DATA / "hotpotqa" / "hotpotqa_train_100.json", docs=20, questions=(1, 10), limit=30)
    assert sum(len(t.questions) for t in tasks) == 30
    by_q = {r["question"]: r for r in raw}
    for t in tasks:
        assert len(t.blocks) >= 20 or len(t.blocks) == len({b.title for b in t.blocks})
        units = t.units()
        for q in t.questions:
            r = by_q[q.question]
            assert q.answers == [r["answer"]]
            titles = {t2 for t2, _ in r["supporting_facts"]}
            ev_titles = {b.title for b in t.blocks for u in b.units if u.id in q.evidence}
            assert ev_titles <= titles and q.evidence
            assert all(units[e].role == "evidence" for e in q.evidence)
        assert any(u.role in ("distractor", "confounder") for u in units.values())


def test_musique_and_locomo_and_longmemeval():
    mus = prepare.prepare_musique(DATA / "musique" / "musique_train_100.json", docs=20, questions=2, limit=10)
    assert mus and all(q.evidence for t in mus for q in t.questions)
    loc = prepare.prepare_locomo(DATA / "locomo" / "locomo10.json", limit=1)
    assert all(t.kind == "dialogue" and len(t.questions) <= 10 for t in loc)
    cats = {q.category for t in loc for q in t.questions}
    assert cats <= {1, 2, 3, 4} and len(cats) >= 3
    assert loc[0].blocks[0].units[0].id.startswith("D1:")
    lme = prepare.prepare_longmemeval(FIXTURES / "longmemeval_mini.json")
    assert [t.questions[0].answers for t in lme] == [["Lisbon"], ["a beagle"]]
    assert lme[0].questions[0].evidence == ["sess_c:0"] and lme[0].units()["sess_a:0"].role == "distractor"
    assert lme[1].questions[0].evidence == ["sess_d:0"]
    with pytest.raises(ValueError):
        prepare.prepare_longmemeval(DATA / "hotpotqa" / "hotpotqa_train_100.json")


def test_data_cli_roundtrip(tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    assert cli(["data", "synth", "--out", str(out), "--tasks", "3", "--seed", "5", "--docs", "10",
                "--questions", "2", "--confounders", "1"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tasks"] == 3 and summary["questions"] == 6
    first = out.read_text()
    assert cli(["data", "synth", "--out", str(out), "--tasks", "3", "--seed", "5", "--docs", "10",
                "--questions", "2", "--confounders", "1"]) == 0
    assert out.read_text() == first and len(load_tasks(out)) == 3
    hp = tmp_path / "h.jsonl"
    assert cli(["data", "prepare", "--source", "hotpotqa", "--path", str(DATA / "hotpotqa" / "hotpotqa_train_100.json"),
                "--out", str(hp), "--docs", "12", "--questions", "3", "--limit", "9"]) == 0
    assert len(load_tasks(hp)) == 3
    assert cli(["data", "prepare", "--source", "locomo", "--path", str(tmp_path / "missing.json"), "--out", str(hp)]) == 2
