"""Bad input to a training stage stops it before any work starts, with an error naming the file and key.

Through the CLI (``atommem_rl.cli.main``, the console script's entry point; one case also as a real
``atommem`` subprocess): recipe typos (unknown keys, with the close match suggested), wrong types in
the recipe and on the command line, a truncated ``model.safetensors`` or a garbled ``config.json`` as
``model_name_or_path``, a garbled ``trainer_state.json`` or truncated ``optimizer.pt`` in the
checkpoint-N passed to ``resume_from_checkpoint``, and a PPO resume from a checkpoint without a
critic. Each asserts exit code 2 and that the output folder was not created (or not touched).
A tiny random-weight model (``models.tiny_model``) provides real checkpoint files to damage.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from atommem_rl.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=32, heads=2, kv_heads=1,
                      intermediate_size=64)


def cli(stage: str, *args: str, capsys) -> tuple[int, str]:
    from atommem_rl.cli import main

    code = main([stage, *args])
    return code, capsys.readouterr().err


def common(tiny: Path, out: Path) -> list[str]:
    return ["--model_name_or_path", str(tiny), "--output_dir", str(out), "--use_cpu", "true", "--bf16", "false",
            "--report_to", "none", "--max_steps", "1", "--synth_tasks", "2", "--synth_docs", "1"]


def snapshot(folder: Path) -> dict:
    """Every file under ``folder`` with its size and modification time (to prove nothing was written)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def fake_checkpoint(tiny: Path, folder: Path, step: int = 1) -> Path:
    """A checkpoint-N with real files: the tiny model, a trainer state, a torch.save optimizer."""
    import torch

    shutil.copytree(tiny, folder)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    torch.save({"state": {}, "param_groups": []}, folder / "optimizer.pt")
    return folder


@pytest.mark.parametrize("stage", ["sft", "grpo", "ppo"])
def test_unknown_recipe_key_suggests_the_close_match(stage, tiny, tmp_path, capsys):
    rec = tmp_path / f"{stage}.yaml"
    rec.write_text("use_cpu: true\nlearning_rat: 1.0e-5\n")
    out = tmp_path / "run" / stage
    code, err = cli(stage, "--config", str(rec), *common(tiny, out), capsys=capsys)
    assert code == 2
    assert str(rec) in err and "'learning_rat'" in err and "did you mean learning_rate" in err
    assert not out.parent.exists()


def test_wrong_type_in_recipe_names_file_and_key(tiny, tmp_path, capsys):
    rec = tmp_path / "grpo.yaml"
    rec.write_text("num_generations: four\n")
    out = tmp_path / "run" / "grpo"
    code, err = cli("grpo", "--config", str(rec), *common(tiny, out), capsys=capsys)
    assert code == 2 and str(rec) in err and "'num_generations'" in err and "four" in err
    assert not out.parent.exists()


def test_wrong_type_on_the_command_line_names_the_key(tiny, tmp_path, capsys):
    out = tmp_path / "run" / "sft"
    code, err = cli("sft", *common(tiny, out), "--learning_rate", "fast", capsys=capsys)
    assert code == 2 and "learning_rate" in err and "fast" in err
    assert not out.parent.exists()


def test_truncated_model_weights(tiny, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    weights = model / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    out = tmp_path / "run" / "grpo"
    code, err = cli("grpo", *common(model, out), capsys=capsys)
    assert code == 2 and str(weights) in err and "model_name_or_path" in err and "truncated" in err
    assert not out.parent.exists()


def test_garbled_model_config(tiny, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": 3')
    out = tmp_path / "run" / "sft"
    code, err = cli("sft", *common(model, out), capsys=capsys)
    assert code == 2 and str(model / "config.json") in err and "not valid JSON" in err
    assert not out.parent.exists()


@pytest.mark.parametrize("damage", ["trainer_state", "optimizer"])
def test_corrupt_checkpoint_passed_to_resume(damage, tiny, tmp_path, capsys):
    out = tmp_path / "run" / "grpo"
    ckpt = fake_checkpoint(tiny, out / "checkpoint-1")
    if damage == "trainer_state":
        bad = ckpt / "trainer_state.json"
        bad.write_text('{"global_step": 1, "log_hist')
    else:
        bad = ckpt / "optimizer.pt"
        with open(bad, "r+b") as f:
            f.truncate(bad.stat().st_size - 40)
    before = snapshot(out)
    code, err = cli("grpo", *common(tiny, out), "--resume_from_checkpoint", str(ckpt), capsys=capsys)
    assert code == 2 and str(bad) in err and "corrupt checkpoint file" in err
    assert snapshot(out) == before  # nothing written, nothing started


def test_ppo_resume_needs_the_critic(tiny, tmp_path, capsys):
    out = tmp_path / "run" / "ppo"
    ckpt = fake_checkpoint(tiny, out / "checkpoint-1")
    before = snapshot(out)
    code, err = cli("ppo", *common(tiny, out), "--resume_from_checkpoint", str(ckpt), capsys=capsys)
    assert code == 2 and str(ckpt) in err and "critic" in err
    assert snapshot(out) == before


def test_auto_resume_skips_an_incomplete_newest_checkpoint(tiny, tmp_path, capsys):
    """A run killed while writing checkpoint-2 resumes from checkpoint-1 (with a warning naming the
    skipped one); an explicitly named damaged checkpoint is an error instead."""
    from atommem_rl.models import CheckpointError
    from atommem_rl.training.checkpoints import resolve_resume

    out = tmp_path / "run"
    fake_checkpoint(tiny, out / "checkpoint-1", step=1)
    two = fake_checkpoint(tiny, out / "checkpoint-2", step=2)
    (two / "trainer_state.json").unlink()  # trainer_state.json is written last
    fake_checkpoint(tiny, out / "checkpoint-10", step=10)
    with open(out / "checkpoint-10" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert resolve_resume("true", out) == str(out / "checkpoint-1")
    err = capsys.readouterr().err
    assert "checkpoint-10" in err and "checkpoint-2" in err
    assert resolve_resume(None, out) is None and resolve_resume("true", tmp_path / "empty") is None
    with pytest.raises(CheckpointError, match="checkpoint-2"):
        resolve_resume(str(two), out)


def test_console_script_exit_code(tiny, tmp_path):
    """The same check through the installed ``atommem`` script in a fresh process."""
    rec = tmp_path / "ppo.yaml"
    rec.write_text("gama: 0.9\n")
    out = tmp_path / "run" / "ppo"
    exe = Path(sys.executable).with_name("atommem")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "atommem_rl.cli"]
    res = subprocess.run([*cmd, "ppo", "--config", str(rec), *common(tiny, out)], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 2 and str(rec) in res.stderr and "did you mean gamma" in res.stderr
    assert not out.parent.exists()
