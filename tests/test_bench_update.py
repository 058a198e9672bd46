"""``atommem bench update --tiny``: the padded and packed policy updates on real step samples of a
random-weight tiny model agree in fp32 and the figures of the issue are printed."""

from __future__ import annotations

import json

import pytest

from atommem_rl.cli import main as atommem


def test_bench_update_tiny(capsys):
    rc = atommem(["bench", "update", "--tiny", "--episodes", "2", "--docs", "1", "--max-new-tokens", "8",
                  "--repeats", "1", "--variants", "baseline,packed_all,packed", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("samples", "raw_tokens", "forwarded_tokens", "packing_ratio", "baseline_s", "packed_s", "speedup",
                "max_logprob_diff", "grad_cosine", "dtype"):
        assert key in out, key
    assert out["samples"] == sum(out["episode_steps"]) >= 2
    assert out["forwarded_tokens"] < out["raw_tokens"] and out["packing_ratio"] > 1
    assert out["max_logprob_diff"] <= 1e-4 and out["grad_cosine"] >= 0.9999
    assert out["dtype"] == "float32" and set(out["variants"]) == {"baseline", "packed_all", "packed"}
    assert all(len(v["runs_s"]) == 1 for v in out["variants"].values())


def test_bench_update_bad_input(capsys):
    assert atommem(["bench", "update", "--tiny", "--variants", "packed"]) == 2
    assert "--variants takes baseline" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # refused by argparse, before any model is built
        atommem(["bench", "update", "--tiny", "--repeats", "0"])
    assert info.value.code == 2 and "--repeats: expected a positive integer" in capsys.readouterr().err
