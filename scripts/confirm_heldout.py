r"""Re-measure a learning-signal run on fresh held-out tasks (a benchmark, not a test).

The run's settings were chosen by looking at its held-out set (seed 5000 in scripts/learning_signal.sh),
so the GRPO - SFT difference measured there is biased towards the runs that happened to do well. This
script draws new tasks from the same generator with another seed (ids cannot clash: they carry the seed),
evaluates the run's SFT and GRPO checkpoints on them with the evaluation settings the run recorded
(``phases/eval.json``), and prints the same paired verdict. ``--also NAME=RUN`` adds the GRPO checkpoint
of another run that started from the same SFT phase (same phase key), so the SFT is evaluated once;
every checkpoint is evaluated under the first run's settings.

    .venv-vllm/bin/python scripts/confirm_heldout.py checkpoints/ls4 --also ls8=checkpoints/ls8 \
        --seed 6000 --tasks 256 --backend vllm [--batch-size 64]

Writes RUN/confirm-SEED/ (the evaluation's metrics.json, trajectories.jsonl, report) and
RUN/confirm-SEED/paired.json; rerunning resumes a killed evaluation. ``--out DIR`` writes elsewhere, so runs
added later are evaluated on the same tasks without overwriting an earlier confirmation (the SFT and RUN's
GRPO checkpoint are evaluated again there, so every difference is paired within one evaluation: greedy vLLM on
CPU is not bit-reproducible, the same SFT checkpoint scored 0.301-0.320 EM over three evaluations of 256 tasks,
docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atommem_rl.eval.methods import EvalSettings  # noqa: E402
from atommem_rl.pipeline.stats import episode_stats, paired_summary  # noqa: E402
from atommem_rl.tasks.schema import save_tasks  # noqa: E402
from atommem_rl.training.task_source import TaskSource, load_train_tasks  # noqa: E402


def phase(run: Path, name: str) -> dict:
    path = run / "phases" / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"{path} is missing: {run} has not finished its {name} phase")
    return json.loads(path.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="a finished scripts/learning_signal.sh folder")
    p.add_argument("--also", action="append", default=[], metavar="NAME=RUN",
                   help="another run's GRPO checkpoint, trained from the same SFT phase")
    p.add_argument("--seed", type=int, default=6000, help="seed of the fresh held-out tasks (default 6000)")
    p.add_argument("--tasks", type=int, default=256, help="fresh held-out tasks (default 256)")
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    p.add_argument("--base", action="store_true",
                   help="also evaluate the run's base model and print SFT - base (the quickstart's other claim)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default RUN/confirm-SEED)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="episodes in flight per generate call (default: the run's evaluation setting, 8); "
                        "throughput only: vLLM batches all of them in one call")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")
    # as in scripts/learning_signal.sh: bound, vLLM's CPU worker computes on all cores but one (one of two
    # here), the other reserved for its frontend
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

    data, sft, ev = phase(args.run, "data"), phase(args.run, "sft"), phase(args.run, "eval")
    if args.seed == data["settings"]["heldout"][1]:
        raise SystemExit(f"--seed {args.seed} is the run's own held-out seed: choose another")
    grpos = {"checkpoint:grpo": args.run / "grpo"}
    for spec in args.also:
        name, _, other = spec.partition("=")
        other = Path(other)
        if not name or name in ("sft", "grpo"):
            raise SystemExit(f"--also wants NAME=RUN with a new NAME, got {spec!r}")
        if phase(other, "sft")["key"] != sft["key"]:
            raise SystemExit(f"{other} did not start from {args.run}'s SFT phase (their sft keys differ)")
        phase(other, "grpo")
        grpos[f"checkpoint:{name}"] = other / "grpo"

    # the held-out generator follows GRPO's recorded task settings (TaskSource fields), with this seed
    grpo_tasks = data["settings"]["tasks"]["grpo"]
    tasks = load_train_tasks(TaskSource(**{**grpo_tasks, "tasks": None, "synth_tasks": args.tasks,
                                           "synth_seed": args.seed}))
    out = args.out or args.run / f"confirm-{args.seed}"
    out.mkdir(parents=True, exist_ok=True)
    save_tasks(tasks, out / "heldout.jsonl")

    from atommem_rl.inference.chat_backends import make_backend
    from atommem_rl.tasks.load import load_dataset
    from atommem_rl.eval.harness import evaluate

    recorded = dict(ev["result"]["settings"])
    if args.batch_size:
        recorded["batch_size"] = args.batch_size
    settings = EvalSettings(**recorded)
    folders = {"checkpoint:sft": args.run / "sft", **grpos}
    if args.base:
        folders = {"checkpoint:base": Path(phase(args.run, "model")["result"]["path"]), **folders}
    ckpts = {m: (lambda f=f: make_backend(args.backend, str(f), batch_size=settings.batch_size))
             for m, f in folders.items()}
    evaluate({"synthetic": load_dataset(out / "heldout.jsonl")}, list(ckpts), out, settings=settings,
             checkpoints=ckpts, resume=True, extra_settings={
                 "task_files": {"synthetic": str(out / "heldout.jsonl")}, "backend": args.backend, "trains": False,
                 "checkpoints": {m: str(f) for m, f in folders.items()}, "heldout_seed": args.seed})

    pairs = [(m, "checkpoint:sft") for m in grpos] + ([("checkpoint:sft", "checkpoint:base")] if args.base else [])
    stats = episode_stats(out / "trajectories.jsonl", pairs=pairs)
    result = {"seed": args.seed, "tasks": args.tasks, **stats}
    if args.base:
        line = paired_summary(stats["checkpoint:base"]["em"], stats["checkpoint:sft"]["em"], stats["sft - base"]["em"])
        print(f"checkpoint:sft: held-out EM (seed {args.seed}) against the base {line}")
    for m in grpos:
        line = paired_summary(stats["checkpoint:sft"]["em"], stats[m]["em"], stats[f"{m.split(':')[1]} - sft"]["em"])
        print(f"{m}: held-out EM (seed {args.seed}) {line}")
    (out / "paired.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
