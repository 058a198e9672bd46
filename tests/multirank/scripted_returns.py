"""Scripted episode returns for tests and the CPU rehearsal: ``atommem`` with every episode's return
replaced by a deterministic function of the episode's own completion tokens.

A tiny random-weight policy never answers a question right, so every episode of a group scores the
same, GRPO's advantages are all zero and nothing is trained. Here each episode's return is
:func:`scripted_return` of the token ids it generated (every step's completion, in order): it depends on
the episode only, not on the process that ran it or on the other episodes of its batch, so one process
and N processes that roll out the same episodes (seeded sampling) score them the same, and the episodes
of a group, whose tokens differ, get different returns (non-zero advantages). The environment, the
rollouts and the trainer are the product's; only the record's ``return`` (and, for PPO, the reward of
the episode's last step, which is what its GAE reads) is rewritten, after the episode ran.

    python tests/multirank/scripted_returns.py grpo --model_name_or_path ... [atommem grpo|ppo flags]
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml tests/multirank/scripted_returns.py grpo ...
    python tests/multirank/scripted_returns.py write-tasks PATH N   # N tasks of uneven sizes (1 or 3 documents)

``ATOMMEM_SCRIPTED_LOG=PATH``: each process appends one JSON line per generation batch (rank, global
step, generation rounds taken and completions that did not match their prompt, per episode: steps taken,
completion tokens, scripted return, a hash of its tokens), which the tests
and scripts/rehearse_cluster.sh read to show that the ranks' work was uneven and the episodes the same.
In-process tests call :func:`install` (returns the original method for monkeypatch-free undo).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

# run as a script its folder is sys.path[0]; the repository root makes atommem_rl importable from any venv
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def scripted_return(steps) -> float:
    """A return in [0, 1] from an episode's completion token ids (steps: (prompt, completion, logprobs))."""
    ids = [int(t) for step in steps for t in step[1]]
    return (sum((i + 1) * t for i, t in enumerate(ids)) % 101) / 100.0


def _digest(steps) -> str:
    return hashlib.sha1(json.dumps([[list(map(int, s[0])), list(map(int, s[1]))] for s in steps]).encode()).hexdigest()[:12]


WEIGHT_SYNCS = {"skipped": 0}
LAST_POLICY: dict = {}


def skip_weight_sync() -> None:
    """``ATOMMEM_REHEARSAL_NO_WEIGHT_SYNC=1`` (the CPU rehearsal): TRL's server-mode weight transfer runs on
    vLLM's NCCL engine, which needs a CUDA device (``VLLMClient.init_communicator`` raises on CPU). Only
    that is replaced: the trainer does not open the NCCL group and its ``sync_weights`` counts instead of
    sending; generation still goes through the real server with TRL's client (so the server keeps the
    initial weights, and the trainer's importance-sampling correction sees the gap)."""
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration

    def init_communicator(self, device=0):
        self.communicator = None

    def sync_weights(self):
        WEIGHT_SYNCS["skipped"] += 1

    VLLMClient.init_communicator = init_communicator
    VLLMGeneration.sync_weights = sync_weights


COUNTS: dict = {}


def count_passes() -> None:
    """``ATOMMEM_COUNT_PASSES=1``: count, per rank, every forward and backward through the policy's (and PPO's
    critic's) input embedding (each full-model pass goes through it once) and write them at exit (one JSON
    line, ``"passes"``, to ATOMMEM_SCRIPTED_LOG). Under ZeRO-3/FSDP each such pass all-gathers parameters,
    so the counts must be equal on every rank or the ranks deadlock; accelerate runs neither on CPU, so the
    rehearsal checks the counts instead."""
    COUNTS["enabled"] = True


def _attach_counters(trainer) -> None:
    """Hooks on the first generation batch (the critic exists by then), and the exit-time log line."""
    import atexit

    COUNTS["attached"] = True
    for name in ("policy", "critic"):
        model = trainer.model if name == "policy" else getattr(trainer, "critic", None)
        if model is None:
            continue
        emb = getattr(model, "module", model).get_input_embeddings()
        COUNTS[name] = {"forward": 0, "backward": 0}

        def hook(module, inputs, out, name=name):
            COUNTS[name]["forward"] += 1
            if out.requires_grad:
                out.register_hook(lambda g, name=name: COUNTS[name].__setitem__("backward", COUNTS[name]["backward"] + 1))

        emb.register_forward_hook(hook)
    rank = trainer.accelerator.process_index

    def write():
        log = os.environ.get("ATOMMEM_SCRIPTED_LOG")
        if log:
            passes = {k: v for k, v in COUNTS.items() if isinstance(v, dict)}
            with open(log, "a") as f:
                f.write(json.dumps({"rank": rank, "passes": passes, "episodes": []}) + "\n")

    atexit.register(write)


def install():
    """Patch StepwiseGRPOTrainer._run_episodes (PPO's trainer inherits it); returns the original."""
    from atommem_rl.training.grpo import StepwiseGRPOTrainer
    from atommem_rl.training.rounds import TrainerPolicy

    if not getattr(TrainerPolicy.drain, "scripted", False):
        drain = TrainerPolicy.drain

        def counting_drain(self):
            drain(self)
            LAST_POLICY.update(rounds=self.rounds, mismatched=self.mismatched_completions,
                               prompts=self.generated_prompts)

        counting_drain.scripted = True
        TrainerPolicy.drain = counting_drain

    orig = StepwiseGRPOTrainer._run_episodes
    if getattr(orig, "scripted", False):
        return orig.original

    def _run_episodes(self, tasks, seed):
        if COUNTS.get("enabled") and not COUNTS.get("attached"):
            _attach_counters(self)
        recs, episodes = orig(self, tasks, seed)
        for rec, steps in zip(recs, episodes):
            r = scripted_return(steps)
            if rec.get("steps") and steps:  # PPO: GAE reads per-step rewards; the last step gets the return
                rec["steps"][len(steps) - 1] = {**rec["steps"][len(steps) - 1], "reward": r}
            rec["return"] = r
        log = os.environ.get("ATOMMEM_SCRIPTED_LOG")
        if log:
            line = {"rank": self.accelerator.process_index, "ranks": self.accelerator.num_processes,
                    "step": int(self.state.global_step), "seed": seed, "server": bool(getattr(self, "use_vllm", False)),
                    "weight_syncs_skipped": WEIGHT_SYNCS["skipped"], **LAST_POLICY,
                    "episodes": [{"task": t.id, "steps": len(s), "tokens": sum(len(x[1]) for x in s),
                                  "return": rec["return"], "digest": _digest(s)}
                                 for t, rec, s in zip(tasks, recs, episodes)]}
            with open(log, "a") as f:
                f.write(json.dumps(line) + "\n")
        return recs, episodes

    _run_episodes.scripted = True
    _run_episodes.original = orig
    StepwiseGRPOTrainer._run_episodes = _run_episodes
    return orig


def write_uneven_tasks(path: str, n: int) -> None:
    """n synthetic tasks alternating 1 and 3 documents (one question, no confounders): their episodes take
    different numbers of steps, so ranks holding different tasks finish at different rounds."""
    from atommem_rl.tasks.schema import save_tasks
    from atommem_rl.tasks.synth import generate_task

    save_tasks([generate_task(i, 0, docs=1 if i % 2 == 0 else 3, questions=1, confounders=0) for i in range(n)], path)


def main(argv: list[str]) -> int:
    if argv[:1] == ["write-tasks"]:
        write_uneven_tasks(argv[1], int(argv[2]))
        return 0
    install()
    if os.environ.get("ATOMMEM_REHEARSAL_NO_WEIGHT_SYNC") == "1":
        skip_weight_sync()
    if os.environ.get("ATOMMEM_COUNT_PASSES") == "1":
        count_passes()
    from atommem_rl.cli import main as cli_main  # destroys the process group at the end (multi-process)

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
