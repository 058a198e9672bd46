"""Your own data and reward (docs/OWN_DATA.md): the page's two minimal tasks load as written, tasks
without gold evidence run (and only what needs evidence refuses them, in one line), ``atommem data
prepare --source jsonl`` maps a user's fields, and ``reward: package.module:function`` is imported and
checked before any work and changes the returns the GRPO trainer sees."""

from __future__ import annotations

import json
import re

import pytest

from atommem_rl.tasks.schema import Task, load_tasks
from envs import make_env
from envs.core import EnvConfig, EnvConfigError

from .cli_helpers import run_cli
from .conftest import REPO


def page_tasks() -> list[dict]:
    text = (REPO / "docs" / "OWN_DATA.md").read_text()
    return [json.loads(b) for b in re.findall(r"```json\n(.*?)\n```", text, re.S)]


def test_the_pages_tasks_load_as_written_and_run_without_evidence(tmp_path):
    rows = page_tasks()
    assert [r["kind"] for r in rows] == ["documents", "dialogue"]
    path = tmp_path / "own.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = load_tasks(path)
    assert all(not q.evidence for t in tasks for q in t.questions)
    out = run_cli(["rollout", "--tasks", str(path), "--policy", "heuristic", "--out", str(tmp_path / "h.jsonl")])
    assert out.rc == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["episodes"] == 2 and summary["crashes"] == 0
    recs = [json.loads(x) for x in (tmp_path / "h.jsonl").read_text().splitlines()]
    assert all(r["evidence_recall"] is None for r in recs)


def test_only_what_needs_evidence_refuses_it(tmp_path):
    path = tmp_path / "own.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in page_tasks()))
    out = run_cli(["rollout", "--tasks", str(path), "--policy", "oracle", "--out", str(tmp_path / "o.jsonl")])
    assert out.rc == 2 and f"--policy oracle (tasks from {path}) needs gold evidence" in out.stderr
    assert "notes-1" in out.stderr
    assert len(out.stderr.splitlines()) == 1 and not (tmp_path / "o.jsonl").exists()
    out = run_cli(["eval", "--tasks", str(path), "--methods", "oracle,heuristic", "--out", str(tmp_path / "e")])
    assert out.rc == 2 and "the oracle method" in out.stderr
    out = run_cli(["eval", "--tasks", str(path), "--methods", "heuristic", "--max-blocks", "1", "--out",
                   str(tmp_path / "e")])
    assert out.rc == 2 and "--max-blocks" in out.stderr and "needs gold evidence" in out.stderr
    env = make_env(Task.from_dict(page_tasks()[0]), evidence_bonus=0.5)
    with pytest.raises(EnvConfigError, match="evidence_bonus needs gold evidence"):
        env.reset(seed=0)
    from atommem_rl.training.demonstrations import generate

    with pytest.raises(ValueError, match=r"oracle.s demonstrations .* needs gold evidence"):
        generate([Task.from_dict(page_tasks()[1])])
    # an empty evidence string is still refused: an id must name a unit
    bad = dict(page_tasks()[0], questions=[{"id": "Q1", "question": "q?", "answers": ["a"], "evidence": ["D9.s0"]}])
    with pytest.raises(ValueError, match="no unit has id 'D9.s0'"):
        Task.from_dict(bad)


def test_prepare_jsonl_maps_the_users_fields(tmp_path):
    src = tmp_path / "mine.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [
        {"uid": "a1", "data": {"passages": ["Oslo is the capital of Norway. It lies on a fjord.", "Bergen is rainy."]},
         "q": "What is the capital of Norway?", "a": "Oslo"},
        {"uid": "a2", "data": {"passages": [[{"role": "user", "content": "My dog is Rex."},
                                             {"role": "assistant", "content": "Nice name!"}]]},
         "q": ["What is the dog called?", "Who has a dog?"], "a": [["Rex"], "the user"]},
    ]) + "\n")
    out = tmp_path / "tasks.jsonl"
    args = ["data", "prepare", "--source", "jsonl", "--path", str(src), "--out", str(out), "--context-field",
            "data.passages", "--question-field", "q", "--answer-field", "a", "--id-field", "uid"]
    res = run_cli(args)
    assert res.rc == 0, res.stderr
    docs, chat = load_tasks(out)
    assert (docs.id, docs.kind, len(docs.blocks), len(docs.blocks[0].units)) == ("a1", "documents", 2, 2)
    assert docs.questions[0].answers == ["Oslo"] and docs.questions[0].evidence == []
    assert (chat.kind, [u.speaker for u in chat.blocks[0].units]) == ("dialogue", ["user", "assistant"])
    assert [q.answers for q in chat.questions] == [["Rex"], ["the user"]]
    res = run_cli(args[:-6] + ["--context-field", "data.passages", "--question-field", "question",
                               "--answer-field", "a"])
    assert res.rc == 2 and "line 1: no field 'question' (the --question-field)" in res.stderr


def test_custom_reward_is_checked_before_any_work_and_scores_episodes():
    for spec, msg in [("tests.own_reward:missing", "has no function missing"),
                      ("no_such_pkg.mod:fn", "cannot import no_such_pkg.mod"),
                      ("tests.own_reward:wrong_arguments", "must take the keyword arguments"),
                      ("bleu", "reward must be one of em, f1, locomo_f1, judge or package.module:function")]:
        with pytest.raises(ValueError, match=re.escape(msg)):
            EnvConfig(reward=spec)
    from atommem_rl.training.recipes import RecipeError, check_env_config

    with pytest.raises(RecipeError, match="has no function missing"):
        check_env_config({"reward": "tests.own_reward:missing"}, "recipe.yaml")

    task = Task.from_dict(page_tasks()[0])
    answer = '<tool_call>\n{"name": "answer", "arguments": {"question_id": "Q1", "answer": "%s"}}\n</tool_call>'

    def episode_return(reward: str, said: str, **kw) -> tuple[float, dict]:
        env = make_env(task, reward=reward, tokenizer="words", max_chunks=1, **kw)
        env.reset(seed=0)
        total, done, info = 0.0, False, {}
        while not done:
            _, r, term, trunc, info = env.step(answer % said if env.phase == "answer" else "")
            total, done = total + r, term or trunc
        env.close()
        return total, info

    assert episode_return("em", "right")[0] == 0.0
    got, info = episode_return("tests.own_reward:per_question", "right")
    assert got == 1.0 and info["questions"][0]["score"] == 1.0 and info["em"] == 0.0
    assert episode_return("tests.own_reward:per_question", "wrong")[0] == 0.0
    # shaping applies on top, as for the built-in scores
    assert episode_return("tests.own_reward:per_question", "right", relation_bonus=0.5)[0] == 1.0
    with pytest.raises(ValueError, match=r"reward tests.own_reward:not_a_number returned nan"):
        episode_return("tests.own_reward:not_a_number", "right")


@pytest.mark.slow
def test_grpo_on_tasks_without_evidence_sees_the_custom_reward_and_the_checkpoint_evaluates(tmp_path):
    """One GRPO step (tiny model) on two evidence-free tasks with ``reward: tests.own_reward:by_task``:
    the trainer's logged mean reward is the function's (0.25 and 0.75 per task; under em it would be 0),
    and the checkpoint evaluates on the same file."""
    from atommem_rl.models import tiny_model
    from atommem_rl.training.grpo import GRPORecipeConfig, train

    rows = page_tasks()
    tasks = tmp_path / "own.jsonl"
    tasks.write_text("".join(json.dumps(dict(r, id=i)) + "\n" for r, i in zip(rows, ("own-a", "own-b"))))
    tiny = tiny_model(tmp_path / "tiny")
    config = GRPORecipeConfig(
        model_name_or_path=str(tiny), output_dir=str(tmp_path / "grpo"), use_cpu=True, bf16=False,
        per_device_train_batch_size=4, num_generations=2, max_completion_length=8, max_steps=1, logging_steps=1,
        save_steps=1, report_to="none", gradient_checkpointing=False, tasks=str(tasks), seed=0,
        env_config={"chunk_tokens": 64, "max_prompt_tokens": 2048, "max_answer_steps": 1,
                    "reward": "tests.own_reward:by_task"})
    assert train(config)["global_step"] == 1
    state = json.loads((tmp_path / "grpo" / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["log_history"][0]["reward"] == pytest.approx(0.5)  # (0.25 + 0.75) / 2 over 2 x 2 episodes
    out = run_cli(["eval", "--tasks", f"own={tasks}", "--methods", "atommem,heuristic", "--model",
                   str(tmp_path / "grpo"), "--out", str(tmp_path / "eval"), "--policy-max-new-tokens", "8",
                   "--reader-max-new-tokens", "4"], timeout=600)
    assert out.rc == 0, out.stderr
    results = json.loads((tmp_path / "eval" / "metrics.json").read_text())["results"]
    assert results["atommem"]["own"]["evidence_recall"] is None
