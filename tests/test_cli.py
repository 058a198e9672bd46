"""The console script: every command documents its flags; bench memory prints the stable JSON shape."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from atommem_rl.cli import COMMANDS, build_parser

from .conftest import REPO


def atommem(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atommem_rl.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_every_command_has_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(COMMANDS) <= set(sub.choices)
    for name, p in sub.choices.items():
        assert p.format_help().strip(), name


def test_bench_memory_json_contract():
    out = atommem("bench", "memory", "--sizes", "120", "--repeats", "30", "--rwr-sizes", "400", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result["ops"]) == {"create", "read", "read_filtered", "update", "delete", "relate"}
    for fig in result["ops"].values():
        assert fig["atoms"] == 120 and fig["ours_ms"] > 0 and fig["chroma_ms"] > 0
        assert fig["ratio"] == pytest.approx(fig["ours_ms"] / fig["chroma_ms"], rel=1e-2)
    (rwr,) = result["rwr"]
    assert rwr["nodes"] == 400 and rwr["ours_ms"] > 0 and rwr["networkx_ms"] > 0 and rwr["speedup"] > 0


def test_bad_arguments_are_clear_errors():
    out = atommem("bench", "memory", "--sizes", "10", "--repeats", "30", "--rwr-sizes", "")
    assert out.returncode == 2 and "too small" in out.stderr


def test_bench_env_json_contract():
    """Both store modes take the same actions; the paired ratio is reported (its size is a benchmark
    figure, docs/BENCHMARKS.md, not asserted here)."""
    out = atommem("bench", "env", "--atoms", "80", "--steps", "12", "--warmup", "2", "--tokenizer", "words",
                  "--compare-write-through", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["atoms"] == 80 and r["steps"] == 12 and r["write_behind"] == 64
    for fig in (r, r["write_through"]):
        assert fig["step_ms_median"] > 0 and fig["prompt_ms"] > 0 and fig["tools_ms"] > 0
    assert r["ratio_write_through_over_default"] == pytest.approx(
        r["write_through"]["step_ms_median"] / r["step_ms_median"], rel=0.02)


def test_sigterm_unwinds_the_command_so_cleanup_runs(tmp_path):
    """SIGTERM ends a command like Ctrl-C does: its ``finally`` blocks run (that is where stores are
    dropped and where vLLM's engine processes get stopped instead of being orphaned) and the exit
    status is 128 + 15."""
    import signal
    import time

    marker = tmp_path / "cleaned"
    code = f"""
import argparse, sys, time
import atommem_rl.cli as cli

def blocking(args):
    try:
        print("ready", flush=True)
        time.sleep(120)
    finally:
        open({str(marker)!r}, "w").write("yes")

def parser():
    p = argparse.ArgumentParser()
    p.set_defaults(func=blocking, command="block")
    return p

cli.build_parser = parser
sys.exit(cli.main([]))
"""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert marker.read_text() == "yes"


def test_eval_takes_the_policy_environment():
    """``atommem eval --policy-env JSON`` becomes EvalSettings.policy_env (a checkpoint is evaluated in
    the environment it was trained in); a bad value is an argparse error, not a traceback."""
    args = build_parser().parse_args(["eval", "--tasks", "t.jsonl", "--out", "o",
                                      "--policy-env", '{"max_answer_steps": 1, "disable": "update"}'])
    assert args.policy_env == {"max_answer_steps": 1, "disable": "update"}
    out = atommem("eval", "--tasks", "t.jsonl", "--out", "o", "--policy-env", "{not json")
    assert out.returncode == 2 and "--policy-env" in out.stderr
