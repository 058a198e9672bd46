"""``atommem bench memory-plan``: the traced components add up, the per-layer term is linear, the tracker agrees
with the peak resident memory of a real CPU step, bad input gets a one-line error.

    .venv/bin/python -m pytest tests/test_memory_plan.py -x -q -p no:cacheprovider          # fast ones
    .venv/bin/python -m pytest tests/test_memory_plan.py -x -q -p no:cacheprovider -m slow  # Qwen3-8B plan, SmolLM2 RSS
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from atommem_rl.bench.memory_plan import fit_layers, gib_size, trainer_ranks
from atommem_rl.bench.memory_trace import qwen3_config, trace_step, validate_case

REPO = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
            vocab_size=4096)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}


def _tiny(layers: int):
    return qwen3_config(layers, **TINY)


@pytest.mark.parametrize("kind,batch", [("packed", {"tokens": 512, "completion": 64}),
                                        ("padded", {"rows": 2, "width": 256, "completion": 64}),
                                        ("critic", {"rows": 2, "width": 256})])
def test_components_add_up_and_state_is_sharded(kind, batch):
    world = 4
    out = trace_step(_tiny(2), kind, world=world, **batch)
    comp = out["components"]
    assert comp["total"] == out["peak"] == sum(v for k, v in comp.items() if k != "total")
    assert comp["activations"] > 0 and comp["temporaries"] > 0 and comp["gradients"] > 0
    # AdamW keeps two fp32 moments per sharded fp32 parameter: 8 bytes x parameters / world (+ dim-0 padding)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from torch._subclasses.fake_tensor import FakeTensorMode

    config = _tiny(2)
    with FakeTensorMode():
        cls = AutoModelForSequenceClassification if kind == "critic" else AutoModelForCausalLM
        if kind == "critic":
            config.num_labels, config.pad_token_id = 1, 0
        n = sum(p.numel() for p in cls.from_config(config).parameters())
    assert comp["optimizer_state"] == pytest.approx(8 * n / world, rel=0.02)
    assert out["resident"]["optimizer_state"] == comp["optimizer_state"]
    assert out["resident"]["total"] < comp["total"]


def test_per_layer_term_is_linear():
    traces = {n: trace_step(_tiny(n), "packed", world=2, tokens=512, completion=64) for n in (1, 2, 4)}
    full, error = fit_layers(traces, 3)
    assert error < 0.02
    three = trace_step(_tiny(3), "packed", world=2, tokens=512, completion=64)
    assert full["total"] == pytest.approx(three["peak"], rel=0.02)


def test_larger_budget_costs_more_and_cluster_shape():
    small = trace_step(_tiny(1), "packed", world=2, tokens=256, completion=64)["peak"]
    large = trace_step(_tiny(1), "packed", world=2, tokens=1024, completion=64)["peak"]
    assert large > small
    assert trainer_ranks(8, 1) == 6 and trainer_ranks(8, 3) == 16
    with pytest.raises(ValueError):
        trainer_ranks(2, 1)
    assert gib_size("80GiB") == 80 * 2 ** 30 and gib_size("141G") == 141 * 2 ** 30


def test_no_sync_accumulation_holds_unsharded_gradients():
    """Under the Trainer's default accumulation the micro-steps before a window's last run under FSDP2's no_sync,
    which keeps unsharded gradients in the compute dtype (bf16) until the last backward: the traced gradients
    grow by about 2 bytes per parameter over the sharded fp32 ones (they were left out of the plan before)."""
    from transformers import AutoModelForCausalLM
    from torch._subclasses.fake_tensor import FakeTensorMode

    world = 4
    synced = trace_step(_tiny(2), "packed", world=world, tokens=512, completion=64)
    held = trace_step(_tiny(2), "packed", world=world, tokens=512, completion=64, accumulation="no_sync")
    with FakeTensorMode():
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(_tiny(2)).parameters())
    extra = held["components"]["gradients"] - synced["components"]["gradients"]
    assert extra == pytest.approx(2 * n, rel=0.05)
    assert held["peak"] > synced["peak"] and held["resident"] == synced["resident"]
    with pytest.raises(ValueError, match="accumulation"):
        trace_step(_tiny(1), "packed", world=2, tokens=256, completion=64, accumulation="never")


def test_the_plan_traces_the_accumulation_a_recipe_sets(tmp_path):
    from atommem_rl.bench.memory_plan import _accumulation

    assert _accumulation({"gradient_accumulation_steps": 32}, "recipe") == "no_sync"
    assert _accumulation({"gradient_accumulation_steps": 1}, "recipe") == "sync"
    each = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    assert _accumulation({"gradient_accumulation_steps": 32, "accelerator_config": each}, "recipe") == "sync"
    assert _accumulation({"gradient_accumulation_steps": 32, "accelerator_config": json.dumps(each)}, "recipe") == "sync"
    assert _accumulation({"gradient_accumulation_steps": 32, "accelerator_config": each}, "no_sync") == "no_sync"
    # the Qwen3-8B PPO recipe reduces every backward (its no_sync peak is past the margin); GRPO keeps no_sync
    from atommem_rl.training.recipes import read_yaml

    assert _accumulation(read_yaml(REPO / "recipes/qwen3_8b/ppo.yaml"), "recipe") == "sync"
    assert _accumulation(read_yaml(REPO / "recipes/qwen3_8b/grpo.yaml"), "recipe") == "no_sync"


@pytest.mark.slow  # 77 s with the machine shared (two process starts: the measuring one is spawned fresh)
def test_tracker_agrees_with_rss_on_a_real_small_model(tmp_path):
    # a random-weight Qwen3 whose tensors (fp32 weights, gradients, AdamW moments: ~400 MB) dominate the process
    from atommem_rl.models import tiny_model

    model_dir = tiny_model(tmp_path / "m", arch="qwen3", hidden_size=512, layers=2, heads=8, kv_heads=4,
                           intermediate_size=1024)
    row = validate_case(str(model_dir), "packed", 1, 1, tokens=1024, completion=256)
    assert row["measured"] > 100 * 2 ** 20
    assert abs(row["error"]) < 0.15, row


@pytest.mark.parametrize("argv,message", [
    (["--gpu-memory", "80XB"], "expected a size like 80GiB"),
    (["--recipe", "no/such.yaml"], "recipe not found"),
    (["--layers", "3"], "at least two layer counts"),
])
def test_bad_input_is_one_line(argv, message):
    res = subprocess.run([sys.executable, "-m", "atommem_rl.cli", "bench", "memory-plan", *argv, "--json"],
                         capture_output=True, text=True, cwd=REPO, env=ENV, timeout=300)
    assert res.returncode == 2
    assert message in res.stderr and res.stdout == ""


@pytest.mark.slow
def test_qwen3_8b_grpo_plan_fits_80gib():
    res = subprocess.run([sys.executable, "-m", "atommem_rl.cli", "bench", "memory-plan", "--recipe",
                          "recipes/qwen3_8b/grpo.yaml", "--layers", "1,2", "--no-search", "--rows", "2", "--json"],
                         capture_output=True, text=True, cwd=REPO, env=ENV, timeout=1200)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["trainer_gpus"] == 6 and out["fits"] is True
    comp = out["packed"]["components_gib"]
    assert comp["total"] == pytest.approx(sum(v for k, v in comp.items() if k != "total"), abs=0.01)
    # fp32 master weights, gradients and AdamW moments of ~8.2B parameters over 6 ranks: at least 16 x 8.2e9 / 6
    assert out["packed"]["resident_gib"] > 16 * 8.1e9 / 6 / 2 ** 30
    assert "padded" in out and out["padded"]["peak_gib"] > 0
    # the recipe accumulates 32 micro-steps under no_sync: unsharded bf16 gradients (2 x 8.2e9 bytes) on top
    assert out["accumulation"] == "no_sync"
    assert comp["gradients"] > (2 * 8.1e9 + 4 * 8.1e9 / 6) / 2 ** 30


@pytest.mark.slow
def test_tracker_agrees_with_rss_on_smollm2():
    from atommem_rl.models import BASE_MODEL_DIR

    if not (BASE_MODEL_DIR / "config.json").is_file():
        pytest.skip("no base model (scripts/prepare_base_model.py)")
    row = validate_case(str(BASE_MODEL_DIR), "packed", 1, 1, tokens=4096, completion=1024)
    assert abs(row["error"]) < 0.15, row
