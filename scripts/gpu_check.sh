#!/usr/bin/env bash
# One-GPU check (no network, < 10 minutes): rollout tokens/s (vLLM colocated where vllm imports, HF
# generate always), SFT and GRPO update tokens/s with MFU on a random-weight Qwen3-shaped model in bf16,
# ending with a short table. Needs only torch + transformers; liger-kernel and vllm are used when present
# (on a machine without network, carry them as wheels; see docs/BENCHMARKS.md "GPU check").
#   bash scripts/gpu_check.sh                        # Qwen3-8B shape on cuda
#   bash scripts/gpu_check.sh --shape qwen3-1.7b     # flags: python -m atommem_rl.bench.gpu_check --help
#   bash scripts/gpu_check.sh --device cpu --tiny    # the same logic on CPU in seconds (tests/test_bench_rollout.py)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
# the package need not be installed: only atommem_rl/bench/gpu_check.py is imported (torch + transformers)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-${TMPDIR:-/tmp}/vllm-cache}"
exec timeout "${GPU_CHECK_TIMEOUT:-590}" "$PY" -m atommem_rl.bench.gpu_check "$@"
