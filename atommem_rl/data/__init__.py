"""Benchmark data: loaders (``locomo``) and the real benchmark files shipped in ``benchmarks/``
(LoCoMo, HotpotQA and MuSiQue subsets, with their licences: ``benchmarks/README.md``)."""

from __future__ import annotations

import os
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent / "benchmarks"
FILES = {"locomo": "locomo/locomo10.json", "hotpotqa": "hotpotqa/hotpotqa_train_100.json",
         "musique": "musique/musique_train_100.json"}


def data_dir() -> Path:
    """``$ATOMMEM_DATA_DIR`` when set (a folder laid out like ``benchmarks/``), else the shipped files."""
    return Path(os.environ["ATOMMEM_DATA_DIR"]) if os.environ.get("ATOMMEM_DATA_DIR") else BENCHMARKS


def benchmark_file(source: str) -> Path:
    """The shipped (or ``$ATOMMEM_DATA_DIR``) file of ``source``: locomo, hotpotqa or musique."""
    if source not in FILES:
        raise ValueError(f"no shipped file for {source!r}; known: {', '.join(FILES)}")
    return data_dir() / FILES[source]
