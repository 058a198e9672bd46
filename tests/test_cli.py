"""The console script: every flag the README documents exists; bench memory and env print the stable JSON shape."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from atommem_rl.cli import build_parser

from .conftest import REPO


def atommem(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atommem_rl.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _options(parser) -> dict[str, object]:
    """{subcommand path: its parser} for every (nested) subcommand."""
    out = {}

    def walk(p, path):
        out[path] = p
        for a in p._actions:
            if isinstance(a, __import__("argparse")._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, f"{path} {name}".strip())

    walk(parser, "")
    return out


def test_every_flag_the_readme_documents_exists():
    """Each row of the README's command table names a subcommand and flags; the parser of that subcommand
    must take every one of them (a renamed or removed flag fails here, not in a user's shell)."""
    import re

    parsers = _options(build_parser())
    rows = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `atommem ")]
    assert len(rows) >= 10
    checked = 0
    for row in rows:
        cmd = re.match(r"\| `atommem ([^`]*)`", row).group(1)
        words = []
        for w in cmd.split():
            if w.startswith(("-", "[", "FILE", "RECIPE", "...")) or w.isupper():
                break
            words.append(w.replace("\\|", "|"))
        for path in [" ".join(p) for p in __import__("itertools").product(*[w.split("|") for w in words])]:
            assert path in parsers, (path, row[:80])
            if path in ("sft", "grpo", "ppo"):
                continue  # their flags are the recipe's fields (tests/test_recipes.py)
            known = {o for a in parsers[path]._actions for o in a.option_strings}
            for flag in set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", row)):
                assert flag in known, f"README documents `atommem {path} {flag}`, which the parser does not take"
                checked += 1
    assert checked >= 20, checked


def test_bench_memory_json_contract():
    out = atommem("bench", "memory", "--sizes", "120", "--repeats", "30", "--rwr-sizes", "400", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result["ops"]) == {"create", "read", "read_filtered", "update", "delete", "relate"}
    for fig in result["ops"].values():
        assert fig["atoms"] == 120 and fig["ours_ms"] > 0 and fig["chroma_ms"] > 0
        assert fig["ratio"] > 0
    (rwr,) = result["rwr"]
    assert rwr["nodes"] == 400 and rwr["ours_ms"] > 0 and rwr["networkx_ms"] > 0 and rwr["speedup"] > 0
    # progress on stderr while it runs (stdout is the JSON alone)
    assert "bench memory: 120 atoms: done in" in out.stderr and "on 400 nodes" in out.stderr


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
    assert r["ratio_write_through_over_default"] > 0


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
