"""``atommem bench rollout`` (HF generate on a tiny random-weight model: figures are produced, the
repeated runs see the same work) and ``scripts/gpu_check.sh`` on CPU (--device cpu --tiny)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from atommem_rl.cli import main as atommem
from tests.conftest import REPO


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from atommem_rl.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=32, layers=1, heads=2, kv_heads=1,
                      intermediate_size=64)


def test_bench_rollout_hf(tiny, capsys):
    rc = atommem(["bench", "rollout", "--model", str(tiny), "--backends", "hf", "--tasks", "2", "--docs", "2",
                  "--repeats", "2", "--max-new-tokens", "8", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (hf,) = out["backends"]
    assert hf["backend"] == "hf" and len(hf["runs"]) == 2
    runs = hf["runs"]
    for r in runs:
        assert r["episodes"] == 2 and r["crashes"] == 0 and r["steps"] >= 4
        assert r["episodes_per_s"] > 0 and r["completion_tokens_per_s"] > 0
        assert 0.0 <= r["env_share"] < 1.0
        # at most max_new_tokens per action; every action produced at least one token
        assert r["steps"] / 2 <= r["completion_tokens_per_task"] <= 8 * r["steps"] / 2
    # greedy decoding from the same tasks: both runs did the same work
    assert runs[0]["prompt_tokens_per_task"] == runs[1]["prompt_tokens_per_task"]
    assert runs[0]["completion_tokens_per_task"] == runs[1]["completion_tokens_per_task"]
    med = hf["median"]
    assert min(r["episodes_per_s"] for r in runs) <= med["episodes_per_s"] <= max(r["episodes_per_s"] for r in runs)
    assert "speedup_vllm_over_hf" not in out


def test_bench_rollout_bad_input(tiny, capsys):
    assert atommem(["bench", "rollout", "--model", str(tiny), "--backends", "tgi"]) == 2
    assert "--backends takes hf and/or vllm" in capsys.readouterr().err
    assert atommem(["bench", "rollout", "--model", str(tiny / "missing")]) == 2
    assert "not found" in capsys.readouterr().err


def test_flops_formula_counts_the_model():
    """6N uses the parameters of the matrix multiplies: with untied embeddings that is every
    parameter except the embedding table and the norm weights."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from atommem_rl.bench.gpu_check import SHAPES, matmul_params, train_flops_per_token

    cfg = Qwen3Config(**{**SHAPES["tiny"], "tie_word_embeddings": False})
    model = AutoModelForCausalLM.from_config(cfg)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    embed = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    assert matmul_params(cfg) == total - embed - norms
    attn = 6 * cfg.num_hidden_layers * 100 * cfg.num_attention_heads * cfg.head_dim
    assert train_flops_per_token(cfg, 100) == 6 * matmul_params(cfg) + attn
    del torch


def test_gpu_check_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--device", "cpu", "--tiny", "--no-vllm",
                           "--json-out", str(out)], capture_output=True, text=True, timeout=300,
                          env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["shape"] == "tiny" and res["device"] == "cpu"
    assert res["rollout_hf"]["completion_tokens"] == 4 * 8  # rollout batch 4, 8 new tokens each
    assert res["rollout_hf"]["tokens_per_s"] > 0
    assert res["sft"]["tokens_per_step"] == 2 * 64 and res["sft"]["tokens_per_s"] > 0
    g = res["grpo"]
    assert g["rollout_backend"] == "hf" and g["completion_tokens_per_step"] == 4 * 8
    assert g["update_tokens_per_step"] == 4 * (16 + 8) and g["update_tokens_per_s"] > 0
    assert res["sft"]["mfu"] is None  # no peak is assumed on CPU
    table = proc.stdout.strip().splitlines()[-5:]
    assert table[0].startswith("phase") and table[-1].startswith("GRPO update")


def test_gpu_check_mfu_with_a_peak(tmp_path):
    from atommem_rl.bench.gpu_check import main

    out = tmp_path / "r.json"
    assert main(["--device", "cpu", "--tiny", "--no-vllm", "--peak-tflops", "1.0", "--json-out", str(out)]) == 0
    res = json.loads(out.read_text())
    sft = res["sft"]
    assert sft["mfu"] == pytest.approx(sft["tokens_per_s"] * sft["flops_per_token"] / 1e12)
