#!/usr/bin/env bash
# Install everything AtomMem-RL needs into ./.venv on a fresh machine (Python + pip only).
#   bash scripts/setup.sh            # idempotent: a second run only checks the stamp
# torch is installed first on its own so pip takes the 2.13.0 CPU wheel (any other torch
# requirement would pull a multi-GB CUDA build); then the package with its pinned dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.atommem-installed
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
  .venv/bin/pip install --quiet --disable-pip-version-check -e ".[dev]"
  echo "$want" > "$stamp"
fi
