"""The sbatch scripts: print-only layouts (plain bash, no cluster) and a real CPU smoke job on Slurm.

The smoke test needs a running single-node cluster (``bash scripts/start_slurm.sh`` as root); it
submits slurm/sft.sbatch with ATOMMEM_SMOKE=1, waits for the job and checks the checkpoint and the log
under the run folder.
"""

from __future__ import annotations

import json
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
    assert train[train.index("bash") + 1] == "-c"
    inner = shlex.split(train[train.index("-c") + 1])
    a = inner.index("accelerate")
    assert inner[:a] == ["env", f"VLLM_HOST_IP={inner[0 + 1].split('=', 1)[1]}"] and inner[a + 1] == "launch"
    assert flag(inner, "--num_machines") == "4" and flag(inner, "--num_processes") == "32"
    assert flag(inner, "--machine_rank") == "$SLURM_PROCID"  # expanded by each task's own shell
    assert flag(inner, "--main_process_ip") == "gpu08"  # the first training node
    assert flag(inner, "--rdzv_backend") == "c10d"
    assert flag(inner, "--config_file") == "recipes/accelerate/fsdp2.yaml"  # the packed update runs under FSDP2
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
    assert serve[:3] == ["vllm", "serve", "m"] and ev[-4:-2] == ["--backend", "openai"]
    assert ev[-2:] == ["--base-url", "http://127.0.0.1:8000/v1"]
    (smoke,) = dry_run("sft.sbatch", ATOMMEM_SMOKE="1", SLURM_JOB_ID="11")
    assert smoke[1:4] == ["-m", "atommem_rl.cli", "sft"] and flag(smoke, "--config") == "recipes/quickstart/sft.yaml"
    assert flag(smoke, "--use_cpu") == "true" and flag(smoke, "--max_steps") == "2"


# ------------------------------------------------------------------ every printed command parses (issue 17)
QWEN_GRPO, QWEN_PPO = "recipes/qwen3_8b/grpo.yaml", "recipes/qwen3_8b/ppo.yaml"
# overrides with a JSON value (spaces, quotes, braces): they must survive srun's `bash -c` word for word
OVERRIDES = ["--learning_rate", "2e-6", "--max_completion_length", "1024",
             "--env_config", '{"chunk_tokens": 4096, "max_prompt_tokens": 12288, "embedder": "minilm"}']


def dry_run_out(script: str, *args: str, **env: str) -> str:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full_env.pop("ATOMMEM_STAGE", None)
    full_env.update({"ATOMMEM_DRY_RUN": "1", "ATOMMEM_REPO": str(REPO), **env})
    out = subprocess.run(["bash", str(REPO / "slurm" / script), *args], cwd=REPO, env=full_env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def commands(stdout: str) -> list[list[str]]:
    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ ")]


def config_class_for(stage: str) -> type:
    if stage == "ppo":
        from atommem_rl.training.ppo import PPORecipeConfig
        return PPORecipeConfig
    if stage == "grpo":
        from atommem_rl.training.grpo import GRPORecipeConfig
        return GRPORecipeConfig
    from atommem_rl.training.sft import SFTRecipeConfig
    return SFTRecipeConfig


def parse_training(words: list[str]) -> tuple[str, object]:
    """(subcommand, parsed config) of a printed ``... -m atommem_rl.cli STAGE ARGS``: ARGS through the
    project's own recipe parser with the stage's config class. Parsing reads the recipe YAML only (the model
    and the tasks file need not exist); ``--use_cpu true`` is appended because TrainingArguments refuses bf16
    on a machine without a GPU, which is a property of this machine, not of the command."""
    from atommem_rl.training.recipes import parse_recipe_args

    i = words.index("-m")
    assert words[i + 1] == "atommem_rl.cli", words
    stage, argv = words[i + 2], words[i + 3:]
    return stage, parse_recipe_args(config_class_for(stage), [*argv, "--use_cpu", "true"], apply_env=False)


def no_empty_words(cmds: list[list[str]]) -> None:
    for c in cmds:
        assert "" not in c, c
        if c[:1] == ["srun"] and "-c" in c:
            assert "" not in shlex.split(c[c.index("-c") + 1]), c


def vllm_serve_words(cmd: list[str]) -> list[str]:
    i = cmd.index("vllm")
    assert cmd[i + 1] == "serve", cmd
    return cmd[i:]


@pytest.mark.parametrize("nodes", [1, 3])
@pytest.mark.parametrize("with_overrides", [False, True], ids=["no-overrides", "overrides"])
@pytest.mark.parametrize("recipe,stage", [(QWEN_GRPO, "grpo"), (QWEN_PPO, "ppo")], ids=["grpo", "ppo"])
def test_grpo_sbatch_dry_run_commands_parse(recipe, stage, with_overrides, nodes):
    """Defects 4 and 3(d): the printed training command has the recipe's stage as its subcommand and its
    arguments parse with that stage's config class; no empty word; vLLM gets --max-model-len and TRL's
    logprob flags; srun steps name --cpus-per-task; multi-node sets VLLM_HOST_IP."""
    overrides = OVERRIDES if with_overrides else []
    env = dict(SLURM_JOB_NUM_NODES=str(nodes), SLURM_JOB_ID="4243", SLURM_GPUS_ON_NODE="8", SLURM_CPUS_ON_NODE="96",
               SLURM_JOB_NODELIST="gpu01" if nodes == 1 else "gpu[07-09]")
    if nodes > 1:
        env["SLURM_JOB_CPUS_PER_NODE"] = "96(x2),64"  # the smallest node bounds one task per node
    out = dry_run_out("grpo.sbatch", recipe, *overrides, **env)
    cmds = commands(out)
    assert len(cmds) == 2, out
    no_empty_words(cmds)
    serve, train = cmds
    assert re.search(rf"^stage: {stage} \(.+\)$", out, re.M), out  # which stage and why
    if nodes > 1:
        assert train[0] == "srun" and serve[0] == "srun"
        for c in (serve, train):
            assert "--cpus-per-task=64" in c[:c.index("bash") if "bash" in c else len(c)], c
        assert "VLLM_HOST_IP=gpu07" in serve or any(w.startswith("VLLM_HOST_IP=") for w in serve), serve
        inner = shlex.split(train[train.index("-c") + 1])
        assert any(w.startswith("VLLM_HOST_IP=") for w in inner), inner
    else:
        inner = train
    accel = "recipes/accelerate/fsdp2.yaml"  # GRPO and PPO alike
    assert flag(inner, "--config_file") == accel
    sub, config = parse_training(inner)
    assert sub == stage
    assert type(config).__name__ == ("PPORecipeConfig" if stage == "ppo" else "GRPORecipeConfig")
    assert config.use_vllm and config.vllm_mode == "server"
    assert config.vllm_server_host == ("gpu07" if nodes > 1 else "127.0.0.1")
    if with_overrides:
        assert config.learning_rate == 2e-6 and config.max_completion_length == 1024
        assert config.env_config == {"chunk_tokens": 4096, "max_prompt_tokens": 12288, "embedder": "minilm"}
    v = vllm_serve_words(serve)
    assert v[2] == "checkpoints/qwen3_8b/sft"
    # the env's max_prompt_tokens counts the rendered prompt with its generation prompt; plus one step's completion
    assert flag(v, "--max-model-len") == ("13312" if with_overrides else "18432")
    assert flag(v, "--logprobs-mode") == "processed_logprobs" and flag(v, "--max-logprobs") == "-1"
    assert json.loads(flag(v, "--weight-transfer-config")) == {"backend": "nccl"}
    assert flag(v, "--tensor-parallel-size") == ("8" if nodes > 1 else "2")
    assert flag(v, "--port") == str(config.vllm_server_port)


def test_vllm_max_model_length_wins(tmp_path):
    """``vllm_max_model_length`` set in the recipe (or as an override) is what vLLM gets."""
    out = dry_run_out("grpo.sbatch", QWEN_GRPO, "--vllm_max_model_length", "20000", SLURM_JOB_ID="5")
    (serve, train) = commands(out)
    assert flag(vllm_serve_words(serve), "--max-model-len") == "20000"
    assert parse_training(train)[1].vllm_max_model_length == 20000


def test_stage_rule_and_override(tmp_path):
    """Defect 3(d): PPO is a recipe setting a field PPORecipeConfig has and GRPORecipeConfig lacks (computed from
    the dataclasses); ATOMMEM_STAGE forces a stage; anything else is refused."""
    import dataclasses

    from atommem_rl.training import launch
    from atommem_rl.training.grpo import GRPORecipeConfig
    from atommem_rl.training.ppo import PPORecipeConfig

    only = {f.name for f in dataclasses.fields(PPORecipeConfig)} - {f.name for f in dataclasses.fields(GRPORecipeConfig)}
    assert launch.ppo_only_fields() == only and {"gamma", "lam", "critic_epochs"} <= only
    assert "num_generations" not in only  # PPO re-declares it with another default: not PPO-only
    plain = tmp_path / "ppo.yaml"  # named ppo but sets no PPO-only field: GRPO by the rule
    plain.write_text("run_name: r\nmodel_name_or_path: m\nnum_generations: 2\n")
    assert launch.stage(str(plain))[0] == "grpo"
    assert launch.stage(str(plain), ["--critic_epochs", "2"])[0] == "ppo"  # an override counts too
    assert launch.stage(str(plain), ["--gamma=0.99"])[0] == "ppo"
    assert launch.stage(QWEN_PPO)[0] == "ppo" and launch.stage(QWEN_GRPO)[0] == "grpo"
    out = dry_run_out("grpo.sbatch", str(plain), SLURM_JOB_ID="6", ATOMMEM_STAGE="ppo")
    assert "stage: ppo (ATOMMEM_STAGE=ppo)" in out
    assert parse_training(commands(out)[1])[0] == "ppo"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full_env.update(ATOMMEM_DRY_RUN="1", ATOMMEM_REPO=str(REPO), ATOMMEM_STAGE="dpo")
    bad = subprocess.run(["bash", "slurm/grpo.sbatch", QWEN_GRPO], cwd=REPO, env=full_env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode != 0 and "ATOMMEM_STAGE" in bad.stderr


@pytest.mark.parametrize("with_overrides", [False, True], ids=["no-overrides", "overrides"])
def test_sft_sbatch_dry_run_parses(with_overrides):
    overrides = ["--num_train_epochs", "1", "--env_config", '{"chunk_tokens": 4096, "max_prompt_tokens": 8192}'] \
        if with_overrides else []
    cmds = commands(dry_run_out("sft.sbatch", "recipes/qwen3_8b/sft.yaml", *overrides, SLURM_JOB_ID="12",
                                SLURM_GPUS_ON_NODE="8"))
    no_empty_words(cmds)
    (cmd,) = cmds
    stage, config = parse_training(cmd)
    assert stage == "sft" and type(config).__name__ == "SFTRecipeConfig"
    assert config.num_train_epochs == (1 if with_overrides else 2)


@pytest.mark.parametrize("with_overrides", [False, True], ids=["no-overrides", "overrides"])
def test_eval_sbatch_dry_run_parses(tmp_path, with_overrides):
    """eval.sbatch's vLLM path: the eval command parses with `atommem eval`'s own parser and names the
    server it started (--base-url; the openai backend reads no environment variable), and the server's
    window is the one eval assumes."""
    from atommem_rl.cli import build_parser

    extra = ["--limit", "5", "--context-tokens", "16384"] if with_overrides else []
    cmds = commands(dry_run_out("eval.sbatch", "--tasks", "t.jsonl", "--methods", "ours,rag", "--model", "m",
                                "--out", str(tmp_path / "ev"), *extra, SLURM_JOB_ID="13", SLURM_GPUS_ON_NODE="4"))
    no_empty_words(cmds)
    serve, ev = cmds
    i = ev.index("-m")
    assert ev[i + 1:i + 3] == ["atommem_rl.cli", "eval"]
    args = build_parser().parse_args(ev[i + 2:])
    assert args.backend == "openai" and args.base_url == f"http://127.0.0.1:{flag(serve, '--port')}/v1"
    assert args.model == "m" and (args.limit == 5) == with_overrides
    assert flag(serve, "--tensor-parallel-size") == "4"
    assert flag(serve, "--max-model-len") == ("16384" if with_overrides else "8192")
    # checkpoints are not served by that one server: refused before anything starts
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full_env.update(ATOMMEM_DRY_RUN="1", ATOMMEM_REPO=str(REPO))
    bad = subprocess.run(["bash", "slurm/eval.sbatch", "--tasks", "t.jsonl", "--model", "m", "--checkpoint", "c",
                          "--out", str(tmp_path / "ev2")], cwd=REPO, env=full_env, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "--checkpoint" in bad.stderr


def test_smoke_dry_runs_parse():
    """The CPU smoke branches print commands that parse too (no overrides)."""
    for script, stage in (("grpo.sbatch", "grpo"), ("sft.sbatch", "sft")):
        cmds = commands(dry_run_out(script, ATOMMEM_SMOKE="1", SLURM_JOB_ID="14",
                                    ATOMMEM_SMOKE_MODEL="checkpoints/base/tiny-qwen3-smoke"))
        no_empty_words(cmds)
        assert parse_training(cmds[-1])[0] == stage


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


def test_cpu_rehearsal_branch_dry_run():
    """ATOMMEM_CPU=1 (scripts/rehearse_cluster.sh): the one-node job's server (ATOMMEM_VLLM_CMD, TRL's
    vllm-serve arguments, tensor parallel 1), then ATOMMEM_NUM_PROCESSES gloo ranks in server mode on CPU,
    running ATOMMEM_ENTRY; the training command parses."""
    cmds = dry_run("grpo.sbatch", "recipes/quickstart/grpo.yaml", "--max_steps", "1", ATOMMEM_CPU="1",
                   ATOMMEM_NUM_PROCESSES="2", ATOMMEM_VLLM_CMD="python -m vllm.entrypoints.openai.api_server --model")
    no_empty_words(cmds)
    server, train = cmds[-2], cmds[-1]
    assert server[server.index("vllm.entrypoints.openai.api_server") + 1:][:2] == ["--model", "checkpoints/quickstart/sft"]
    assert flag(server, "--tensor-parallel-size") == "1" and "--logprobs-mode" in server
    assert train[train.index("accelerate.commands.launch") + 1:][:2] == ["--config_file", "recipes/accelerate/cpu_2proc.yaml"]
    assert flag(train, "--num_processes") == "2" and flag(train, "--vllm_mode") == "server"
    assert flag(train, "--use_cpu") == "true" and "CUDA_VISIBLE_DEVICES=" in train
    assert parse_training(train[train.index("accelerate.commands.launch"):])[0] == "grpo"
