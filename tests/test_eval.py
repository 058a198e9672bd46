"""The evaluation harness end to end: real Chroma, the real SmolLM2 tokenizer, a tiny random-weight
model for the LLM methods (its answers are noise; calls and tokens are what is checked), the oracle's
upper bound, clear errors for bad inputs. A scripted backend (fixed replies) reaches the mem0 UPDATE /
DELETE and ROAM relation code paths that a random model never takes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from atommem_rl.inference.chat_backends import Backend, HFBackend
from atommem_rl.tasks.load import load_dataset
from atommem_rl.eval.harness import evaluate, run_policy
from atommem_rl.eval.methods import ALL_METHODS, EvalSettings, pack_chunks, parse_mem0, parse_roam, public_task, unit_lines
from atommem_rl.policies.heuristic import HeuristicPolicy
from atommem_rl.tasks.schema import save_tasks
from atommem_rl.tasks.synth import generate_tasks

from .conftest import REPO, DATA


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from atommem_rl.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=32, layers=1, heads=2, kv_heads=1,
                      intermediate_size=64)


class ScriptedBackend(Backend):
    """Fixed replies chosen from the prompt (a scripted model output), real tokenizer and counting."""

    name = "scripted"

    def __init__(self, reply):
        from envs.tokens import cached_smollm2_tokenizer

        super().__init__("scripted", cached_smollm2_tokenizer(), 8192)
        self.reply = reply
        self.prompts = []
        self.calls = []

    def generate(self, requests):
        outs = []
        for r in requests:
            text = r.messages[-1]["content"]
            self.prompts.append(text)
            self.calls.append(r)
            out = self.reply(r.messages[0]["content"], text)
            self._account(r.key, self.count(self.render(r.messages)), self.count(out), role=r.role)
            outs.append(out)
        return outs


def _small(n=1, docs=5, seed=3, kind="documents", confounders=1):
    return generate_tasks(n, seed=seed, kind=kind, docs=docs, questions=2, confounders=confounders)


def test_oracle_reaches_upper_bound_through_harness(tmp_path):
    datasets = {"synth_docs": generate_tasks(4, seed=11, docs=10, questions=(1, 3), confounders=2),
                "synth_dialogue": generate_tasks(3, seed=12, kind="dialogue", docs=8, questions=2, confounders=1)}
    m = evaluate(datasets, ["oracle"], tmp_path, settings=EvalSettings(viewer_tasks=1), log=lambda *_: None)
    for d in datasets:
        r = m["results"]["oracle"][d]
        assert r["em"] >= 0.95, (d, r)
        assert r["evidence_recall"] == pytest.approx(1.0)
        assert r["relation_pairs"] > 0 and r["relation_accuracy"] == pytest.approx(1.0)
        assert r["llm_calls_per_task"] == 0 and r["env_tokens_per_task"] > 0
        assert r["unanswered"] == 0 and r["tool_errors_per_task"] == 0
    for f in ("metrics.json", "report.md", "trajectories.jsonl", "viewer.html", "accuracy_by_method.png",
              "accuracy_by_category.png"):
        assert (tmp_path / f).stat().st_size > 0, f
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["settings"]["seed"] == 0 and saved["settings"]["datasets"]["synth_docs"]["tasks"] == 4
    rows = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert len(rows) == 7 and all(r["questions"] for r in rows)


def test_unanswered_questions_and_failed_calls_are_counted_apart_from_wrong_answers():
    from atommem_rl.eval.metrics import aggregate

    q = lambda pred, em: {"em": em, "f1": em, "prediction": pred}  # noqa: E731
    policy = [{"questions": [q("Paris", 1.0), q(None, 0.0)], "extra": {"tool_errors": 3}},
              {"questions": [q("  ", 0.0), q("Rome", 0.0)], "extra": {"tool_errors": 1}}]
    r = aggregate(policy)
    assert r["unanswered"] == pytest.approx(0.5) and r["tool_errors_per_task"] == pytest.approx(2.0)
    reader = aggregate([{"questions": [q("Oslo", 0.0)], "extra": {}}])
    assert reader["unanswered"] == 0.0 and reader["tool_errors_per_task"] is None  # not a policy method


def test_a_killed_run_resumes_without_redoing_finished_methods(tmp_path):
    """Finished (method, dataset) pairs survive a crash in records.partial.jsonl; ``resume`` skips
    them (no LLM call made again) and the final metrics equal those of a run that was never killed."""
    tasks = {"a": _small(2, docs=3), "b": _small(1, docs=3, seed=4)}
    full = evaluate(tasks, ["oracle", "append_all", "rag"], tmp_path / "full", settings=EvalSettings(viewer_tasks=1),
                    backend=ScriptedBackend(lambda *_: "unknown"), log=lambda *_: None)

    class Dies(ScriptedBackend):
        def generate(self, requests):
            if any(r.key[0] == "rag" for r in requests):
                raise RuntimeError("killed")
            return super().generate(requests)

    out = tmp_path / "run"
    with pytest.raises(RuntimeError):
        evaluate(tasks, ["oracle", "append_all", "rag"], out, settings=EvalSettings(viewer_tasks=1),
                 backend=Dies(lambda *_: "unknown"), log=lambda *_: None)
    assert not (out / "metrics.json").exists() and (out / "records.partial.jsonl").exists()
    with (out / "records.partial.jsonl").open("a") as fh:
        fh.write('{"record": {"method": "rag", "datas')  # torn by the kill: ignored
    again = ScriptedBackend(lambda *_: "unknown")
    logs = []
    m = evaluate(tasks, ["oracle", "append_all", "rag"], out, settings=EvalSettings(viewer_tasks=1), backend=again,
                 resume=True, log=logs.append)
    assert json.loads(logs[0])["done"] == ["append_all/a", "append_all/b", "oracle/a", "oracle/b"]
    assert {r.key[0] for r in again.calls} == {"rag"}  # only the unfinished method ran
    assert not (out / "records.partial.jsonl").exists()
    for meth in ("oracle", "append_all", "rag"):
        for d in tasks:
            a, b = m["results"][meth][d], full["results"][meth][d]
            assert (a["em"], a["f1"], a["tokens_per_task"], a["llm_calls_per_task"]) == (
                b["em"], b["f1"], b["tokens_per_task"], b["llm_calls_per_task"]), (meth, d)
    # a partial file of another run (other settings): nothing is resumed from it
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "records.partial.jsonl").write_text('{"header": {"settings": {"seed": 1}}}\n')
    logs.clear()
    evaluate(tasks, ["oracle"], tmp_path / "other", settings=EvalSettings(viewer_tasks=1), resume=True, log=logs.append)
    assert "starting over" in logs[0]


def test_every_method_runs_and_counts_calls(tmp_path, tiny):
    tasks = _small()
    backend = HFBackend(str(tiny), batch_size=8)
    s = EvalSettings(reader_max_new_tokens=4, manager_max_new_tokens=4, policy_max_new_tokens=8,
                     memagent_memory_tokens=8, memagent_chunk_tokens=128, chunk_tokens=256, viewer_tasks=1)
    m = evaluate({"synth": tasks}, list(ALL_METHODS), tmp_path, settings=s, backend=backend, log=lambda *_: None)
    res = m["results"]
    assert set(res) == set(ALL_METHODS)
    t = tasks[0]
    n_q = len(t.questions)
    n_units = sum(1 for b in t.blocks for u in b.units if u.text.strip())
    for name in ("full_context", "rag", "append_all"):
        assert res[name]["synth"]["llm_calls_per_task"] == n_q, name
    assert res["mem0"]["synth"]["llm_calls_per_task"] == n_units + n_q
    n_chunks = len(pack_chunks(backend, unit_lines(public_task(t)), 128))
    assert res["memagent"]["synth"]["llm_calls_per_task"] == n_chunks + n_q
    assert n_q <= res["roam"]["synth"]["llm_calls_per_task"] <= n_units + n_q
    assert res["atommem"]["synth"]["llm_calls_per_task"] >= 2
    for name in ("full_context", "rag", "append_all", "mem0", "memagent", "roam", "atommem"):
        r = res[name]["synth"]
        assert r["prompt_tokens_per_task"] > 0 and r["completion_tokens_per_task"] > 0, name
        assert r["tokens_per_task"] == r["prompt_tokens_per_task"] + r["completion_tokens_per_task"]
    # full context fits this short task: nothing cut, every unit shown
    assert res["full_context"]["synth"]["context_truncated"] == 0.0
    assert res["full_context"]["synth"]["evidence_recall"] == 1.0
    assert res["memagent"]["synth"]["evidence_recall"] is None
    rows = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows if r["steps"]} == set(ALL_METHODS)
    report = (tmp_path / "report.md").read_text()
    assert "| mem0 |" in report and "Token efficiency" in report
    eff = m["efficiency"]["synth"]["atommem_vs_mem0"]
    assert eff["ratio"] == pytest.approx(res["atommem"]["synth"]["tokens_per_task"] / res["mem0"]["synth"]["tokens_per_task"])


def test_full_context_truncation_is_reported(tmp_path):
    tasks = _small(docs=30)
    backend = ScriptedBackend(lambda system, user: "Paris")
    m = evaluate({"synth": tasks}, ["full_context"], tmp_path, backend=backend,
                 settings=EvalSettings(context_tokens=400, viewer_tasks=0), log=lambda *_: None)
    r = m["results"]["full_context"]["synth"]
    assert 0.0 < r["context_truncated"] < 1.0
    assert all(250 < backend.count(p) < 400 for p in backend.prompts), [backend.count(p) for p in backend.prompts]  # cut to fit, not emptied
    assert r["cut_prompts"] == 0


def test_scripted_manager_paths(tmp_path):
    def reply(system, user):
        if system.startswith("You are a memory manager"):
            return '{"event": "UPDATE", "id": "0", "text": "merged"}' if "[0]" in user else '{"event": "ADD"}'
        if system.startswith("You label"):
            return "1: CON\n2: EQV"
        return "Paris"

    tasks = generate_tasks(2, seed=5, docs=8, questions=2, confounders=1)
    backend = ScriptedBackend(reply)
    m = evaluate({"synth": tasks}, ["mem0", "roam"], tmp_path, backend=backend, settings=EvalSettings(viewer_tasks=2),
                 log=lambda *_: None)
    rows = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    mem0 = [r for r in rows if r["method"] == "mem0"]
    assert all(r["ops"].get("update", 0) > 0 and r["ops"].get("add") == 1 for r in mem0)
    assert all(r["memory_size"] == 1 for r in mem0)  # one atom, updated ever since
    roam = [r for r in rows if r["method"] == "roam"]
    roles = {m_["role"] for r in roam for m_ in r["steps"][-1]["memory"]}
    assert "evidence" in roles and "primary" in roles
    assert m["results"]["roam"]["synth"]["relation_pairs"] > 0
    assert m["results"]["roam"]["synth"]["relation_macro_f1"] is not None
    assert m["results"]["mem0"]["synth"]["relation_pairs"] == 0


def test_reply_parsers():
    assert parse_mem0('{"event": "DELETE", "id": "1"}', 2) == ("DELETE", 1, "", True)
    assert parse_mem0("I think UPDATE id 0", 1)[:2] == ("UPDATE", 0)
    assert parse_mem0("noise", 3) == ("ADD", None, "", False)
    assert parse_mem0('{"event": "UPDATE", "id": "7"}', 2) == ("ADD", None, "", False)  # unknown id
    assert parse_mem0('{"event": "NONE"}', 0)[0] == "NOOP"
    assert parse_roam("1: CON\n2) eqv", 3) == ({1: "CON", 2: "EQV", 3: "IND"}, True)
    assert parse_roam("???", 2) == ({1: "IND", 2: "IND"}, False)


def test_non_oracle_methods_never_see_gold():
    tasks = generate_tasks(2, seed=7, docs=6, questions=2, confounders=1)
    p = public_task(tasks[0])
    assert all(not q.answers and not q.evidence and q.category is None for q in p.questions)
    assert all(u.role == "context" and u.fact is None for b in p.blocks for u in b.units)
    assert not p.relations and not p.meta
    seen = []

    class Recording(HeuristicPolicy):
        def start(self, key, task):
            seen.append(task)
            super().start(key, task)

    run_policy(tasks, Recording(), EvalSettings(viewer_tasks=0), None, ("heuristic", "x"))
    assert len(seen) == 2 and all(not q.answers for t in seen for q in t.questions)


def test_sweeps_and_training_ops_plot(tmp_path):
    datasets = {"d4": generate_tasks(2, seed=1, docs=4, questions=1, confounders=0),
                "d8": generate_tasks(2, seed=1, docs=8, questions=1, confounders=2)}
    run = tmp_path / "run" / "grpo" / "checkpoint-4"
    run.mkdir(parents=True)
    (run / "trainer_state.json").write_text(json.dumps({"global_step": 4, "log_history": [
        {"step": s, "ops/create_per_step": 1.0 + s, "ops/read_per_step": 2.0 - s / 4} for s in range(1, 5)]}))
    m = evaluate(datasets, ["oracle", "heuristic"], tmp_path / "out", settings=EvalSettings(viewer_tasks=0),
                 run_logs=str(tmp_path / "run"), log=lambda *_: None)
    assert set(m["sweeps"]["docs"]["oracle"]) == {"4", "8"}
    assert set(m["sweeps"]["confounders"]["heuristic"]) == {"0", "2"}
    for f in ("scaling_docs.png", "scaling_confounders.png", "ops_over_training.png"):
        assert f in m["plots"] and (tmp_path / "out" / f).stat().st_size > 1000


def _atommem(*args):
    return subprocess.run([sys.executable, "-m", "atommem_rl.cli", "eval", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_malformed_inputs_are_clear_errors(tmp_path):
    good = json.dumps(generate_tasks(1, seed=0, docs=3, questions=1)[0].to_dict())
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(good + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl, record 2 \(line 3\): not valid JSON"):
        load_dataset(bad_json)
    no_blocks = tmp_path / "noblocks.jsonl"
    no_blocks.write_text(json.dumps({"id": "t9", "questions": []}) + "\n")
    with pytest.raises(ValueError, match=r"noblocks\.jsonl, record 1 \(line 1, task 't9'\)"):
        load_dataset(no_blocks)
    d = json.loads(good)
    d["questions"][0]["answers"] = []
    no_ans = tmp_path / "noans.jsonl"
    no_ans.write_text(json.dumps(d) + "\n")
    with pytest.raises(ValueError, match=r"record 1 .*questions\[0\]\.answers: expected at least one string"):
        load_dataset(no_ans)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_dataset(tmp_path / "missing.jsonl")
    # through the CLI: exit 2, the file and record named; checkpoints named
    out = _atommem("--tasks", str(bad_json), "--methods", "oracle", "--out", str(tmp_path / "o"))
    assert out.returncode == 2 and "bad.jsonl, record 2" in out.stderr
    good_file = tmp_path / "good.jsonl"
    good_file.write_text(good + "\n")
    out = _atommem("--tasks", str(good_file), "--methods", "rag", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert out.returncode == 2 and str(tmp_path / "nope") in out.stderr
    broken = tmp_path / "broken_ckpt"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    out = _atommem("--tasks", str(good_file), "--methods", "oracle", "--checkpoint", str(broken), "--out", str(tmp_path / "o"))
    assert out.returncode == 2 and str(broken) in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_real_subsets_every_method(tmp_path, tiny):
    """The shared HotpotQA and LoCoMo subsets, every method, the tiny model (a few minutes on 2 cores)."""
    from atommem_rl.tasks.prepare import prepare_hotpotqa, prepare_locomo

    hp = prepare_hotpotqa(DATA / "hotpotqa" / "hotpotqa_train_100.json", docs=10, questions=2, limit=4)[:1]
    save_tasks(hp, tmp_path / "hotpotqa.jsonl")
    lc = prepare_locomo(DATA / "locomo" / "locomo10.json", limit=1)
    save_tasks(lc[:1], tmp_path / "locomo.jsonl")
    out = tmp_path / "eval"
    r = _atommem("--tasks", str(tmp_path / "hotpotqa.jsonl"), str(tmp_path / "locomo.jsonl"), "--max-blocks", "3",
                 "--model", str(tiny), "--out", str(out), "--reader-max-new-tokens", "4", "--manager-max-new-tokens", "4",
                 "--policy-max-new-tokens", "8", "--memagent-memory-tokens", "8", "--context-tokens", "2048")
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((out / "metrics.json").read_text())
    for meth in ALL_METHODS:
        assert set(m["results"][meth]) == {"hotpotqa", "locomo"}, meth
        assert "locomo_f1" in m["results"][meth]["locomo"]
    assert m["results"]["oracle"]["hotpotqa"]["em"] >= 0.95
    for f in ("report.md", "viewer.html", "trajectories.jsonl", "accuracy_by_category.png"):
        assert (out / f).exists()


def test_openai_backend_counts_endpoint_usage(tmp_path):
    """The OpenAI-compatible path against a real local HTTP server that replies with fixed text."""
    from atommem_rl.inference.chat_backends import make_backend

    from .conftest import JsonEndpoint, chat_reply

    srv = JsonEndpoint(lambda path, headers, body: chat_reply("Paris", 100, 2))
    seen = srv.requests
    try:
        from envs.tokens import DEFAULT_CACHE

        b = make_backend("openai", base_url=srv.url, model_name="policy",
                         tokenizer=str(DEFAULT_CACHE))
        tasks = _small()
        m = evaluate({"synth": tasks}, ["rag"], tmp_path, backend=b, settings=EvalSettings(viewer_tasks=0),
                     log=lambda *_: None)
    finally:
        srv.close()
    r = m["results"]["rag"]["synth"]
    n_q = len(tasks[0].questions)
    assert r["llm_calls_per_task"] == n_q and r["prompt_tokens_per_task"] == 100 * n_q
    assert r["completion_tokens_per_task"] == 2 * n_q
    assert all(s["model"] == "policy" and s["temperature"] == 0.0 for s in seen)
    rows = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert all(q["prediction"] == "Paris" for q in rows[0]["questions"])


def test_policy_env_reaches_policy_episodes_but_not_eval_owned_settings():
    """A checkpoint is evaluated in its training environment (EvalSettings.policy_env), while the
    reward, tokenizer and the evaluation's own settings cannot be overridden from there."""
    from atommem_rl.eval.harness import env_config

    task = _small()[0]
    cfg = env_config(task, EvalSettings(policy_env={"max_answer_steps": 1, "disable": "update"}), None)
    assert cfg["max_answer_steps"] == 1 and cfg["disable"] == "update" and cfg["reward"] == "em"
    with pytest.raises(ValueError, match="reward"):
        EvalSettings(policy_env={"reward": "f1"})
    with pytest.raises(ValueError, match="max_answr_steps"):  # misspelt: refused before any model loads
        EvalSettings(policy_env={"max_answr_steps": 1})
    with pytest.raises(ValueError, match="on_full must be one of refuse, evict"):
        EvalSettings(policy_env={"on_full": "drop"})
