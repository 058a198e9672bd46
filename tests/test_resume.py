"""SIGKILL and resume: ``atommem grpo|ppo`` killed after its first checkpoint and rerun with
``--resume_from_checkpoint true`` ends exactly where an uninterrupted run with the same seed ends.

Each test runs the stage's CLI three times on a tiny random-weight model (CPU): an uninterrupted run (in this process); a subprocess killed with SIGKILL as soon as its
first checkpoint-N is complete; and the same command again, which resumes from the newest intact
checkpoint. (SFT's SIGKILL-and-resume test is tests/test_sft.py::test_sigkill_and_resume_matches_uninterrupted.)
Then:

* the resumed run completes (exit 0, global_step = max_steps) and reports what it resumed from;
* every checkpoint-N of both runs loads: the model (``models.load_policy``), the trainer state, the
  optimizer, scheduler and RNG state (``torch.load``), and for PPO the critic and its optimizer;
* the log history of every step after the resume point (loss, reward, GRPO/PPO episode metrics,
  critic loss) and the final weights match the uninterrupted run.

Tolerance: log values within rel 1e-4 / abs 1e-6, final weights within abs 1e-5. On one CPU process
the same operations run in the same order on restored data order, RNG state, optimizer (and critic),
so the runs agree to float rounding (observed: identical); a data order that is not restored (e.g.
TRL's RepeatSampler restarting its permutation stream in a resumed epoch) moves the rewards and the
weights far beyond this. GRPO/PPO rollouts use seeded sampling (training/seeded_sampling.py).
A random-weight policy's GRPO episodes would all score 0 (zero advantages, no update), so every run goes
through tests/multirank/scripted_returns.py: each episode's return is a fixed function of its own
completion tokens, so the advantages are not zero, and both stages check that the policy moved (and, for
PPO, that policy and critic weights match).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import REPO

ENV_CONFIG = json.dumps({"chunk_tokens": 64, "max_prompt_tokens": 2048, "max_answer_steps": 1, "format_penalty": 0.5})
MAX_STEPS = 4


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Path:
    from atommem_rl.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=32, heads=2, kv_heads=1,
                      intermediate_size=64)


def command(stage: str, tiny: Path, out: Path) -> list[str]:
    cmd = [sys.executable, str(REPO / "tests/multirank/scripted_returns.py"), stage,
           "--model_name_or_path", str(tiny), "--output_dir", str(out),
           "--use_cpu", "true", "--bf16", "false", "--report_to", "none", "--gradient_checkpointing", "false",
           "--learning_rate", "1e-3", "--max_steps", str(MAX_STEPS), "--save_steps", "1", "--logging_steps", "1",
           "--seed", "0", "--resume_from_checkpoint", "true"]
    # 4 tasks, 2 per step (group of 2): 2 steps per epoch, so the resume lands in a later epoch too
    return cmd + ["--synth_tasks", "4", "--synth_docs", "1", "--synth_questions", "1", "--synth_confounders", "0",
                  "--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "16",
                  "--env_config", ENV_CONFIG]


def run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "WANDB_MODE": "offline"})
    assert res.returncode == 0, res.stderr[-4000:]


def kill_after_first_checkpoint(cmd: list[str], out: Path) -> None:
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "WANDB_MODE": "offline"})
    deadline = time.time() + 600
    try:
        while not any(out.glob("checkpoint-*/trainer_state.json")):
            assert proc.poll() is None, f"run ended (exit {proc.returncode}) before its first checkpoint"
            assert time.time() < deadline, "no checkpoint within 600 s"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)


def history(out: Path) -> dict[int, dict]:
    state = json.loads((out / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    return {h["step"]: h for h in state["log_history"] if "loss" in h}


def check_every_checkpoint_loads(out: Path, stage: str) -> None:
    import torch

    from atommem_rl.models import load_policy
    from atommem_rl.training.checkpoints import check_trainer_checkpoint

    ckpts = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert [int(p.name.split("-")[1]) for p in ckpts] == list(range(1, MAX_STEPS + 1))
    for ckpt in ckpts:
        check_trainer_checkpoint(ckpt, ("critic",) if stage == "ppo" else ())
        load_policy(ckpt)
        state = json.loads((ckpt / "trainer_state.json").read_text())
        assert state["global_step"] == int(ckpt.name.split("-")[1])
        for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
            torch.load(ckpt / name, weights_only=False)
        if stage == "ppo":
            from transformers import AutoModelForSequenceClassification

            AutoModelForSequenceClassification.from_pretrained(ckpt / "critic")
            assert torch.load(ckpt / "critic" / "optimizer.pt", weights_only=True)["state"]


def assert_same_weights(a: Path, b: Path, atol: float = 1e-5) -> None:
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(a), load_file(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=atol, msg=k)


def resume_matches_uninterrupted(stage: str, tiny: Path, tmp_path: Path, monkeypatch) -> None:
    from atommem_rl.training.grpo import StepwiseGRPOTrainer

    from .multirank.scripted_returns import main

    monkeypatch.setattr(StepwiseGRPOTrainer, "_run_episodes", StepwiseGRPOTrainer._run_episodes)  # undone after

    full, part = tmp_path / "full" / stage, tmp_path / "part" / stage
    # the reference, in this process (no second start-up); main installs the scripted returns first
    assert main(command(stage, tiny, full)[2:]) == 0
    kill_after_first_checkpoint(command(stage, tiny, part), part)
    done = [int(p.parent.name.split("-")[1]) for p in part.glob("checkpoint-*/trainer_state.json")]
    resume_point = max(done)
    assert resume_point < MAX_STEPS, "the kill came too late to test a resume"
    assert not (part / f"{stage}_summary.json").exists()
    run(command(stage, tiny, part))

    summary = json.loads((part / f"{stage}_summary.json").read_text())
    assert summary["global_step"] == MAX_STEPS and summary["resumed_from"] == "last"
    assert summary["resume_checkpoint"].endswith(f"checkpoint-{resume_point}")
    for out in (full, part):
        check_every_checkpoint_loads(out, stage)
    h_full, h_part = history(full), history(part)
    after = [s for s in h_full if s > resume_point]
    assert after and set(h_full) == set(h_part) == set(range(1, MAX_STEPS + 1))
    keys = [k for k in h_full[after[0]] if isinstance(h_full[after[0]][k], (int, float)) and not k.startswith("epoch")
            and k not in ("step",)]
    keys = [k for k in keys if "time" not in k and "per_second" not in k]  # wall-clock figures differ
    assert "loss" in keys and "reward" in keys and "episode/steps" in keys
    for s in after:
        for k in keys:
            assert h_part[s][k] == pytest.approx(h_full[s][k], rel=1e-4, abs=1e-6), (s, k)
    assert_same_weights(full / "model.safetensors", part / "model.safetensors")
    from safetensors.torch import load_file

    w0, w1 = load_file(tiny / "model.safetensors"), load_file(full / "model.safetensors")
    assert max((w1[k] - w0[k]).abs().max().item() for k in w1 if k in w0) > 1e-4  # the policy moved
    assert all(h_full[s]["skipped_zero_advantage"] == 0.0 for s in h_full)
    if stage == "ppo":  # the critic was fitted
        assert "critic/value_loss" in keys
        assert_same_weights(full / "critic" / "model.safetensors", part / "critic" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["grpo", "ppo"])
def test_sigkill_resume_matches_uninterrupted(stage, policy, tmp_path, monkeypatch):
    resume_matches_uninterrupted(stage, policy, tmp_path, monkeypatch)


def test_every_rank_resumes_from_the_main_process_choice(tmp_path):
    """Ranks resolve ``resume_from_checkpoint: true`` on their own before a process group exists; with a
    checkpoint being written they could pick different ones. ``agree_on_resume`` (called by every stage
    once the trainer, and so the group, exists) gives each rank the main process's choice: a newer
    checkpoint rank 1 saw, or none, is overridden; a choice rank 1 cannot read stops it with the path."""
    from atommem_rl.models import tiny_model

    from .conftest import free_port

    older, newer = tmp_path / "checkpoint-1", tmp_path / "checkpoint-2"
    for step, ckpt in ((1, older), (2, newer)):
        tiny_model(ckpt, hidden_size=16, heads=2, kv_heads=1, intermediate_size=32)
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))

    def launch(*choices):
        out = tmp_path / f"ranks-{len(list(tmp_path.glob('ranks-*')))}.jsonl"
        accelerate = Path(sys.executable).with_name("accelerate")
        res = subprocess.run([str(accelerate), "launch", "--config_file", str(REPO / "recipes/accelerate/cpu_2proc.yaml"),
                              "--main_process_port", str(free_port()), str(REPO / "tests/multirank/resume_choice.py"),
                              str(out), *map(str, choices)], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        return sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["rank"])

    assert [r.get("chosen") for r in launch(older, newer)] == [str(older), str(older)]
    assert [r.get("chosen") for r in launch("none", newer)] == [None, None]
    missing = launch(tmp_path / "checkpoint-3", older)  # rank 0 names one rank 1 cannot see
    assert missing[0]["chosen"] == str(tmp_path / "checkpoint-3")
    assert "rank 1 cannot read the checkpoint the main process resumes from" in missing[1]["error"]

