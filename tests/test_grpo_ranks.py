"""Two DDP ranks with gradient accumulation stay replicas when the last micro-step is skipped.

``zero_advantage`` skip/hold take an all-zero micro-batch without a forward. Under DDP the gradients are
averaged only in the backward of the accumulation window's last micro-step; when that one is skipped and an
earlier one had signal, each rank used to step its optimizer on its own local gradients (the replicas drift
apart for the rest of the run). tests/multirank/accumulation_sync.py runs the real trainer on 2 gloo ranks with
scripted advantages (different per rank in micro-step 1, all zero in micro-step 2); every rank's weights are
compared with every other rank's, and with the run that takes the last micro-step's forward (``train``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import REPO, free_port


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from atommem_rl.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=32, heads=2, kv_heads=1,
                      intermediate_size=64)


def run_two_ranks(out: Path, model: Path, mode: str) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "recipes/accelerate/cpu_2proc.yaml"), "--main_process_port", str(free_port()),
           str(REPO / "tests/multirank/accumulation_sync.py"), str(out), str(model), mode]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "disabled"}
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow
def test_skipped_last_micro_step_keeps_ranks_equal(tiny, tmp_path):
    forward = run_two_ranks(tmp_path / "train", tiny, "train")
    assert forward[0]["skipped"] == [0.0, 0.0]
    for mode in ("skip", "hold"):
        ranks = run_two_ranks(tmp_path / mode, tiny, mode)
        assert ranks[0]["skipped"] == [0.0, 1.0] == ranks[1]["skipped"], "micro-step 2 must have been skipped"
        for name, w0 in ranks[0]["weights"].items():
            w1 = ranks[1]["weights"][name]
            assert torch.equal(w0, w1), f"{mode}: rank 0 and rank 1 hold different {name} after the step"
            # the same update as the forward/backward of the zero micro-batch gives (its gradient is 0)
            torch.testing.assert_close(w0, forward[0]["weights"][name], rtol=0, atol=1e-6)
    moved = [not torch.equal(w, forward[1]["weights"][n]) for n, w in forward[0]["weights"].items()]
    assert not any(moved)  # DDP's own path: replicas
