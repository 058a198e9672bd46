"""The ROAM setting (atommem_rl/tasks/synth_roam.py, issue 40 item 1): valid tasks with accumulating changes,
duplicates, partial facts and exhaustive gold labels; the labelling oracle (Primary-only fused retrieval) at
least matches the same oracle without labels on every task of a handful, in the real environment and Chroma;
the CLI flags (``--setting roam``, ``--policy-kwargs``) work and refuse bad input in one line."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from itertools import combinations

import pytest

from atommem_rl.rollout import make_policy, run_rollouts, write_jsonl
from atommem_rl.tasks.schema import Task, load_tasks, save_tasks
from atommem_rl.tasks.synth_roam import QTYPES, generate_task, generate_tasks

from .cli_helpers import run_cli
from .conftest import REPO

ENV = {"retrieval_k": 3, "chunk_tokens": 128}  # the setting's retrieval budget (docs/benchmarks/roam_setting.md)


def _person_attr(text: str, people: set[str]) -> tuple[str, str] | None:
    """(person, attribute) a target's statement is about, from its wording (None: not a target's)."""
    who = next((p for p in people if p in text), None)
    if who is None:
        return None
    city = any(w in text for w in (" lives ", "home", " resides ", " moved to ", " living in "))
    return who, "city" if city else "employer"


def test_tasks_are_valid_and_deterministic():
    tasks = generate_tasks(6, seed=3, changes=3)
    again = generate_tasks(6, seed=3, changes=3)
    assert [t.to_dict() for t in tasks] == [t.to_dict() for t in again]
    assert generate_task(0, seed=4).to_dict() != tasks[0].to_dict()
    labels, cats = Counter(), Counter()
    for t in tasks:
        Task.from_dict(json.loads(json.dumps(t.to_dict())))  # the schema accepts it
        dates = [b.date for b in t.blocks]
        assert dates == sorted(dates)
        units = t.units()
        order = {uid: i for i, uid in enumerate(units)}
        gold = t.gold_labels()
        for r in t.relations:  # new is always the later statement
            assert order[r.new] > order[r.old]
        people = {q.question.split(" does ")[-1].split(" live")[0].split(" work")[0] for q in t.questions
                  if "now" in q.question}
        people |= {q.question.split(" did ")[-1].split(" live")[0].split(" work")[0] for q in t.questions
                   if "before" in q.question}
        groups: dict[tuple[str, str], list[str]] = {}
        for uid, u in units.items():
            key = _person_attr(u.text, people) if u.role in ("evidence", "context") else None
            if key:
                groups.setdefault(key, []).append(uid)
        for key, ids in groups.items():
            # changes + 1 values, each stated at least once, and more statements than values (duplicates)
            assert len(ids) >= 4, key
            for old, new in combinations(ids, 2):  # exhaustive gold labels within one attribute history
                assert (new, old) in gold, (key, units[new].text, units[old].text)
        labels.update(r.label for r in t.relations)
        for q in t.questions:
            cats[q.category] += 1
            assert q.evidence and all(e in units for e in q.evidence)
            assert units[q.evidence[-1]].role == "evidence"
            if q.category.startswith("current"):  # the answer is the newest value: in the last head
                assert q.answers[0] in units[q.evidence[0]].text
            else:  # the older value, which the change itself never names
                assert q.answers[0] in units[q.evidence[0]].text and q.answers[0] not in units[q.evidence[1]].text
        assert any(u.role == "confounder" for u in units.values())
    assert set(cats) == set(QTYPES)
    assert {"conflict", "equivalent", "old_subsumed_by_new", "new_subsumed_by_old"} <= set(labels)


def test_dialogue_kind_and_bad_arguments():
    t = generate_task(1, seed=0, kind="dialogue")
    speakers = {u.speaker for b in t.blocks for u in b.units}
    assert speakers == {"Sam", "Robin"} and t.relations
    assert all(t.units()[e].speaker == "Robin" for q in t.questions for e in q.evidence)
    for kw, msg in [({"changes": 0}, "changes"), ({"kind": "chat"}, "kind"), ({"dup": 1.5}, "probabilities"),
                    ({"qtypes": ("partner",)}, "qtypes"), ({"confounders": 9}, "confounders")]:
        with pytest.raises(ValueError, match=msg):
            generate_task(0, **kw)


def test_labels_pay_for_the_oracle_on_a_handful_of_tasks(tmp_path):
    """Same tasks, same oracle: with labels (Primary-only fused views) the tasks score at least as well as
    without, and better in total (the measured gap on 256 tasks is in docs/benchmarks/roam_setting.md)."""
    tasks = generate_tasks(6, seed=11)

    def run(name, disable=(), **kw):
        trajs = run_rollouts(tasks, make_policy("oracle", **kw), {**ENV, "disable": disable}, batch_size=6)
        assert not any(t.get("crashed") for t in trajs)
        write_jsonl(trajs, tmp_path / f"{name}.jsonl")
        return {t["task_id"]: t for t in trajs}

    label, nolabel = run("label"), run("nolabel", disable=("relations",))
    em = {k: (label[k]["em"], nolabel[k]["em"]) for k in label}
    # at least as good on (nearly) every task: on 512 tasks of two seeds, worse on 1 (roam_setting.md)
    assert sum(a < b for a, b in em.values()) <= 1, em
    assert sum(a for a, _ in em.values()) > sum(b for _, b in em.values())
    assert all(label[k]["ops"]["relate"] > 0 and nolabel[k]["ops"]["relate"] == 0 for k in label)
    assert sum(label[k]["evidence_recall"] for k in label) > sum(nolabel[k]["evidence_recall"] for k in label)
    assert all(label[k]["relation_accuracy"] == 1.0 for k in label)  # the oracle's labels are the gold ones
    # scripts/roam_check.py on these trajectories: the paired difference and the shares it reads off the prompts
    save_tasks(tasks, tmp_path / "tasks.jsonl")
    spec = importlib.util.spec_from_file_location("roam_check", REPO / "scripts" / "roam_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)  # in this process: the tokenizer is loaded already
    assert check.main(["--tasks", str(tmp_path / "tasks.jsonl"), f"label={tmp_path / 'label.jsonl'}",
                       f"nolabel={tmp_path / 'nolabel.jsonl'}", "--json", str(tmp_path / "check.json")]) == 0
    res = json.loads((tmp_path / "check.json").read_text())
    diff = res["paired"]["label - nolabel"]
    want = sum(a - b for a, b in em.values()) / len(em)
    assert diff["em"]["n"] == len(tasks) and abs(diff["em"]["mean"] - want) < 1e-9
    assert diff["flood_share"]["mean"] < 0  # fewer outdated and duplicate atoms in the top-k with labels
    # this oracle stores no confounder: an exact count finds none in its views
    assert all(res["runs"][n]["exact_confounder_share"]["mean"] == 0 for n in ("label", "nolabel"))


def test_cli_setting_and_policy_kwargs(tmp_path):
    out = tmp_path / "roam.jsonl"
    r = run_cli(["data", "synth", "--setting", "roam", "--out", str(out), "--tasks", "2", "--seed", "5",
                 "--questions", "2", "--changes", "2"])
    assert r.rc == 0, r.stderr
    tasks = load_tasks(out)
    assert [t.id for t in tasks] == ["roam-doc-5-0", "roam-doc-5-1"]
    assert all(t.meta["setting"] == "roam" and t.meta["changes"] == 2 and len(t.questions) == 2 for t in tasks)
    assert tasks[0].to_dict() == generate_task(0, 5, docs=20, questions=2, changes=2).to_dict()
    traj = tmp_path / "u.jsonl"
    r = run_cli(["rollout", "--tasks", str(out), "--policy", "oracle", "--policy-kwargs", '{"supersede": "update"}',
                 "--disable", "relations", "--retrieval-k", "3", "--chunk-tokens", "128", "--no-prompts",
                 "--out", str(traj)], timeout=120)
    assert r.rc == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["ops"]["update"] > 0 and summary["ops"]["relate"] == 0 and summary["crashes"] == 0
    for bad, msg in [("{not json", "not JSON"), ("[1]", "JSON object"), ('{"supersede": "merge"}', "supersede"),
                     ('{"colour": 1}', "colour")]:
        r = run_cli(["rollout", "--tasks", str(out), "--policy", "oracle", "--policy-kwargs", bad,
                     "--out", str(tmp_path / "bad.jsonl")])
        assert r.rc != 0 and r.exception is None, (bad, r.exception)
        assert msg in r.stderr and r.stderr.strip().count("\n") == 0, (bad, r.stderr)


def test_training_stages_and_the_quickstart_make_roam_tasks(tmp_path):
    """A recipe's ``synth_setting: roam`` (TaskSource) makes the training tasks of this setting, held-out sets
    from the same distribution with another seed; bad values are refused; the standard setting's phase keys
    do not name the new fields (runs made before them resume)."""
    from atommem_rl.pipeline.quickstart import Quickstart, QuickstartConfig
    from atommem_rl.training.task_source import TaskSource, load_train_tasks, synthetic_tasks

    src = TaskSource(synth_setting="roam", synth_tasks=2, synth_docs=6, synth_questions="2", synth_confounders=1,
                     synth_changes=2, synth_seed=7)
    train = load_train_tasks(src)
    assert [t.id for t in train] == [t.id for t in generate_tasks(2, 7, docs=6, questions=2, confounders=1, changes=2)]
    assert all(t.meta["setting"] == "roam" and t.meta["changes"] == 2 and t.relations for t in train)
    held = synthetic_tasks(src, 3, 8)
    assert len(held) == 3 and not {t.id for t in held} & {t.id for t in train}
    assert load_train_tasks(TaskSource(synth_tasks=1))[0].meta.get("setting") != "roam"
    with pytest.raises(ValueError, match="synth_setting"):
        TaskSource(synth_setting="ROAM")
    with pytest.raises(ValueError, match="synth_changes"):
        TaskSource(synth_setting="roam", synth_changes=9)
    qs = Quickstart(QuickstartConfig(out=str(tmp_path / "qs"), tiny=True))
    assert "synth_setting" not in qs._task_settings("grpo")
    roam = Quickstart(QuickstartConfig(out=str(tmp_path / "qr"), tiny=True, grpo_set=["synth_setting=roam"]))
    assert roam._task_settings("grpo")["synth_setting"] == "roam"
