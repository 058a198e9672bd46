# Shared helpers for the sbatch scripts (sourced; no hyper-parameters here: those live in recipes).
#
#   ATOMMEM_DRY_RUN=1   print the commands (with the node/rank layout) instead of running them
#   ATOMMEM_SMOKE=1     CPU smoke mode: the quickstart recipe, a tiny random-weight model, 2 steps
#   ATOMMEM_REPO        repository root (default: the submit directory, then the current directory)
#   ATOMMEM_PYTHON      Python with atommem installed (default: $ATOMMEM_REPO/.venv/bin/python)
#   ATOMMEM_CPUS_PER_TASK  CPUs each srun task asks for (default: the smallest node's CPUs in the allocation)

set -euo pipefail

atommem_init() {
  REPO=${ATOMMEM_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
  if [ ! -f "$REPO/atommem_rl/cli.py" ]; then
    echo "error: $REPO is not the AtomMem-RL repository (set ATOMMEM_REPO or submit from the repo root)" >&2
    exit 2
  fi
  cd "$REPO"
  PY=${ATOMMEM_PYTHON:-$REPO/.venv/bin/python}
  [ -x "$PY" ] || PY=$(command -v python3)
  BIN=$(dirname "$PY")
  export PATH="$BIN:$PATH"
  DRY=${ATOMMEM_DRY_RUN:-0}
  SMOKE=${ATOMMEM_SMOKE:-0}
  export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1}
  export ANONYMIZED_TELEMETRY=False
  JOB=${SLURM_JOB_ID:-local-$$}
}

# a word as the shell reads it back: bare when safe, else in single quotes
quote() {
  if [[ $1 =~ ^[A-Za-z0-9_./=:,@%+-]+$ ]]; then printf '%s' "$1"
  else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}

# print a command (copy-pasteable), then run it unless dry
run() {
  local w line="+"
  for w in "$@"; do line+=" $(quote "$w")"; done
  echo "$line"
  [ "$DRY" = 1 ] || "$@"
}

# the words of "$@" as one string the shell reads back word for word (nothing at all for no words: never '')
quote_all() {
  local w out=""
  for w in "$@"; do out+=" $(quote "$w")"; done
  printf '%s' "$out"
}

# CPUs for an srun step of one task per node: srun (Slurm >= 22.05) no longer inherits the batch script's
# --cpus-per-task, so a step given none gets 1 CPU per task and the 8 ranks plus data loaders of a node
# share it. Default: the smallest node of the allocation (SLURM_JOB_CPUS_PER_NODE, e.g. "96(x2),64"), so the
# request fits every node; else SLURM_CPUS_ON_NODE; else this machine's count.
cpus_per_task() {
  if [ -n "${ATOMMEM_CPUS_PER_TASK:-}" ]; then echo "$ATOMMEM_CPUS_PER_TASK"; return; fi
  local spec=${SLURM_JOB_CPUS_PER_NODE:-} part n min=""
  for part in ${spec//,/ }; do
    n=${part%%(*}
    [[ $n =~ ^[0-9]+$ ]] || continue
    if [ -z "$min" ] || [ "$n" -lt "$min" ]; then min=$n; fi
  done
  echo "${min:-${SLURM_CPUS_ON_NODE:-$(nproc)}}"
}

# a node's IPv4 address as the other nodes reach it (for VLLM_HOST_IP); the name itself when it does not resolve
host_addr() {
  local ip
  ip=$(getent ahostsv4 "$1" 2>/dev/null | awk 'NR == 1 {print $1}') || true
  if [ -z "$ip" ]; then
    echo "warning: cannot resolve $1 to an address; VLLM_HOST_IP=$1" >&2
    ip=$1
  fi
  echo "$ip"
}

# the run folder (parent of output_dir, else checkpoints/<run_name>) from the recipe + overrides
run_dir() { "$PY" -m atommem_rl.training.recipes run-dir "$@"; }
recipe_value() { "$PY" -m atommem_rl.training.recipes get "$@"; }

# send this script's output to RUN_DIR/logs/<name>-<job>.log as well (not in dry-run mode)
log_to() {
  local dir=$1 name=$2
  if [ "$DRY" != 1 ]; then
    mkdir -p "$dir/logs"
    LOG="$dir/logs/$name-$JOB.log"
    exec > >(tee -a "$LOG") 2>&1
    echo "log: $LOG"
  else
    echo "log: $dir/logs/$name-$JOB.log (dry run: not written)"
  fi
}

# hostnames of the allocation, one per line (scontrol when present, else expand a simple hostlist)
node_list() {
  if [ -n "${ATOMMEM_NODES:-}" ]; then tr ' ,' '\n\n' <<<"$ATOMMEM_NODES" | sed '/^$/d'; return; fi
  local list=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-$(hostname -s)}}
  if command -v scontrol >/dev/null 2>&1 && scontrol show hostnames "$list" 2>/dev/null; then return; fi
  python3 - "$list" <<'PYEOF'
import re, sys
out, s = [], sys.argv[1]
for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", s):
    m = re.match(r"^(.*)\[(.*)\](.*)$", part)
    if not m:
        out.append(part); continue
    pre, body, post = m.groups()
    for r in body.split(","):
        a, _, b = r.partition("-")
        for i in range(int(a), int(b or a) + 1):
            out.append(f"{pre}{str(i).zfill(len(a))}{post}")
print("\n".join(out))
PYEOF
}

# the tiny random-weight model used by smoke mode (built once, seconds)
smoke_model() {
  local dir=${ATOMMEM_SMOKE_MODEL:-checkpoints/base/tiny-qwen3-smoke}
  if [ "$dir" = base ]; then
    run "$PY" scripts/prepare_base_model.py >&2
    echo checkpoints/base/smollm2-135m-instruct; return
  fi
  if [ ! -f "$dir/config.json" ]; then
    run "$PY" -c "from atommem_rl.models import tiny_model; tiny_model('$dir', arch='qwen3', hidden_size=32, heads=2, kv_heads=1, intermediate_size=64)" >&2
  fi
  echo "$dir"
}
