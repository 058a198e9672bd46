"""What a user sees when ``atommem`` refuses (issue 39, item 5): the version, arguments checked before the
first phase, no empty output folder left behind, one line of error with no notices before it, help examples
as written. Real commands in a fresh interpreter, as a user runs them."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tomllib

import pytest

from atommem_rl.cli import build_parser
from atommem_rl.cli_refusal import HeldNotices, OutputFolders

from .conftest import REPO

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "ANONYMIZED_TELEMETRY": "False",
       "WANDB_MODE": "disabled"}
BAD_TASK = '{"id": "t1", "kind": "documents"}\n'  # no blocks, no questions


def atommem(*args, cwd=REPO, timeout=300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in ENV.items() if k != "TRL_EXPERIMENTAL_SILENCE"}  # as a user's shell has it
    return subprocess.run([sys.executable, "-m", "atommem_rl.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(res: subprocess.CompletedProcess, command: str) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"atommem {command}: error: "), \
        (res.returncode, res.stderr[-2000:])
    return lines[0]


def test_version_is_the_installed_packages():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    res = atommem("--version", timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == f"atommem {version}", res


@pytest.mark.parametrize("flag, value, named", [
    ("--methods", "oracle,heurstic", "heurstic"),
    ("--methods", "oracle,oracle", "more than once"),
    ("--embedder", "minlm", "minlm"),
    ("--locomo", "missing.json", "missing.json"),
    ("--base-model", "no-such-model", "no-such-model"),
])
def test_quickstart_checks_every_argument_before_its_first_phase(tmp_path, flag, value, named):
    """A misspelt method surfaced in the evaluation phase, after SFT and GRPO had run; an unknown embedder in
    the last phase; a --base-model that was no model was filled with a fresh conversion. Each is refused now
    with one line naming it, and no output folder exists afterwards (--skip eval: the method list is checked
    even when that phase will not run)."""
    out = tmp_path / "qs"
    value = str(tmp_path / value) if flag in ("--locomo", "--base-model") else value
    res = atommem("quickstart", "--tiny", "--out", out, "--skip", "eval", flag, value, timeout=120)
    assert named in one_line_error(res, "quickstart")
    assert not out.exists() and not (tmp_path / "no-such-model").exists()


def _bad_tasks(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(BAD_TASK)
    return bad


def _model(path):
    """A tiny random-weight model where the stage expects its policy: the refusal must come from the tasks,
    whether or not this checkout has converted the real base model yet (CI's fresh clone has not)."""
    from atommem_rl.models import tiny_model

    return tiny_model(path)


def test_sft_refusing_its_tasks_leaves_no_run_folder(tmp_path):
    """`atommem sft` with a bad task file made checkpoints/<run_name>/sft before reading the tasks and left it,
    empty, behind; the auto_bf16 notice and TRL's experimental-import warning came before the error line.
    Run from a folder of its own (recipes linked, a tiny model at the base model's path) with the recipe's default run folder."""
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    _model(tmp_path / "checkpoints" / "base" / "smollm2-135m-instruct")  # the recipe's default policy path
    res = atommem("sft", "--config", "recipes/quickstart_learning/sft.yaml", "--tasks", _bad_tasks(tmp_path),
                  "--run_name", "refused", cwd=tmp_path)
    assert "bad.jsonl" in one_line_error(res, "sft")
    assert not (tmp_path / "checkpoints" / "refused").exists()


@pytest.mark.slow
@pytest.mark.parametrize("stage, recipe", [("grpo", "recipes/quickstart_learning/grpo.yaml"),
                                           ("ppo", "recipes/quickstart/ppo.yaml")])
def test_rl_stages_refusing_their_tasks_leave_no_folder(tmp_path, stage, recipe):
    out = tmp_path / "runs" / "r" / stage
    res = atommem(stage, "--config", recipe, "--tasks", _bad_tasks(tmp_path), "--output_dir", out,
                  "--model_name_or_path", _model(tmp_path / "model"))
    assert not (tmp_path / "runs").exists()
    if stage == "grpo":
        assert "bad.jsonl" in one_line_error(res, stage)
    else:
        # PPO loads its critic before the trainer reads the tasks (training/ppo.py), so transformers' loading
        # progress comes first; the error is still one line and last, with no notice before it
        last = res.stderr.strip().splitlines()[-1]
        assert res.returncode == 2 and last.startswith("atommem ppo: error: ") and "bad.jsonl" in last, res.stderr
        assert "auto_bf16" not in res.stderr and "TRLExperimentalWarning" not in res.stderr, res.stderr


def test_eval_refusing_its_tasks_leaves_no_folder(tmp_path):
    out = tmp_path / "e" / "out"
    res = atommem("eval", "--tasks", _bad_tasks(tmp_path), "--methods", "oracle", "--out", out, timeout=120)
    one_line_error(res, "eval")
    assert not (tmp_path / "e").exists()


def test_only_new_empty_folders_are_removed(tmp_path):
    """The clean-up after a failure: folders the command made and left empty go, deepest first, with the
    parents it made; a folder it wrote into and every folder that existed before stay."""
    root = tmp_path / "made" / "run"
    (tmp_path / "before" / "empty").mkdir(parents=True)
    guard = OutputFolders([root, tmp_path / "before"])
    (root / "sft" / "checkpoint-1").mkdir(parents=True)
    (root / "grpo").mkdir()
    (root / "grpo" / "log.txt").write_text("kept")
    (tmp_path / "before" / "new").mkdir()
    guard.remove_new_empty()
    assert (root / "grpo" / "log.txt").read_text() == "kept"
    assert not (root / "sft").exists() and (tmp_path / "before" / "empty").is_dir()
    assert not (tmp_path / "before" / "new").exists()
    guard = OutputFolders([tmp_path / "x" / "y"])
    (tmp_path / "x" / "y" / "z").mkdir(parents=True)
    guard.remove_new_empty()
    assert not (tmp_path / "x").exists()


def test_notices_are_held_and_dropped_on_refusal():
    real = io.StringIO()
    held = HeldNotices(real)
    print("auto_bf16: cpu lacks native bf16, training in fp32", file=held)
    assert real.getvalue() == ""
    held.close(refused=True)
    assert real.getvalue() == ""
    real = io.StringIO()
    held = HeldNotices(real)
    print("auto_bf16: cpu has native bf16", file=held)
    held.write("progress 1/4\r")
    held.close(refused=False)
    assert real.getvalue() == "auto_bf16: cpu has native bf16\nprogress 1/4\r"


def _parsers(parser, path=""):
    yield path, parser
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}".strip())


# a line continuation collapsed by an ordinary docstring: "--docs 20         --questions 1-3" on one line
COLLAPSED = re.compile(r"\S {3,}--[a-z]")


def test_help_examples_render_as_written():
    """Every `atommem ... --help` shows its examples with their line continuations, not as one line with runs
    of spaces (ordinary docstrings drop a backslash-newline)."""
    seen = []
    for path, parser in _parsers(build_parser()):
        text = parser.format_help()
        bad = [ln for ln in text.splitlines() if COLLAPSED.search(ln)]
        assert not bad, (path, bad)
        seen.append(path)
    assert {"eval", "rollout", "data", "quickstart", "bench update"} <= set(seen)
    assert re.search(r"\\\n\s+--", build_parser()._subparsers._group_actions[0].choices["eval"].format_help())


@pytest.mark.slow
def test_stage_help_examples_render_as_written():
    """The training stages' help, which TRL's parser prints from the stage module's docstring (~20 s each)."""
    for stage in ("sft", "grpo", "ppo"):
        res = atommem(stage, "--help", timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        bad = [ln for ln in res.stdout.splitlines() if COLLAPSED.search(ln)]
        assert not bad, (stage, bad)


def test_an_import_time_notice_does_not_reach_stdout():
    """transformers prints "[INFO] Running in WANDB offline mode" to stdout when its integrations are imported
    under WANDB_MODE=offline, which broke `atommem bench memory-plan --json` (JSONDecodeError in CI): the CLI
    sends that import's output to stderr, and stdout holds only what the command prints."""
    code = ("from atommem_rl.cli_refusal import StdoutKeptForOutput\n"
            "StdoutKeptForOutput.install()\n"
            "import transformers.integrations.integration_utils\n"
            "print('{\"ok\": true}')\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**ENV, "WANDB_MODE": "offline"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout == '{"ok": true}\n' and "WANDB offline mode" in res.stderr
