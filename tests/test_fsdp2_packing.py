"""The packed update (max_tokens_per_microbatch) under FSDP2 on 2 gloo CPU ranks, through accelerate's own FSDP2
preparation (recipes/accelerate/fsdp2_cpu.yaml with the rehearsal switch ATOMMEM_REHEARSE_FSDP_ON_CPU=1,
atommem_rl/training/fsdp_cpu.py), against TRL's padded rows under FSDP2 and against the same driver under DDP
(cpu_2proc.yaml); and the refusals of the sharded modes it does not support (DeepSpeed, FSDP1).

tests/fsdp2_ranks.py runs the real trainer on uneven work (rank 1 drops a zero-advantage group: half the step
samples of rank 0) with beta > 0, so the no-gradient old-policy and reference passes run packed too.
Tolerances (fp32): log-probabilities within 1e-4, gradient cosine >= 0.9999 and max difference <= 1e-4 of the
largest gradient entry, as on one process (tests/test_packed_trainer.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import REPO, free_port


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from atommem_rl.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _launch(config: str, tiny: Path, out: Path, mode: str, **env) -> None:
    accelerate = Path(sys.executable).with_name("accelerate")
    res = subprocess.run([str(accelerate), "launch", "--config_file", str(REPO / "recipes/accelerate" / config),
                          "--main_process_port", str(free_port()), str(REPO / "tests/fsdp2_ranks.py"), str(tiny),
                          str(out), str(out / f"run_{mode}"), mode], cwd=REPO, capture_output=True, text=True,
                         timeout=540, env={**os.environ, **env})
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_fsdp2_packed_update_equals_rows_and_ddp_with_equal_collectives(tiny, tmp_path):
    _launch("fsdp2_cpu.yaml", tiny, tmp_path, "fsdp2", ATOMMEM_REHEARSE_FSDP_ON_CPU="1")
    _launch("cpu_2proc.yaml", tiny, tmp_path, "ddp")
    lines = [json.loads(x) for x in (tmp_path / "ranks.jsonl").read_text().splitlines()]
    fsdp = sorted((r for r in lines if r["mode"] == "fsdp2"), key=lambda r: r["rank"])
    assert [r["rank"] for r in fsdp] == [0, 1]
    assert fsdp[0]["samples"] > fsdp[1]["samples"] and fsdp[0]["planned"] > fsdp[1]["planned"]  # uneven work
    assert fsdp[0]["per_step"] == fsdp[1]["per_step"] and sum(fsdp[0]["per_step"]) >= fsdp[0]["planned"]
    for name in ("old", "ref", "rows", "packed"):  # every collective-bearing forward/backward paired across ranks
        assert fsdp[0][name] == fsdp[1][name], name
        assert fsdp[0][name]["all_gathers"] > 0, name  # FSDP2 really gathered
    assert fsdp[0]["old"]["forwards"] == fsdp[0]["ref"]["forwards"] >= fsdp[0]["planned"] > fsdp[1]["planned"]
    assert fsdp[0]["packed"]["forwards"] == sum(fsdp[0]["per_step"])
    for name in ("rows", "packed"):  # gradients reduced once per optimizer step: one reduce-scatter per group
        assert fsdp[0][name]["reduce_scatters"] == fsdp[0]["fsdp_groups"] > 0, name
    # accelerate's sync_each_batch (the Qwen3-8B PPO recipe): every packed backward reduces, no unsharded
    # gradients held between them, the same number of times on both ranks and the same gradients
    assert fsdp[0]["each_batch"] == fsdp[1]["each_batch"]
    assert fsdp[0]["each_batch"]["reduce_scatters"] == sum(fsdp[0]["per_step"]) * fsdp[0]["fsdp_groups"]
    for r in fsdp:
        assert r["old_logp_diff"] <= 1e-4 and r["ref_logp_diff"] <= 1e-4
        assert r["grad_max"] > 0 and r["cosine"] >= 0.9999 and r["max_diff"] <= 1e-4 * max(r["grad_max"], 1.0)
        assert r["packed_loss"] == pytest.approx(r["row_loss"], rel=1e-5, abs=1e-6)
        assert r["each_batch_diff"] <= 1e-5 * max(r["grad_max"], 1.0)
    assert fsdp[0]["grad_sum"] == pytest.approx(fsdp[1]["grad_sum"], rel=1e-6)  # reduced: the same on both

    # FSDP2 against DDP: the same rollouts (and reference log-probabilities), the same update
    for rank in (0, 1):
        a, b = (torch.load(tmp_path / f"{m}_batch{rank}.pt") for m in ("fsdp2", "ddp"))
        for k in ("prompt_ids", "completion_ids", "completion_mask", "advantages"):
            assert torch.equal(a[k], b[k]), k
        assert (a["ref_per_token_logps"] - b["ref_per_token_logps"]).abs().max().item() <= 1e-4
    g_fsdp, g_ddp = (torch.load(tmp_path / f"{m}_grads.pt") for m in ("fsdp2", "ddp"))
    for path in ("rows", "packed"):
        ref = g_ddp["rows"]
        cos = torch.nn.functional.cosine_similarity(g_fsdp[path], ref, dim=0).item()
        assert cos >= 0.9999 and (g_fsdp[path] - ref).abs().max().item() <= 1e-4 * ref.abs().max().item(), path


def test_sharded_modes_the_packed_update_refuses():
    from accelerate.utils import DistributedType

    from atommem_rl.training.packing import sharding_refusal

    for ok in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        assert sharding_refusal(ok, fsdp2=False) is None
    assert sharding_refusal(DistributedType.FSDP, fsdp2=True) is None
    assert "DeepSpeed" in sharding_refusal(DistributedType.DEEPSPEED, fsdp2=False)
    assert "FSDP2" in sharding_refusal(DistributedType.FSDP, fsdp2=False)


def test_zero3_refuses_packing_on_the_built_trainer(tiny, tmp_path, monkeypatch):
    """DeepSpeed cannot run here: the trainer's own check, on a real trainer whose accelerator reports DeepSpeed
    (accelerate's state set as a ZeRO-3 launch sets it), refuses the packed update with one clear line."""
    from accelerate.utils import DistributedType

    from atommem_rl.training.grpo import build_trainer, refuse_unsupported_packing

    from .test_grpo import small_config

    trainer = build_trainer(small_config(tiny, tmp_path / "t"))
    refuse_unsupported_packing(trainer)  # packing off: nothing to refuse
    trainer.args.max_tokens_per_microbatch = 4096
    refuse_unsupported_packing(trainer)  # one process: supported
    monkeypatch.setattr(trainer.accelerator.state, "distributed_type", DistributedType.DEEPSPEED)
    with pytest.raises(ValueError, match="not supported under DeepSpeed.*fsdp2.yaml") as err:
        refuse_unsupported_packing(trainer)
    assert "\n" not in str(err.value)


def test_rehearsal_switch_is_off_unless_asked(monkeypatch):
    from atommem_rl.training import fsdp_cpu

    monkeypatch.delenv(fsdp_cpu.ENV, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert not fsdp_cpu.requested() and not fsdp_cpu.install()
    monkeypatch.setenv(fsdp_cpu.ENV, "1")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")  # a DDP launch: nothing to rehearse
    assert not fsdp_cpu.requested()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_fsdp2_packed_training_matches_one_process_resumes_and_runs_bf16(tmp_path):
    """``atommem grpo`` through the Trainer's own loop under FSDP2 (2 gloo ranks, packed update, uneven tasks of
    1 and 3 documents, scripted returns: tests/multirank/scripted_returns.py): its first step equals one process
    on the same global batch (weights within 1e-5; Adam's first step moves them by lr = 1e-3), every rank counts
    the same forwards and backwards through the policy, no completion mismatches its prompt; the FSDP2
    checkpoint of step 1 reloads and resumes to step 2 exactly as the uninterrupted run (weights equal within
    1e-6, optimizer state included)."""
    from safetensors.torch import load_file

    from atommem_rl.models import tiny_model

    from .multirank.scripted_returns import write_uneven_tasks

    model = tiny_model(tmp_path / "qwen3", arch="qwen3", hidden_size=32, heads=2, kv_heads=1, intermediate_size=64)
    tasks = tmp_path / "tasks.jsonl"
    write_uneven_tasks(str(tasks), 4)
    driver = str(REPO / "tests/multirank/scripted_returns.py")
    args = ["grpo", "--model_name_or_path", str(model), "--tasks", str(tasks), "--use_cpu", "true", "--bf16", "false",
            "--report_to", "none", "--gradient_checkpointing", "false", "--learning_rate", "1e-3", "--logging_steps",
            "1", "--seed", "0", "--num_generations", "2", "--max_completion_length", "16", "--save_steps", "1",
            "--max_tokens_per_microbatch", "1500", "--env_config",
            json.dumps({"chunk_tokens": 64, "max_prompt_tokens": 2048, "max_answer_steps": 1, "format_penalty": 0.5})]
    accelerate = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
                  str(REPO / "recipes/accelerate/fsdp2_cpu.yaml")]

    def run(cmd, name, **env):
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "ATOMMEM_SCRIPTED_LOG": str(tmp_path / f"{name}.jsonl"),
                                  **env})
        assert res.returncode == 0, res.stderr[-4000:]
        return [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]

    fsdp = dict(ATOMMEM_REHEARSE_FSDP_ON_CPU="1")
    two = run([*accelerate, "--main_process_port", str(free_port()), driver, *args, "--per_device_train_batch_size", "2",
               "--max_steps", "2", "--output_dir", str(tmp_path / "fsdp2")], "fsdp2", ATOMMEM_COUNT_PASSES="1", **fsdp)
    run([sys.executable, driver, *args, "--per_device_train_batch_size", "4", "--max_steps", "1",
         "--output_dir", str(tmp_path / "single")], "single")
    (tmp_path / "resume").mkdir()
    import shutil

    shutil.copytree(tmp_path / "fsdp2" / "checkpoint-1", tmp_path / "resume" / "checkpoint-1")
    run([*accelerate, "--main_process_port", str(free_port()), driver, *args, "--per_device_train_batch_size", "2",
         "--max_steps", "2", "--resume_from_checkpoint", "true", "--output_dir", str(tmp_path / "resume")], "resume", **fsdp)

    assert (tmp_path / "fsdp2" / "checkpoint-1" / "pytorch_model_fsdp.bin").exists()  # FSDP really saved it
    batches = [r for r in two if "episodes" in r and r["episodes"]]
    assert sum(r["mismatched"] for r in batches) == 0
    steps = {rank: sum(e["steps"] for r in batches if r["rank"] == rank for e in r["episodes"]) for rank in (0, 1)}
    assert steps[0] != steps[1], steps  # uneven work
    passes = {r["rank"]: r["passes"] for r in two if "passes" in r}
    assert passes[0] == passes[1] and passes[0]["policy"]["backward"] > 0, passes

    w0 = load_file(model / "model.safetensors")
    step1, single = load_file(tmp_path / "fsdp2/checkpoint-1/model.safetensors"), load_file(tmp_path / "single/model.safetensors")
    assert max((single[k] - w0[k]).abs().max().item() for k in single) > 1e-4  # the update moved the policy
    assert max((step1[k] - single[k]).abs().max().item() for k in single) <= 1e-5
    done, resumed = load_file(tmp_path / "fsdp2/model.safetensors"), load_file(tmp_path / "resume/model.safetensors")
    assert done.keys() == resumed.keys()
    assert max((done[k] - resumed[k]).abs().max().item() for k in done) <= 1e-6
    summary = json.loads((tmp_path / "resume" / "grpo_summary.json").read_text())
    assert summary["global_step"] == 2 and summary["resume_checkpoint"].endswith("checkpoint-1")

    # the Qwen3-8B recipes' settings: bf16 mixed precision (FSDP2's MixedPrecisionPolicy: the fused head returns
    # bf16 log-probabilities) and gradient checkpointing; step 1 as fp32's within bf16 rounding (measured:
    # grad norm 0.1161 against 0.1164)
    bf16 = [*accelerate, "--mixed_precision", "bf16"]
    run([*bf16, "--main_process_port", str(free_port()), driver, *args, "--per_device_train_batch_size", "2",
         "--max_steps", "1", "--bf16", "true", "--gradient_checkpointing", "true",
         "--output_dir", str(tmp_path / "bf16")], "bf16", **fsdp)

    def step1(run_dir):
        state = json.loads((run_dir / "checkpoint-1" / "trainer_state.json").read_text())
        return next(h for h in state["log_history"] if "loss" in h)

    h32, h16 = step1(tmp_path / "fsdp2"), step1(tmp_path / "bf16")
    assert h16["loss"] == pytest.approx(h32["loss"], rel=2e-2, abs=1e-4)
    assert h16["grad_norm"] == pytest.approx(h32["grad_norm"], rel=2e-2)
