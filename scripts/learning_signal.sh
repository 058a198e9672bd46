#!/usr/bin/env bash
# Learning signal (issue 4, a benchmark, not a test): SFT then GRPO with SmolLM2-135M-Instruct on CPU on an
# easy synthetic setting (3 documents, 1 question, no confounders; the store tools create and read, the
# scratchpad and the answer tool: update, delete and label_relation are disabled, which cuts the system
# prompt from ~1,000 to ~700 tokens), then held-out exact match of the
# SFT and GRPO checkpoints over 128 held-out episodes (greedy): mean, standard error, and the paired difference
# GRPO - SFT on the same tasks (is it beyond noise: more than 2 standard errors?). GRPO trains one task
# of GROUP episodes per step (a task whose episodes all score the same skips its forward/backward).
#
#   bash scripts/learning_signal.sh [OUT] [extra `atommem quickstart` flags]    # default OUT checkpoints/learning_signal
#
# It is the quickstart pipeline (atommem_rl/pipeline/quickstart.py) with bigger settings, so it resumes
# when rerun with the same arguments. SFT_STEPS, GRPO_STEPS, HELDOUT (env) scale it; defaults 24, 16, 128.
# GROUP (episodes per task, default 8), TASKS (tasks per step, default 1), GRPO_LR (default 2e-5), TEMPERATURE (rollout sampling, default 0.8),
# ERROR_PENALTY (see below), HOLD (zero_advantage hold: no optimizer update from a step without signal, default true) and REWARD (GRPO's training reward, default
# f1: partial credit for an answer that contains the right city among other words; held-out is scored by EM)
# set the GRPO side; SETTING=full trains issue 19's full setting instead (below). BACKEND=vllm|hf generates the held-out episodes (and GRPO's rollouts, see ROLLOUT) (default: vllm where
# scripts/setup_vllm.sh made .venv-vllm, about 8x faster on this CPU; the whole run then uses that
# environment's Python). The figures go in docs/BENCHMARKS.md ("Learning signal"). Settings chosen by
# looking at this held-out set are re-measured on fresh tasks with scripts/confirm_heldout.py OUT (the
# command is printed last; there GRPO beat SFT beyond noise).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-checkpoints/learning_signal}
[ $# -gt 0 ] && shift
mkdir -p "$(dirname "$OUT")"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 ANONYMIZED_TELEMETRY=False WANDB_MODE=${WANDB_MODE:-offline}
# SETTING=full: issue 19's full setting instead (scripts/full_setting_probe.sh's tasks on this script's fast stack):
# every tool on (create, read, update, delete, label_relation, scratchpad), 4 documents, 2 questions and 2
# confounders per question (current and temporal questions need the newer and the older fact), chunks of 128
# tokens; SFT on the oracle's update demonstrations (supersede=update: update_memory rewrites a replaced fact,
# delete_memory drops its duplicates) of 32 tasks (SFT_TASKS), max_length 4096; max_completion_length 352 (the
# chunk-step demonstrations are up to 350 tokens). With BETA=0.04 and 16 GRPO steps it learns: GRPO - SFT +7.2 ± 1.5 and
# +6.4 ± 1.4 EM on 512 fresh held-out tasks, trainer seeds 1 and 2 (docs/BENCHMARKS.md, "The full setting learns")
SETTING=${SETTING:-easy}
case "$SETTING" in
  easy)
    ENV='{"chunk_tokens": 256, "max_prompt_tokens": 2048, "embedder": "hashing", "max_answer_steps": 1, "disable": "update,delete,relations"}'
    TASK_SHAPE=(synth_docs=3 synth_questions=1 synth_confounders=0)
    SFT_EXTRA=(synth_tasks=${SFT_TASKS:-16})
    COMPLETION=224; SFT_DEFAULT_STEPS=24 ;;
  full)
    ENV='{"chunk_tokens": 128, "max_prompt_tokens": 3072, "embedder": "hashing", "max_answer_steps": 1}'
    TASK_SHAPE=(synth_docs=4 synth_questions=2 synth_confounders=2)
    SFT_EXTRA=(synth_tasks=${SFT_TASKS:-32} 'demo_policy_kwargs={"supersede": "update"}' max_length=4096)
    COMPLETION=352; SFT_DEFAULT_STEPS=96 ;;
  roam)
    # issue 40's ROAM setting (docs/benchmarks/roam_setting.md: the labelling oracle beats itself without labels
    # by +44.7/+42.8 EM there): 24 documents, 2-3 questions, 3 dated changes per attribute, paraphrased and partial
    # duplicates, 2 confounders per question, retrieval_k 3; SFT on the labelling oracle's demonstrations. Its
    # chunk-step demonstrations are up to ~540 tokens (median 237, 8 tasks of seed 99), ~12 steps per episode
    ENV='{"chunk_tokens": 128, "max_prompt_tokens": 3072, "embedder": "hashing", "retrieval_k": 3, "max_answer_steps": 1}'
    TASK_SHAPE=(synth_setting=roam synth_docs=24 synth_questions=2-3 synth_confounders=2 synth_changes=3)
    SFT_EXTRA=(synth_tasks=${SFT_TASKS:-32} max_length=4096)
    COMPLETION=576; SFT_DEFAULT_STEPS=96 ;;
  *) echo "SETTING must be easy, full or roam, got $SETTING" >&2; exit 2 ;;
esac
SETTING_SETS=("${TASK_SHAPE[@]}" "env_config=$ENV")
PY=.venv/bin/python
if [ -z "${BACKEND:-}" ]; then
  BACKEND=hf
  .venv-vllm/bin/python -c "import vllm" 2>/dev/null && BACKEND=vllm
fi
[ "$BACKEND" = vllm ] && PY=.venv-vllm/bin/python
# GRPO's rollouts: ROLLOUT=vllm (default with BACKEND=vllm) generates them with vLLM colocated in the
# trainer's process (TRL's vllm_mode colocate, weights synced after every step); hf: Hugging Face generate.
# No importance-sampling correction: it costs a forward of every sample each step (zero-advantage steps
# included), and vLLM samples from the weights synced after the previous step
ROLLOUT=${ROLLOUT:-$BACKEND}
VLLM_SETS=()
if [ "$ROLLOUT" = vllm ]; then
  VLLM_SETS=(use_vllm=true vllm_mode=colocate vllm_max_model_length=4096 vllm_gpu_memory_utilization=0.4
             vllm_importance_sampling_correction=false)
  # vLLM's CPU worker binds this process's OpenMP threads to all cores but one (it reserves one for its
  # frontend); in colocate mode that is the trainer's process (an informative step, rollouts included,
  # took 306 s bound and 224 s unbound: one step each, different tasks)
  export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
fi
# the oracle's chunk-step demonstrations here are 116-185 tokens (3-4 create_memory calls): a smaller
# max_completion_length cuts the last call, which is the newest fact the question asks about (measured
# with 96: every GRPO episode scored 0 and every advantage was 0)
# PACK (max_tokens_per_microbatch: the policy update packed by unique tokens, training/packing.py; 0: TRL's
# padded rows) and BF16 (auto_bf16: bf16 autocast where the CPU has native bf16) set SFT's and the GRPO update's
# cost levers (docs/BENCHMARKS.md, "Packed policy update"). Default: packed (8192 tokens) in bf16, an informative GRPO
# step 5.1x faster than the padded fp32 update side by side; PACK=0 BF16=false is the update of the runs recorded
# before 2026-12-06 (seed 0's +0.056). With trainer seeds 1 and 2 the padded fp32 update did not learn either (seed 2
# worse beyond noise), so packing and bf16 are not what the learning signal lacks (docs/BENCHMARKS.md, "The padded
# fp32 update on the same seeds")
# bf16=false is passed too: auto_bf16 false alone leaves TRL's default, bf16 autocast (GRPOConfig sets bf16=True
# when neither bf16 nor fp16 is given), so a run meant as fp32 trained in bf16 (docs/BENCHMARKS.md, "Learning signal")
PACK=${PACK:-8192}
BF16=${BF16:-true}
# SFT_BF16 (default BF16): SFT's alone, so GRPO with other levers can start from the same SFT phase
sets=()
for kv in "${SETTING_SETS[@]}" "${SFT_EXTRA[@]}" max_steps=${SFT_STEPS:-$SFT_DEFAULT_STEPS} save_steps=8 auto_bf16=${SFT_BF16:-$BF16} bf16=false; do sets+=(--sft-set "$kv"); done
GRPO_ENV=${ENV%\}}', "reward": "'${REWARD:-f1}'"}'
# ERROR_PENALTY=x (unset by default, so the recorded runs reproduce): GRPO's episodes lose x per step with a
# failed tool call. A failed call changes nothing, so the task reward alone leaves them free; the sixth run
# (TASKS=4, docs/BENCHMARKS.md) drifted from 0.06 to 2.8 failed calls per held-out episode without it
[ -n "${ERROR_PENALTY:-}" ] && GRPO_ENV=${GRPO_ENV%\}}', "error_penalty": '$ERROR_PENALTY'}'
# EVIDENCE_BONUS=x (unset by default): GRPO's episodes gain x times the share of the question's gold evidence
# shown at answer time. The task reward alone let GRPO drift to fewer memories (2.5 -> 1.6 creates per
# held-out episode, evidence recall 78 -> 62-64; docs/BENCHMARKS.md, issue 18 section)
[ -n "${EVIDENCE_BONUS:-}" ] && GRPO_ENV=${GRPO_ENV%\}}', "evidence_bonus": '$EVIDENCE_BONUS'}'
# RELATION_BONUS=x (unset by default): GRPO's episodes gain x times the accuracy of their relation labels
# against the task's gold labels (ROAM's supervision as an auxiliary reward; full setting: labels are on there)
[ -n "${RELATION_BONUS:-}" ] && GRPO_ENV=${GRPO_ENV%\}}', "relation_bonus": '$RELATION_BONUS'}'
# SEED: GRPO's trainer seed (task order and rollout sampling; default 0, the recorded runs'). BETA: the KL
# coefficient against the SFT checkpoint (default 0, as AtomMem; with beta > 0 every step updates, the KL
# term alone on a step whose episodes all scored the same, so no step is held). TRAIN_ONLY=1: stop after
# GRPO (no held-out evaluation; scripts/confirm_heldout.py --also evaluates several such runs at once).
# FORKS=K: step-level credit from K forks of every episode at its answer phase (fork_credit,
# atommem_rl/training/fork_credit.py; default 0: the terminal reward's advantage on every step)
G=${GROUP:-8}
# TASKS groups per step (default 1). With more than one, the samples of groups whose episodes all scored
# the same are dropped before TRL shuffles the batch and cuts it into TASKS micro-batches (zero_advantage drop or drop_hold),
# (TRL: generation batch = per_device_train_batch_size x gradient_accumulation_steps), so a step
# trains only on informative groups and averages their gradients
T=${TASKS:-1}
TASK_SETS=()
[ "$T" -gt 1 ] && TASK_SETS=(gradient_accumulation_steps=$T)
# zero_advantage: hold (HOLD=true) or skip; with TASKS > 1 dropping first (drop_hold or drop)
ZA=$([ "${HOLD:-true}" = true ] && echo hold || echo skip)
[ "$T" -gt 1 ] && ZA=$([ "$ZA" = hold ] && echo drop_hold || echo drop)
for kv in "${TASK_SHAPE[@]}" "env_config=$GRPO_ENV" synth_tasks=64 \
          max_steps=${GRPO_STEPS:-16} save_steps=4 num_generations=$G per_device_train_batch_size=$G \
          learning_rate=${GRPO_LR:-2e-5} temperature=${TEMPERATURE:-0.8} max_completion_length=$COMPLETION \
          zero_advantage=$ZA max_tokens_per_microbatch=$PACK auto_bf16=$BF16 bf16=false \
          seed=${SEED:-0} beta=${BETA:-0.0} fork_credit=${FORKS:-0} "${TASK_SETS[@]}" "${VLLM_SETS[@]}"; do
  sets+=(--grpo-set "$kv")
done
# training, then the evaluation in a fresh process. vLLM on CPU sizes its KV cache as the utilization share
# of host memory minus what this process already holds: after SFT (or a colocated engine) in the same
# process, 0.15 left a negative KV budget ("Available memory ... less than requested memory for kv")
# EVAL_AUTOCAST (default off): BACKEND=hf's held-out generation in fp32 as in the recorded runs; auto is the
# quickstart's default (bf16 autocast where the CPU has it); vLLM ignores it
SKIPS=(retrieval,eval retrieval)
[ "${TRAIN_ONLY:-0}" = 1 ] && SKIPS=(retrieval,eval)
for skip in "${SKIPS[@]}"; do
  "$PY" -m atommem_rl.cli quickstart --backend "$BACKEND" --out "$OUT" --skip $skip --methods oracle,heuristic \
    --sft-recipe recipes/quickstart_learning/sft.yaml --grpo-recipe recipes/quickstart_learning/grpo.yaml \
    --eval-autocast "${EVAL_AUTOCAST:-off}" \
    --checkpoints sft,grpo --heldout-tasks ${HELDOUT:-128} --heldout-seed 5000 "${sets[@]}" "$@" >> "$OUT.log" 2>&1 \
    || { tail -30 "$OUT.log"; exit 1; }
done
[ "${TRAIN_ONLY:-0}" = 1 ] && { echo "trained: $OUT (TRAIN_ONLY=1: not evaluated)"; exit 0; }
"$PY" - "$OUT" <<'EOF'
import json, sys
from atommem_rl.pipeline.stats import paired_summary
m = json.load(open(f"{sys.argv[1]}/metrics.json"))
ep = m["phases"]["eval"]["result"]["episodes"]
print(json.dumps({k: {"em": v["em"], "f1": v["f1"]} for k, v in ep.items()}, indent=1))
print("held-out EM: " + paired_summary(ep["checkpoint:sft"]["em"], ep["checkpoint:grpo"]["em"], ep["grpo - sft"]["em"]))
EOF
echo "report: $OUT/report.md"
echo "fresh held-out tasks (docs/BENCHMARKS.md, eighth run): $PY scripts/confirm_heldout.py $OUT --seed 7000 --tasks 768 --backend $BACKEND --batch-size 64"
