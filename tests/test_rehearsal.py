"""The CPU rehearsal of the cluster job (scripts/rehearse_cluster.sh; docs/CLUSTER.md, "CPU rehearsal"):
slurm/grpo.sbatch on the real single-node Slurm cluster, a real vLLM server (CPU build) in server mode,
2 gloo ranks with uneven episodes under DDP and under FSDP2 (the packed update in several micro-batches, through
the rehearsal switch ATOMMEM_REHEARSE_FSDP_ON_CPU=1; its sharded checkpoint resumed), a one-process reference
that both must match, PPO with gradient accumulation 2 and a critic epoch, resumed from its checkpoint; every
rank's forwards and backwards are counted and must be equal. The script ends with one JSON line; this test runs
it and checks that line. Needs Slurm (scripts/start_slurm.sh, which scripts/test.sh
starts as root; skipped without it, a failure under ATOMMEM_STRICT=1) and .venv-vllm (under ATOMMEM_STRICT=1,
as in CI, the script runs scripts/setup_vllm.sh when it is missing; otherwise the test skips). About 12-18
minutes on 2 cores (five Slurm jobs, each starting its own vLLM server, and a resumed run): longer than the
suite's 900 s per-test timeout, so this test has its own, above the script's worst case (six runs of at most
ATOMMEM_REHEARSAL_TIMEOUT = 900 s each, plus set-up). A job that times out is a hang; the script then prints
the Python stacks of its processes and the tails of its logs to stderr, which the assertion shows."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from .conftest import REPO, require
from .test_slurm import _slurm_up

pytestmark = pytest.mark.slow


@pytest.mark.timeout(5600)
def test_cpu_rehearsal_of_the_cluster_job():
    require(_slurm_up(), "no running Slurm cluster (start one with: sudo bash scripts/start_slurm.sh)")
    if not (REPO / ".venv-vllm" / "bin" / "python").exists() and os.environ.get("ATOMMEM_STRICT") != "1":
        pytest.skip(".venv-vllm is missing (bash scripts/setup_vllm.sh)")
    res = subprocess.run(["bash", str(REPO / "scripts/rehearse_cluster.sh")], cwd=REPO, capture_output=True, text=True,
                         timeout=5400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    last = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else "{}"
    report = json.loads(last)
    assert res.returncode == 0 and report.get("ok"), (last, res.stderr[-12000:])
    assert report["ranks"] == 2 and report["modes"] == ["ddp", "fsdp2"]
    assert report["fsdp2"]["matches_single_process"] and report["fsdp2"]["same_episodes_as_single"]
    assert any((n or 0) > 1 for n in report["fsdp2"]["packed_microbatches_logged"])  # the budget really split
    assert report["fsdp2"]["resumed_from_checkpoint"]  # the sharded checkpoint reloaded and trained on
    assert report["mismatched_completions"] == 0 and report["hangs"] == 0
    assert report["weights_moved"] and report["matches_single_process"]
    assert report["passes_equal_per_rank"] and report["rounds_equal_per_rank"]
    assert len(set(report["uneven_steps_per_rank"].values())) > 1  # the ranks' episodes had different lengths
    assert report["grpo_skipped_zero_advantage"] and not any(report["grpo_skipped_zero_advantage"])
    ppo = report["ppo"]
    assert ppo["policy_moved"] and ppo["critic_moved"] and ppo["resumed_from_checkpoint"]
