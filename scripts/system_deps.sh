#!/usr/bin/env bash
# System services and packages the full test suite uses (run as root; idempotent):
#   Debian's chromium (the viewer test in a real headless browser) and a single-node Slurm cluster
#   (slurm-wlm + munge, started by scripts/start_slurm.sh). CI runs this before the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "system_deps.sh: not root; skipping chromium and Slurm (their tests will skip)" >&2
  exit 0
fi
if ! command -v chromium >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends chromium
fi
bash scripts/start_slurm.sh
