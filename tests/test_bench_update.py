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
    assert out["max_logprob_diff"] <= 1e-4 and 0.9999 <= out["grad_cosine"] <= 1 + 1e-9  # above 1 is an arithmetic error
    assert out["dtype"] == "float32" and set(out["variants"]) == {"baseline", "packed_all", "packed"}
    assert all(len(v["runs_s"]) == 1 for v in out["variants"].values())
    # after one Adam step the two fp32 updates leave the weights a bf16 engine serves (nearly) the same
    assert 0 < out["served_bf16_moved"] <= out["weights"] and out["adam_update_max_diff_lr"] < 0.5
    assert out["adam_served_bf16_differ"] <= 1e-4 * out["weights"]


def test_adam_first_step_figures():
    """Adam's first step moves each weight by about lr in its gradient's sign: two gradients that agree in
    sign leave the same weights except where a gradient is near Adam's eps; a flipped sign is 2 lr apart
    and shows in the served bf16 weights when lr is large against their spacing."""
    import torch

    from atommem_rl.bench.update import adam_first_step_figures

    w = torch.tensor([1.0, 1.0, 1.0, 1.0])
    same = adam_first_step_figures(w, torch.tensor([1.0, -2.0, 3e-3, 0.0], dtype=torch.float64),
                                   torch.tensor([2.0, -1.0, 3e-3, 0.0], dtype=torch.float64), lr=0.1)
    assert same["adam_update_max_diff_lr"] < 1e-5 and same["adam_update_differ_share"] == 0
    assert same["adam_served_bf16_differ"] == 0 and same["served_bf16_moved"] == 3  # the zero gradient stays
    flipped = adam_first_step_figures(w, torch.tensor([1.0, -2.0, 1e-9, 0.0], dtype=torch.float64),
                                      torch.tensor([-1.0, -2.0, 3e-9, 0.0], dtype=torch.float64), lr=0.1, prefix="x")
    assert abs(flipped["x_update_max_diff_lr"] - 2.0) < 1e-5  # entry 0: -lr against +lr
    assert flipped["x_update_differ_share"] == 0.5  # entries 0 and 2 (near eps the update scales with g)
    assert flipped["x_served_bf16_differ"] == 2


def test_bench_update_bad_input(capsys):
    assert atommem(["bench", "update", "--tiny", "--variants", "packed"]) == 2
    assert "--variants takes baseline" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # refused by argparse, before any model is built
        atommem(["bench", "update", "--tiny", "--repeats", "0"])
    assert info.value.code == 2 and "--repeats: expected a positive integer" in capsys.readouterr().err


def test_bench_update_reuses_its_saved_samples(tmp_path, capsys):
    """``--samples``: the first run rolls out and writes the step samples; the second times the very same
    samples without rolling out; a run with other rollout flags is refused instead of reusing them."""
    path = tmp_path / "samples.json"
    args = ["bench", "update", "--tiny", "--episodes", "2", "--docs", "1", "--max-new-tokens", "8", "--repeats", "1",
            "--variants", "baseline,packed", "--samples", str(path), "--json"]
    assert atommem(args) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    saved = json.loads(path.read_text())
    assert first["rollout_s"] > 0 and len(saved["samples"]) == first["samples"]
    assert atommem(args) == 0
    second = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert second["rollout_s"] == 0
    for key in ("samples", "raw_tokens", "forwarded_tokens", "episode_steps", "returns", "advantages"):
        assert second[key] == first[key], key
    assert atommem([a if a != "8" else "9" for a in args]) == 2
    assert "written with other settings" in capsys.readouterr().err


def test_bench_update_reports_bf16_against_fp32(capsys):
    """With ``packed_bf16``: how far the bf16 update is from the fp32 one (log-probabilities, gradient cosine,
    norm ratio, sign agreement), for the packed path and for TRL's rows under the same autocast."""
    from atommem_rl.precision import cpu_bf16_supported

    if not cpu_bf16_supported():
        pytest.skip("this CPU has no native bf16")
    rc = atommem(["bench", "update", "--tiny", "--episodes", "2", "--docs", "1", "--max-new-tokens", "8",
                  "--repeats", "1", "--variants", "baseline,packed_bf16", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["dtype"] == "bfloat16"
    for key in ("bf16_grad_cosine", "bf16_rows_grad_cosine", "bf16_packed_vs_rows_grad_cosine"):
        assert -1 - 1e-9 <= out[key] <= 1 + 1e-9, key
    # bf16 rounds: close to fp32 but not equal (a tiny random model still points the same way)
    assert 0 < out["bf16_max_logprob_diff"] < 1 and out["bf16_grad_cosine"] > 0.5
    assert 0.5 < out["bf16_sign_agreement"] <= 1 and out["bf16_grad_norm_ratio"] > 0


def test_auto_bf16_false_needs_bf16_false_for_fp32():
    """TRL's configs turn bf16 on when neither bf16 nor fp16 is given, so ``auto_bf16: false`` alone is not fp32
    (a learning-signal run meant as fp32 trained in bf16); scripts/learning_signal.sh passes bf16=false with it."""
    from pathlib import Path

    from atommem_rl.training.grpo import GRPORecipeConfig
    from atommem_rl.training.recipes import load_recipe

    recipe = "recipes/quickstart_learning/grpo.yaml"
    assert load_recipe(GRPORecipeConfig, recipe, ["--auto_bf16", "false", "--output_dir", "/tmp/x"]).bf16 is True
    assert load_recipe(GRPORecipeConfig, recipe, ["--auto_bf16", "false", "--bf16", "false",
                                                  "--output_dir", "/tmp/x"]).bf16 is False
    script = (Path(__file__).resolve().parents[1] / "scripts" / "learning_signal.sh").read_text()
    import re

    assert len(re.findall(r"auto_bf16=\S+ bf16=false", script)) == script.count("auto_bf16=") == 2  # SFT and GRPO


def test_bench_update_times_the_scoring_pass(capsys):
    """``--scoring``: the no-gradient pass (reference / old-policy log-probabilities) over padded rows and
    packed, the same values in fp32, both timed in the alternating rounds."""
    rc = atommem(["bench", "update", "--tiny", "--episodes", "2", "--docs", "1", "--max-new-tokens", "8",
                  "--repeats", "2", "--variants", "baseline,packed", "--scoring", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["score_max_logprob_diff"] <= 1e-4
    assert {"score_rows", "score_packed"} <= set(out["scoring"])
    assert all(len(v["runs_s"]) == 2 for v in out["scoring"].values())
    assert out["score_rows_s"] > 0 and out["score_packed_s"] > 0 and out["score_speedup"] > 0
    assert set(out["variants"]) == {"baseline", "packed"}  # the update's figures are unchanged


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_update_sharded_side(capsys):
    """``--ranks 2``: rows against packed under FSDP2 on 2 gloo ranks holding different numbers of samples
    (episodes dealt by rank): the same forwards on both ranks, the reduced gradients of the two paths equal."""
    rc = atommem(["bench", "update", "--tiny", "--episodes", "3", "--docs", "1", "--max-new-tokens", "8",
                  "--repeats", "1", "--ranks", "2", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ranks"] == 2 and out["mode"] == "fsdp2"
    assert out["samples_per_rank"][0] > out["samples_per_rank"][1] > 0  # episodes 0 and 2 against episode 1
    for path in ("rows", "packed"):  # every forward gathers parameters: as many on each rank
        assert len(set(out["forwards_per_rank"][path])) == 1, out["forwards_per_rank"]
    assert out["forwards_per_rank"]["packed"][0] == out["microbatches_run"] == max(out["microbatches_per_rank"])
    assert out["forwarded_tokens"] < out["raw_tokens"]  # prefixes shared within each rank's group
    assert out["max_logprob_diff"] <= 1e-4 and 0.9999 <= out["grad_cosine"] <= 1 + 1e-9
    assert out["rows_s"] > 0 and out["packed_s"] > 0 and out["speedup"] == round(out["rows_s"] / out["packed_s"], 2)


def test_bench_update_sharded_side_refuses_what_it_does_not_run(capsys):
    assert atommem(["bench", "update", "--tiny", "--ranks", "3", "--episodes", "2"]) == 2
    assert "needs at least N --episodes" in capsys.readouterr().err
    assert atommem(["bench", "update", "--tiny", "--ranks", "2", "--scoring"]) == 2
