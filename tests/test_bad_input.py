"""Issue 22: bad input gets a clear error before work starts and loses nothing. One test (or a few) per
item of the issue; each failed on the code before the fix (docs/FAULT_TOLERANCE.md, "Bad input")."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest

from atommem_rl.memory.atom import TimeSpan
from atommem_rl.memory.chroma_clients import make_client
from atommem_rl.memory.embeddings import HashingEmbedder
from atommem_rl.memory.errors import InvalidAtomError
from atommem_rl.memory.store import AtomDraft, AtomStore
from atommem_rl.tasks.schema import load_tasks, save_tasks
from atommem_rl.tasks.synth import generate_task, generate_tasks
from envs import make_env
from envs.core import EnvConfig
from envs.parser import format_tool_call as tc
from envs.parser import parse_tool_calls

from .cli_helpers import error_line, run_cli
from .conftest import REPO

ENV = ["--tokenizer", "words", "--chunk-tokens", "96", "--max-prompt-tokens", "2400"]


@pytest.fixture
def tasks_file(tmp_path):
    path = tmp_path / "tasks.jsonl"
    save_tasks(generate_tasks(2, seed=0, docs=3, questions=1, confounders=0), path)
    return path


def _task_dict(**changes) -> dict:
    d = generate_task(0, 0, docs=2, questions=2, confounders=0).to_dict()
    for path, value in changes.items():
        obj, keys = d, path.split(".")
        for k in keys[:-1]:
            obj = obj[int(k)] if isinstance(obj, list) else obj[k]
        obj[keys[-1] if not isinstance(obj, list) else int(keys[-1])] = value
    return d


# ---------------------------------------------------------------------------------------------- 1. hang
@pytest.mark.parametrize("value", ["0", "-3"])
def test_rollout_and_eval_batch_size_below_one_is_refused(tasks_file, tmp_path, value):
    """--batch-size 0 spun at 100 % CPU forever (no episode ever opened)."""
    res = run_cli(["rollout", "--tasks", str(tasks_file), "--policy", "oracle", "--out", str(tmp_path / "r.jsonl"),
                   "--batch-size", value, *ENV], timeout=60)
    assert res.rc == 2 and "--batch-size" in error_line(res), res
    res = run_cli(["eval", "--tasks", str(tasks_file), "--methods", "oracle", "--out", str(tmp_path / "e"),
                   "--batch-size", value], timeout=60)
    assert res.rc == 2 and "batch_size" in error_line(res), res
    assert not (tmp_path / "r.jsonl").exists() and not (tmp_path / "e").exists()


# ------------------------------------------------------------------------------------- 2. silent deletion
def test_quickstart_never_removes_a_folder_it_did_not_write(tmp_path):
    """`atommem sft --config recipes/quickstart/sft.yaml` writes checkpoints/quickstart/sft, the
    quickstart's default --out/sft: the quickstart deleted it without a word."""
    out = tmp_path / "Q"
    (out / "sft").mkdir(parents=True)
    (out / "sft" / "model.safetensors").write_bytes(b"weights trained by hand")
    res = run_cli(["quickstart", "--tiny", "--out", str(out), "--skip", "retrieval,eval"], timeout=120)
    assert res.rc == 2 and str(out / "sft") in error_line(res), res
    assert (out / "sft" / "model.safetensors").read_bytes() == b"weights trained by hand"
    assert not (out / "data").exists()  # refused before any phase ran


def test_quickstart_refuses_before_making_any_folder(tmp_path):
    """The quickstart made --out and --out/phases before its checks, so a refused run left folders behind."""
    out = tmp_path / "Q"
    res = run_cli(["quickstart", "--tiny", "--out", str(out), "--skip", "retrieval,eval", "--sft-set", "max_steps=-3"],
                  timeout=120)
    assert res.rc == 2 and "max_steps" in error_line(res), res
    assert not out.exists()


# ------------------------------------------------------------------------------------------ 3. two writers
def test_two_writers_of_one_namespace_lose_nothing():
    """Two stores writing one namespace: ids were a1, a2, ... per writer and Chroma ignored the second
    add of each id, so 2 x 200 creates left 200 atoms (or 285 with two processes), all reported stored."""
    client, emb, ns = make_client("memory"), HashingEmbedder(64), "two-writers-same-process"
    one, two = AtomStore(ns, client=client, embedder=emb), AtomStore(ns, client=client, embedder=emb)
    try:
        ids = [s.create(f"writer {w} fact {i}").id for i in range(200) for w, s in ((1, one), (2, two))]
        assert len(set(ids)) == 400 and one.collection.count() == 400
        assert set(ids) == set(AtomStore(ns, client=client, embedder=emb).chroma_contents())
        # an id another writer created is refused by name, never dropped while reported stored
        two.create("taken", id="shared-id")
        with pytest.raises(InvalidAtomError, match="shared-id.*another writer"):
            one.create("mine", id="shared-id")
        assert one.collection.get(ids=["shared-id"])["documents"] == ["taken"]
    finally:
        one.drop()


WRITER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from atommem_rl.memory.chroma_clients import make_client
    from atommem_rl.memory.embeddings import HashingEmbedder
    from atommem_rl.memory.store import AtomStore
    path, ns, name, hold = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    try:
        store = AtomStore(ns, client=make_client("persistent", path=path), embedder=HashingEmbedder(64))
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        sys.exit(3)
    ids = [store.create(f"{name} fact {i}").id for i in range(200)]
    print(json.dumps({"ids": ids, "mirror": sorted(a.id for a in store.atoms()),
                      "chroma": sorted(store.chroma_contents())}), flush=True)
    while hold != "-" and not Path(hold).exists():  # keep the store open until told to finish
        time.sleep(0.05)
""")


def test_two_processes_on_one_persistent_path(tmp_path):
    """A second process writing the namespace on the same persistent path gets a clear error while the
    first holds it; once the first is done, the second stores its 200 and every mirror agrees with Chroma."""
    path, ns, release = str(tmp_path / "db"), "shared-namespace", tmp_path / "release"
    first = subprocess.Popen([sys.executable, "-c", WRITER, path, ns, "first", str(release)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    try:
        a = json.loads(first.stdout.readline())
        assert len(a["ids"]) == 200 and a["mirror"] == a["chroma"] == sorted(a["ids"])
        second = subprocess.run([sys.executable, "-c", WRITER, path, ns, "second", "-"], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 3, second.stderr
        err = json.loads(second.stdout)["error"]
        assert "NamespaceLockedError" in err and ns in err and path in err and str(first.pid) in err
    finally:
        release.write_text("done")
        first.wait(timeout=60)
    second = subprocess.run([sys.executable, "-c", WRITER, path, ns, "second", "-"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    b = json.loads(second.stdout)
    assert len(set(a["ids"]) | set(b["ids"])) == 400
    assert b["mirror"] == b["chroma"] == sorted(a["ids"] + b["ids"])


# ---------------------------------------------------------------------------------------- 4. stale resume
def test_eval_resume_notices_edited_task_contents(tmp_path):
    """--resume fingerprinted task ids only: after the questions were edited (same ids), the resumed run
    reused the old records."""
    from atommem_rl.tasks.load import load_dataset
    from atommem_rl.eval.harness import evaluate

    path, out = tmp_path / "t.jsonl", tmp_path / "eval"
    save_tasks(generate_tasks(2, seed=0, docs=3, questions=1, confounders=0), path)

    class Killed(Exception):
        pass

    def kill_after_first(line):  # the run is "killed" once oracle finished: its records are on disk
        raise Killed

    with pytest.raises(Killed):
        evaluate({"t": load_dataset(path)}, ["oracle", "heuristic"], out, log=kill_after_first)
    assert (out / "records.partial.jsonl").exists()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r in rows:
        r["questions"][0]["question"] = "Edited: " + r["questions"][0]["question"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = []
    evaluate({"t": load_dataset(path)}, ["oracle", "heuristic"], out, resume=True, log=lines.append)
    assert any("starting over" in x for x in lines)
    recs = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert recs and all(q["question"].startswith("Edited: ") for r in recs for q in r["questions"][:1]), recs[0]["questions"]


def test_phase_marker_is_not_trusted_when_its_output_changed(tmp_path):
    """Quickstart phase markers said "done already" after Q/sft/model.safetensors and
    Q/data/heldout.jsonl had been truncated."""
    from atommem_rl.pipeline.phases import Phases

    out_file, runs, lines = tmp_path / "data" / "heldout.jsonl", [], []

    def phase():
        out_file.parent.mkdir(exist_ok=True)
        out_file.write_text("a whole file\n")
        runs.append(1)
        return {}

    for _ in range(2):
        Phases(tmp_path, log=lines.append).run("data", {"n": 1}, phase, outputs=lambda: [out_file])
    assert len(runs) == 1 and "done already" in lines[-1]
    out_file.write_text("a wh")  # truncated
    lines.clear()
    Phases(tmp_path, log=lines.append).run("data", {"n": 1}, phase, outputs=lambda: [out_file])
    assert len(runs) == 2 and "missing or changed" in lines[0] and out_file.read_text() == "a whole file\n"
    out_file.unlink()
    Phases(tmp_path, log=lines.append).run("data", {"n": 1}, phase, outputs=lambda: [out_file])
    assert len(runs) == 3


# ------------------------------------------------------------------------------------- 5. task validation
@pytest.mark.parametrize("changes,field", [
    ({"questions.0.answers": "Oslo"}, "questions[0].answers"),
    ({"questions.1.id": "Q1"}, "duplicate question id 'Q1'"),
    ({"questions.0.id": 1}, "questions[0].id"),
    ({"questions.0.answers": []}, "questions[0].answers"),
    ({"blocks.0.units.0.text": None}, "blocks[0].units[0].text"),
    ({"questions.0.evidence": [3]}, "questions[0].evidence[0]"),
    ({"questions.0.evidence": ["D9.s9"]}, "questions[0].evidence: no unit has id 'D9.s9'"),
    ({"blocks.0.units.0.role": "gold"}, "blocks[0].units[0].role"),
    ({"blocks": "D1"}, "blocks"),
])
def test_task_files_are_validated_field_by_field(tmp_path, changes, field):
    """"answers": "Oslo" passed (the oracle answered "O"), duplicate or integer question ids passed,
    answers [] or a unit with text null crashed the whole rollout without a trajectory file."""
    path = tmp_path / "bad.jsonl"
    good = json.dumps(generate_task(1, 0, docs=2, questions=1, confounders=0).to_dict())
    path.write_text(good + "\n" + json.dumps(_task_dict(**changes)) + "\n")
    with pytest.raises(ValueError) as info:
        load_tasks(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:2 (task ") and field in msg, msg
    res = run_cli(["rollout", "--tasks", str(path), "--policy", "oracle", "--out", str(tmp_path / "r.jsonl"), *ENV])
    assert res.rc == 2 and f"{path}:2" in error_line(res) and field in error_line(res), res
    assert not (tmp_path / "r.jsonl").exists()


def test_an_exception_in_reset_or_the_policy_is_that_episodes_crash():
    """An exception in reset or in the policy ended the whole run: no trajectory at all."""
    from atommem_rl.policies.oracle import OraclePolicy
    from atommem_rl.rollout import run_rollouts

    tasks = generate_tasks(3, seed=0, docs=2, questions=1, confounders=0)

    class Flaky(OraclePolicy):
        def start(self, key, task):
            if key == 0:
                raise RuntimeError("cannot start task 0")
            super().start(key, task)

        def act(self, batch):
            if any(k == 1 for k, _, _ in batch):
                raise RuntimeError("policy failed on task 1")
            return super().act(batch)

    recs = {r["key"]: r for r in run_rollouts(tasks, Flaky(), {"tokenizer": "words", "chunk_tokens": 96,
                                                              "max_prompt_tokens": 2400}, batch_size=3)}
    assert recs[0]["crashed"] and "cannot start task 0" in recs[0]["traceback"]
    assert recs[1]["crashed"] and "policy failed on task 1" in recs[1]["traceback"]
    assert not recs[2]["crashed"] and recs[2]["em"] == 1.0


def test_an_exception_in_reset_or_the_policy_is_that_evaluation_episodes_crash(tmp_path, monkeypatch):
    """In atommem eval only env.step was guarded: an exception in env.reset, policy.start or policy.act
    ended the whole evaluation (no metrics.json)."""
    from atommem_rl.eval.harness import evaluate
    from atommem_rl.eval.methods import EvalSettings
    from atommem_rl.policies import oracle
    from envs.documents import DocumentEnv

    tasks = generate_tasks(4, seed=0, docs=2, questions=1, confounders=0)

    class Flaky(oracle.OraclePolicy):
        def start(self, key, task):
            if key[-1] == 0:
                raise RuntimeError("cannot start task 0")
            super().start(key, task)

        def act(self, batch):
            if any(k[-1] == 1 for k, _, _ in batch):
                raise RuntimeError("policy failed on task 1")
            return super().act(batch)

    reset = DocumentEnv.reset

    def flaky_reset(self, **kw):
        if self.task.id == tasks[2].id:
            raise RuntimeError("reset failed on task 2")
        return reset(self, **kw)

    monkeypatch.setattr(oracle, "OraclePolicy", Flaky)
    monkeypatch.setattr(DocumentEnv, "reset", flaky_reset)
    metrics = evaluate({"t": tasks}, ["oracle"], tmp_path / "e", settings=EvalSettings(batch_size=4, viewer_tasks=4),
                       log=lambda line: None)
    recs = [json.loads(x) for x in (tmp_path / "e" / "trajectories.jsonl").read_text().splitlines()]
    crashed = [r["extra"]["crashed"] for r in recs]
    assert "cannot start task 0" in crashed[0] and "policy failed on task 1" in crashed[1], crashed
    assert "reset failed on task 2" in crashed[2] and crashed[3] is None, crashed
    assert metrics["results"]["oracle"]["t"]["crashes"] == 3
    assert [q["em"] for r in recs for q in r["questions"]] == [0.0, 0.0, 0.0, 1.0]



def test_duplicate_task_ids_are_refused_and_every_line_is_checked(tmp_path):
    """Two lines with one task id were accepted (rollout and eval ran the same task twice, exit 0), and
    with --limit N the lines after the N-th were never validated."""
    from atommem_rl.tasks.load import load_dataset

    first, second = (generate_task(i, 0, docs=2, questions=1, confounders=0).to_dict() for i in range(2))
    tid = first["id"]
    dup = tmp_path / "dup.jsonl"
    dup.write_text("".join(json.dumps(d) + "\n" for d in (first, second, first)))
    late = tmp_path / "late.jsonl"  # a bad second line: --limit 1 must not let it through
    bad = json.loads(json.dumps(second))
    bad["questions"][0]["answers"] = "Oslo"
    late.write_text(json.dumps(first) + "\n" + json.dumps(bad) + "\n")
    cases = {dup: (3, f"id: duplicate task id {tid!r} (first on line 1)"),
             late: (2, "questions[0].answers: expected a list")}
    for path, (line, what) in cases.items():
        for limit in (None, 1):
            with pytest.raises(ValueError) as info:
                load_tasks(path, limit=limit)
            assert str(info.value).startswith(f"{path}:{line} (task ") and what in str(info.value), info.value
            with pytest.raises(ValueError) as info:
                load_dataset(path, limit=limit)
            assert str(info.value).startswith(f"task file {path}, record {line} (line {line}, task "), info.value
            assert what in str(info.value), info.value
        for argv in (["rollout", "--tasks", str(path), "--policy", "oracle", "--out", str(tmp_path / "r.jsonl"), *ENV],
                     ["eval", "--tasks", str(path), "--methods", "oracle", "--out", str(tmp_path / "e")]):
            res = run_cli(argv + ["--limit", "1"])
            assert res.rc == 2 and str(path) in error_line(res) and what in error_line(res), (argv, res)
    assert not (tmp_path / "r.jsonl").exists() and not (tmp_path / "e").exists()


# ---------------------------------------------------------------------------- 6. numbers that mean nothing
@pytest.mark.parametrize("field,value", [
    ("max_steps", 0), ("max_steps", -1), ("max_answer_steps", -1), ("max_episode_tokens", -5),
    ("max_atom_chars", -1), ("evidence_bonus", math.nan), ("error_penalty", math.nan),
    ("format_penalty", math.inf), ("max_chunks", 0), ("capacity", 0)])
def test_environment_numbers_that_mean_nothing_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        EnvConfig(**{field: value})


def test_rollout_flags_that_mean_nothing_are_refused(tasks_file, tmp_path):
    for flag, value in (("--max-steps", "0"), ("--max-atom-chars", "-1"), ("--evidence-bonus", "nan")):
        res = run_cli(["rollout", "--tasks", str(tasks_file), "--policy", "oracle", "--out", str(tmp_path / "r.jsonl"),
                       *ENV, flag, value])
        assert res.rc == 2 and flag.lstrip("-").replace("-", "_") in error_line(res), (flag, res)


def test_recipe_numbers_and_env_config_are_checked_before_work(tmp_path):
    """max_steps: -3 fell back to epochs (69 steps); env_config typos raised a TypeError after the model
    had loaded, without naming the file."""
    from atommem_rl.training.recipes import RecipeError, load_recipe
    from atommem_rl.training.sft import SFTRecipeConfig

    recipe = REPO / "recipes" / "quickstart" / "sft.yaml"
    for override, key in ((["--max_steps", "-3"], "max_steps"), (["--max_steps", "0"], "max_steps"),
                          (["--learning_rate", "nan"], "learning_rate"),
                          (["--per_device_train_batch_size", "0"], "per_device_train_batch_size")):
        with pytest.raises(RecipeError, match=key):
            load_recipe(SFTRecipeConfig, recipe, override)
    assert load_recipe(SFTRecipeConfig, recipe, ["--max_steps", "-1"]).max_steps == -1  # -1: train epochs
    text = recipe.read_text()
    for env, key in (("{chunk_tokns: 256}", "chunk_tokns"), ("{chunk_tokens: big}", "chunk_tokens"),
                     ("{max_steps: -2}", "max_steps")):
        bad = tmp_path / "sft.yaml"
        bad.write_text("\n".join(x for x in text.splitlines() if not x.startswith("env_config")) + f"\nenv_config: {env}\n")
        with pytest.raises(RecipeError, match=rf"{bad}: env_config.*{key}"):
            load_recipe(SFTRecipeConfig, bad)


# ------------------------------------------------------------------------- 7. tracebacks instead of errors
def test_folders_and_files_in_the_wrong_place_are_clear_errors(tasks_file, tmp_path):
    folder, file = tmp_path / "a-folder", tmp_path / "a-file"
    folder.mkdir()
    file.write_text("x")
    cases = [
        (["rollout", "--tasks", str(folder), "--policy", "oracle", "--out", str(tmp_path / "r.jsonl"), *ENV], folder),
        (["rollout", "--tasks", str(tasks_file), "--policy", "oracle", "--out", str(folder), *ENV], folder),
        (["data", "synth", "--out", str(folder), "--tasks", "1", "--docs", "2"], folder),
        (["data", "prepare", "--source", "hotpotqa", "--path", str(folder), "--out", str(tmp_path / "p.jsonl")], folder),
        (["data", "prepare", "--source", "hotpotqa", "--path", str(file), "--out", str(folder)], folder),
        (["eval", "--tasks", str(tasks_file), "--methods", "oracle", "--out", str(file)], file),
        (["rollout", "--tasks", str(tasks_file), "--policy", "oracle", "--out", str(tmp_path / "r.jsonl"),
          "--tokenizer", "/nonexistent", "--chunk-tokens", "96"], "/nonexistent"),
    ]
    for argv, named in cases:
        res = run_cli(argv)
        assert res.rc == 2 and res.exception is None and str(named) in error_line(res), (argv, res)
    assert file.read_text() == "x" and not any(folder.iterdir())


def test_a_truncated_model_is_named_before_anything_runs(tasks_file, tmp_path):
    from atommem_rl.models import tiny_model

    model = tiny_model(tmp_path / "tiny", hidden_size=16, heads=2, kv_heads=1, intermediate_size=32, layers=1)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    res = run_cli(["rollout", "--tasks", str(tasks_file), "--policy", "model", "--model", str(model),
                   "--out", str(tmp_path / "r.jsonl"), *ENV])
    assert res.rc == 2 and str(weights) in error_line(res), res
    res = run_cli(["eval", "--tasks", str(tasks_file), "--methods", "oracle,heuristic", "--checkpoint", str(model),
                   "--out", str(tmp_path / "e")])
    assert res.rc == 2 and str(weights) in error_line(res), res
    assert not (tmp_path / "e").exists()  # no method ran before the error


def test_a_truncated_default_model_is_named_before_anything_runs(tasks_file, tmp_path, monkeypatch):
    """Without --model, rollout and eval used the default base model folder unchecked: a truncated
    model.safetensors there failed late (eval: after other methods had run)."""
    import struct

    from atommem_rl import models

    default = tmp_path / "base"
    default.mkdir()
    (default / "config.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}}).encode()
    weights = default / "model.safetensors"
    weights.write_bytes(struct.pack("<Q", len(header)) + header + bytes(40))  # 24 of the 64 bytes missing

    def no_conversion(*args, **kwargs):  # a test must never convert the real base model into the repository
        raise AssertionError("prepare_base_model called")

    monkeypatch.setattr(models, "BASE_MODEL_DIR", default)
    monkeypatch.setattr(models, "prepare_base_model", no_conversion)
    res = run_cli(["rollout", "--tasks", str(tasks_file), "--policy", "model", "--out", str(tmp_path / "r.jsonl"), *ENV])
    assert res.rc == 2 and str(weights) in error_line(res) and "default" in error_line(res), res
    res = run_cli(["eval", "--tasks", str(tasks_file), "--methods", "oracle,append_all", "--out", str(tmp_path / "e")])
    assert res.rc == 2 and str(weights) in error_line(res) and "default" in error_line(res), res
    assert not (tmp_path / "r.jsonl").exists() and not (tmp_path / "e").exists()
    # a missing default is no error: the first use builds it from the packaged GGUF
    from atommem_rl.training.checkpoints import check_model_or_default

    monkeypatch.setattr(models, "BASE_MODEL_DIR", tmp_path / "absent")
    assert check_model_or_default(None) is None


# ------------------------------------------------------------------------------------------------ 8. paths
def test_run_name_cannot_leave_checkpoints():
    from atommem_rl.training.recipes import RecipeError, load_recipe
    from atommem_rl.training.sft import SFTRecipeConfig

    for name in ("../../x", "/tmp/x", "a/b", ".hidden"):
        with pytest.raises(RecipeError, match="run_name"):
            load_recipe(SFTRecipeConfig, REPO / "recipes" / "quickstart" / "sft.yaml", ["--run_name", name])


def test_checkpoints_with_the_same_folder_name_are_told_apart(tmp_path):
    """--checkpoint runA/grpo --checkpoint runB/grpo evaluated only one of them (both were checkpoint:grpo)."""
    from atommem_rl.commands.eval import checkpoint_names

    a, b, c = str(tmp_path / "runA" / "grpo"), str(tmp_path / "runB" / "grpo"), str(tmp_path / "runB" / "sft")
    assert checkpoint_names([a, b, c]) == {a: "runA/grpo", b: "runB/grpo", c: "sft"}
    with pytest.raises(ValueError, match="given twice"):
        checkpoint_names([a, a])


# --------------------------------------------------------------------------------- 9. environment losses
def test_think_inside_a_json_string_is_data():
    text = (tc("create_memory", {"content": "the tag <think> is just text"}) + "<think>plan " + tc("delete_memory", {"id": "M1"})
            + "</think>" + tc("create_memory", {"content": "second"}))
    calls, errors = parse_tool_calls(text)
    assert not errors and [c.arguments.get("content") for c in calls] == ["the tag <think> is just text", "second"]


def test_eviction_is_shown_to_the_policy():
    env = make_env(generate_task(0, 0, docs=3, questions=1, confounders=0), tokenizer="words", chunk_tokens=96,
                   max_prompt_tokens=2400, capacity=1, on_full="evict")
    env.reset(seed=0)
    env.step(tc("create_memory", {"content": "Alice lives in Paris."}))
    obs, *_, info = env.step(tc("create_memory", {"content": "Bruno works at Orbis."}))
    assert "memory full: evicted M1" in obs[-1]["content"]
    assert info["results"][0]["evicted"] == "M1"
    env.close()


@pytest.mark.parametrize("bad", ["2020-01-01 garbage", "1111111111", "20200101", "2020-13-01", "2020-01-01T99"])
def test_only_iso_dates_are_dates(bad):
    with pytest.raises(InvalidAtomError):
        TimeSpan.parse(bad)
    assert str(TimeSpan.parse("2020-01-01T10:30:00")) == str(TimeSpan.parse(" 2020-01-01 ")) == "2020-01-01"
