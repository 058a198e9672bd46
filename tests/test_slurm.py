"""The sbatch scripts: print-only layouts (plain bash, no cluster) and a real CPU smoke job on Slurm.

The smoke test needs a running single-node cluster (``bash scripts/start_slurm.sh`` as root); it
submits slurm/sft.sbatch with ATOMMEM_SMOKE=1, waits for the job and checks the checkpoint and the log
under the run folder.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import REPO, require


def dry_run(script: str, *args: str, **env: str) -> list[list[str]]:
    """The commands a script prints in print-only mode, each split into words as the shell would."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full_env.update({"ATOMMEM_DRY_RUN": "1", "ATOMMEM_REPO": str(REPO), **env})
    out = subprocess.run(["bash", str(REPO / "slurm" / script), *args], cwd=REPO, env=full_env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [shlex.split(line[2:]) for line in out.stdout.splitlines() if line.startswith("+ ")]


def flag(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


@pytest.fixture
def grpo_recipe(tmp_path) -> Path:
    p = tmp_path / "grpo.yaml"
    p.write_text("run_name: big-run\nmodel_name_or_path: Qwen/Qwen3-8B\nlearning_rate: 1.0e-6\n")
    return p


def test_grpo_five_nodes_print_only(grpo_recipe):
    cmds = dry_run("grpo.sbatch", str(grpo_recipe), "--learning_rate", "2e-6",
                   SLURM_JOB_NUM_NODES="5", SLURM_JOB_NODELIST="gpu[07-11]", SLURM_JOB_ID="4242",
                   SLURM_GPUS_ON_NODE="8")
    assert len(cmds) == 2
    serve, train = cmds
    # node 0 serves vLLM with tensor parallel 8
    assert serve[:4] == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=gpu07"]
    assert "vllm" in serve and serve[serve.index("vllm") + 1:serve.index("vllm") + 3] == ["serve", "Qwen/Qwen3-8B"]
    assert flag(serve, "--tensor-parallel-size") == "8" and flag(serve, "--port") == "8000"
    # the 4 other nodes train: one srun task per node, accelerate ranks from $SLURM_PROCID
    assert train[:5] == ["srun", "--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "--nodelist=gpu08,gpu09,gpu10,gpu11"]
    assert train[5:7] == ["bash", "-c"]
    inner = shlex.split(train[7])
    assert inner[:2] == ["accelerate", "launch"]
    assert flag(inner, "--num_machines") == "4" and flag(inner, "--num_processes") == "32"
    assert flag(inner, "--machine_rank") == "$SLURM_PROCID"  # expanded by each task's own shell
    assert flag(inner, "--main_process_ip") == "gpu08"  # the first training node
    assert flag(inner, "--rdzv_backend") == "c10d"
    assert flag(inner, "--config_file") == "recipes/accelerate/zero3.yaml"
    i = inner.index("-m")
    assert inner[i + 1:i + 3] == ["atommem_rl.cli", "grpo"] and flag(inner, "--config") == str(grpo_recipe)
    assert flag(inner, "--vllm_mode") == "server" and flag(inner, "--vllm_server_host") == "gpu07"
    assert inner[-2:] == ["--learning_rate", "2e-6"]  # overrides come last and win


def test_grpo_one_node_print_only(grpo_recipe):
    serve, train = dry_run("grpo.sbatch", str(grpo_recipe), SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="gpu01",
                           SLURM_JOB_ID="7", SLURM_GPUS_ON_NODE="8")
    assert serve[:2] == ["env", "CUDA_VISIBLE_DEVICES=0,1"] and flag(serve, "--tensor-parallel-size") == "2"
    assert train[:2] == ["env", "CUDA_VISIBLE_DEVICES=2,3,4,5,6,7"]
    assert flag(train, "--num_processes") == "6" and flag(train, "--vllm_server_host") == "127.0.0.1"


def test_sft_and_eval_print_only(tmp_path):
    (cmd,) = dry_run("sft.sbatch", "recipes/qwen3_8b/sft.yaml", "--num_train_epochs", "1", SLURM_JOB_ID="9")
    assert cmd[:2] == ["accelerate", "launch"] and flag(cmd, "--config_file") == "recipes/accelerate/zero3.yaml"
    assert flag(cmd, "--num_processes") == "8" and cmd[cmd.index("-m") + 1:cmd.index("-m") + 3] == ["atommem_rl.cli", "sft"]
    assert flag(cmd, "--config") == "recipes/qwen3_8b/sft.yaml" and cmd[-2:] == ["--num_train_epochs", "1"]
    serve, ev = dry_run("eval.sbatch", "--tasks", "t.jsonl", "--methods", "ours,rag", "--model", "m", "--out",
                        str(tmp_path / "ev"), SLURM_JOB_ID="10")
    assert serve[:3] == ["vllm", "serve", "m"] and ev[-2:] == ["--backend", "openai"]
    (smoke,) = dry_run("sft.sbatch", ATOMMEM_SMOKE="1", SLURM_JOB_ID="11")
    assert smoke[1:4] == ["-m", "atommem_rl.cli", "sft"] and flag(smoke, "--config") == "recipes/quickstart/sft.yaml"
    assert flag(smoke, "--use_cpu") == "true" and flag(smoke, "--max_steps") == "2"


def _slurm_up() -> bool:
    if not shutil.which("sbatch") or not shutil.which("sinfo"):
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    return out.returncode == 0 and bool(re.search(r"idle|mixed|alloc", out.stdout))


def submit_smoke(script: str, recipe: str, out_dir: Path, timeout: float = 1200) -> tuple[str, Path]:
    """Submit ``slurm/<script>`` in CPU smoke mode, wait for it; (job id, its log under the run folder)."""
    require(_slurm_up(), "no running Slurm cluster (start one with: sudo bash scripts/start_slurm.sh)")
    sub = subprocess.run(
        ["sbatch", "--parsable", "--gpus-per-node=0", f"--chdir={REPO}",
         f"--export=ALL,ATOMMEM_SMOKE=1,ATOMMEM_REPO={REPO}",
         str(REPO / "slurm" / script), recipe, "--output_dir", str(out_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    deadline = time.time() + timeout
    state = ""
    while time.time() < deadline:
        info = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
        state = (re.search(r"JobState=(\w+)", info) or [None, ""])[1]
        if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            break
        time.sleep(3)
    else:
        subprocess.run(["scancel", job])
        pytest.fail(f"job {job} did not finish within {timeout} s (state {state})")
    phase = script.split(".")[0]
    log = out_dir.parent / "logs" / f"{phase}-{job}.log"
    assert log.exists(), f"no log under the run folder; slurm output: checkpoints/slurm-atommem-{phase}-{job}.out"
    assert state == "COMPLETED", log.read_text()[-3000:]
    return job, log


@pytest.mark.slurm
def test_sft_smoke_job_on_real_slurm(tmp_path):
    out_dir = tmp_path / "slurm-run" / "sft"
    _, log = submit_smoke("sft.sbatch", "recipes/quickstart/sft.yaml", out_dir)
    ckpts = sorted(out_dir.glob("checkpoint-*"))
    assert ckpts and (ckpts[-1] / "model.safetensors").exists() and (ckpts[-1] / "trainer_state.json").exists()
    assert (out_dir / "config.json").exists() and '"global_step": 2' in log.read_text()


@pytest.mark.slurm
def test_grpo_smoke_job_on_real_slurm(tmp_path):
    """slurm/grpo.sbatch in CPU smoke mode: 2 gloo processes under accelerate, a checkpoint written."""
    out_dir = tmp_path / "slurm-run" / "grpo"
    submit_smoke("grpo.sbatch", "recipes/quickstart/grpo.yaml", out_dir)
    ckpts = sorted(out_dir.glob("checkpoint-*"))
    assert ckpts and (ckpts[-1] / "model.safetensors").exists() and (ckpts[-1] / "trainer_state.json").exists()
