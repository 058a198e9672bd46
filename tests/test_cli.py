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
