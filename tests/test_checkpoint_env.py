"""Checkpoints carry their environment (atommem_rl/training/checkpoint_env.py): training writes
``atommem_env.json`` beside the weights, LoRA merges copy it, ``atommem eval`` and ``atommem rollout``
run the policy in it without ``--policy-env``, and an override that names no setting is refused with
"did you mean"."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from atommem_rl.training.checkpoint_env import (ENV_FILE, CheckpointEnvError, copy_env, policy_env, read_env,
                                                write_env)

from .cli_helpers import run_cli
from .conftest import REPO

TRAINED = {"chunk_tokens": 64, "max_prompt_tokens": 2048, "max_answer_steps": 1, "disable": "update,delete"}


def test_written_read_overridden_and_copied(tmp_path):
    run = tmp_path / "run"
    write_env(run, TRAINED, "grpo")
    data = json.loads((run / ENV_FILE).read_text())
    assert data["trained_by"] == "grpo" and data["set"] == sorted(TRAINED)
    assert data["env"]["max_answer_steps"] == 1 and data["env"]["read_budget"] == 3  # defaults resolved
    assert "update_memory" not in data["tools"] and "create_memory" in data["tools"]
    # a checkpoint-N folder and a merged folder inside the run read the run's file
    (run / "checkpoint-2").mkdir()
    assert read_env(run / "checkpoint-2")["env"]["disable"] == "update,delete"
    env = policy_env(run / "checkpoint-2", {"read_budget": 1})
    assert env["read_budget"] == 1 and env["max_answer_steps"] == 1
    merged = tmp_path / "merged"
    copy_env(run / "checkpoint-2", merged)
    assert read_env(merged) == data
    assert read_env(tmp_path / "nothing_here") == {} and policy_env(None, {}) == {}


def test_bad_overrides_and_files_are_one_line_errors(tmp_path):
    with pytest.raises(CheckpointEnvError, match=r"unknown key 'max_answr_steps'.*did you mean max_answer_steps"):
        policy_env(None, {"max_answr_steps": 1})
    with pytest.raises(CheckpointEnvError, match="on_full"):
        policy_env(None, {"on_full": "drop"})
    (tmp_path / ENV_FILE).write_text("{not json")
    with pytest.raises(CheckpointEnvError, match="unreadable environment file"):
        read_env(tmp_path)
    out = run_cli(["eval", "--tasks", "t.jsonl", "--out", str(tmp_path / "o"), "--methods", "heuristic",
                   "--policy-env", '{"max_answr_steps": 1}'])
    assert out.rc == 2 and "did you mean max_answer_steps" in out.stderr and len(out.stderr.splitlines()) == 1


@pytest.mark.slow
def test_grpo_checkpoint_is_evaluated_in_its_training_environment(tmp_path):
    """``atommem grpo`` (tiny model, one step) writes its environment; ``atommem eval --model CKPT`` with no
    --policy-env runs the policy with one answer step, 64-token chunks and no update/delete tools, and
    ``atommem rollout`` does too; a flag given on the command line still wins."""
    from atommem_rl.models import tiny_model
    from atommem_rl.tasks.synth import generate_tasks

    tiny = tiny_model(tmp_path / "tiny")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({
        "model_name_or_path": str(tiny), "output_dir": str(tmp_path / "grpo"), "use_cpu": True, "bf16": False,
        "per_device_train_batch_size": 2, "num_generations": 2, "max_completion_length": 8, "max_steps": 1,
        "logging_steps": 1, "save_steps": 1, "report_to": "none", "gradient_checkpointing": False,
        "synth_tasks": 1, "synth_docs": 1, "synth_questions": 1, "synth_confounders": 0, "seed": 0,
        "env_config": TRAINED}))
    res = subprocess.run([sys.executable, "-m", "atommem_rl.cli", "grpo", "--config", str(recipe)], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    ckpt = tmp_path / "grpo"
    assert read_env(ckpt)["env"]["max_answer_steps"] == 1

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t.to_dict()) + "\n"
                             for t in generate_tasks(1, seed=3, docs=6, questions=3, confounders=0)))
    out = tmp_path / "eval"
    res = run_cli(["eval", "--tasks", f"synth={tasks}", "--methods", "atommem", "--model", str(ckpt), "--out",
                   str(out), "--policy-max-new-tokens", "8", "--reader-max-new-tokens", "4"], timeout=600)
    assert res.rc == 0, res.stderr
    settings = json.loads((out / "metrics.json").read_text())["settings"]
    assert settings["chunk_tokens"] == 64 and settings["max_prompt_tokens"] == 2048
    assert settings["policy_env"]["max_answer_steps"] == 1 and settings["policy_env"]["disable"] == "update,delete"
    assert settings["policy_env_file"].endswith(ENV_FILE)
    row = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()][0]
    kinds = [s["kind"] for s in row["steps"]]
    assert kinds.count("answer") == 1 and kinds.count("chunk") > 1  # default: 3 + 2 answer steps, one chunk

    traj = tmp_path / "rollout.jsonl"
    res = run_cli(["rollout", "--tasks", str(tasks), "--policy", "model", "--model", str(ckpt), "--out", str(traj),
                   "--max-new-tokens", "8", "--max-answer-steps", "2"], timeout=600)
    assert res.rc == 0, res.stderr
    rec = json.loads(traj.read_text().splitlines()[0])
    system = rec["steps"][0]["prompt"][0]["content"]  # the tool schemas shown (the rules name every tool)
    assert '"name": "update_memory"' not in system and '"name": "create_memory"' in system
    assert [s["phase"] for s in rec["steps"]].count("answer") == 2  # the flag over the checkpoint's 1
