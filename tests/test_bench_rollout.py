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


def _counted_flops(cfg, batch: int, seq: int) -> dict[str, int]:
    """torch's FLOP counter over one forward + backward of a random-weight model (eager attention, so the
    attention products are counted: as bmm, over the full S x S square)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    x = torch.randint(0, cfg.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=x, labels=x).loss.backward()
    return {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}


def test_flops_per_token_agree_with_torchs_flop_counter():
    """The MFU numerator, measured independently: torch counts every matrix multiply of a training step.
    The linear layers (LM head included) must be exactly 6 N per token; eager attention computes the full
    square, twice the causal share the formula counts."""
    from transformers import Qwen3Config

    from atommem_rl.bench.gpu_check import SHAPES, matmul_params, train_flops_per_token

    cfg = Qwen3Config(**{**SHAPES["tiny"], "tie_word_embeddings": False})
    batch, seq = 2, 64
    counted = _counted_flops(cfg, batch, seq)
    assert counted["aten.mm"] == 6 * matmul_params(cfg) * batch * seq
    causal_attention = counted["aten.bmm"] // 2
    assert train_flops_per_token(cfg, seq) * batch * seq == counted["aten.mm"] + causal_attention


def test_gpu_check_mfu_uses_the_counted_flops(tmp_path):
    """With a peak given, the reported MFU is achieved FLOP/s over the peak, where the FLOPs per token are
    the ones torch's counter measures for the same shape and sequence length."""
    from transformers import Qwen3Config

    from atommem_rl.bench.gpu_check import SHAPES, main

    out = tmp_path / "r.json"
    assert main(["--device", "cpu", "--tiny", "--no-vllm", "--peak-tflops", "1.0", "--json-out", str(out)]) == 0
    sft = json.loads(out.read_text())["sft"]
    seq = sft["tokens_per_step"] // 2  # --tiny: 2 rows per step
    counted = _counted_flops(Qwen3Config(**SHAPES["tiny"]), 1, seq)
    per_token = (counted["aten.mm"] + counted["aten.bmm"] // 2) / seq
    assert sft["flops_per_token"] == pytest.approx(per_token, rel=1e-6)
    assert 0 < sft["mfu"] == pytest.approx(sft["tokens_per_s"] * per_token / 1e12, rel=1e-6)


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


