r"""Tool ablations of a trained policy (issue 19, item 4; a benchmark, not a test): the checkpoint of a
quickstart run evaluated again on the run's own held-out tasks, once per variant of its environment, with
the run's evaluation settings, in one process and one sitting:

    full            the environment it was trained in
    no_update       update_memory removed (its schema and its rule line), likewise
    no_delete       delete_memory
    no_relations    label_relation
    no_scratchpad   write_scratchpad
    capacity        at most --capacity active memories; a create at capacity is refused ("update or delete
                    entries first"), AtomMem's memory-capacity experiment: does the policy turn to update
                    and delete?

Per variant: EM and F1 with standard errors, the paired EM difference against ``full`` on the same tasks
(beyond noise: more than 2 standard errors), evidence recall, relation macro-F1, memories at the end of an
episode, failed tool calls and the operation mix per task. A variant whose tool the policy never calls
can only differ through the tool's schema and rule line in the prompt.

    .venv/bin/python scripts/ablate_policy.py RUN [--checkpoint grpo] [--capacity 4] [--variants ...]
    .venv-vllm/bin/python scripts/ablate_policy.py RUN --tasks RUN/confirm-9000/heldout.jsonl --limit 128 \
        --backend vllm --out RUN/ablations-9000      # fresh tasks, vLLM

RUN is an ``atommem quickstart --out`` folder (e.g. scripts/full_setting_probe.sh's); the table is printed
last and written with the per-variant evaluations to RUN/ablations/ (table.md, ablations.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atommem_rl.inference.hf_engine import AUTOCAST_MODES  # noqa: E402
from atommem_rl.pipeline.stats import episode_scores, mean_se, verdict  # noqa: E402

VARIANTS = ("full", "no_update", "no_delete", "no_relations", "no_scratchpad", "capacity")


def variant_env(policy_env: dict, variant: str, capacity: int) -> dict:
    """The run's policy environment changed for one variant (ablations add to what it already disables)."""
    env = dict(policy_env)
    if variant == "capacity":
        return {**env, "capacity": capacity, "on_full": "refuse"}
    if variant != "full":
        tool = variant.removeprefix("no_")
        have = env.get("disable") or ()
        have = have.replace(",", " ").split() if isinstance(have, str) else list(have)
        env["disable"] = ",".join(dict.fromkeys([*have, tool]))
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="an `atommem quickstart --out` folder")
    ap.add_argument("--checkpoint", default="grpo", help="the run's checkpoint folder to ablate (default grpo)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {','.join(VARIANTS)}")
    ap.add_argument("--capacity", type=int, default=4, help="active-memory cap of the capacity variant (default 4)")
    ap.add_argument("--autocast", choices=AUTOCAST_MODES, default=None,
                    help="generation autocast (default: what the run's evaluation used; Hugging Face backend only)")
    ap.add_argument("--tasks", type=Path, default=None,
                    help="held-out tasks (JSONL) instead of the run's own RUN/data/heldout.jsonl, e.g. the fresh "
                         "tasks of scripts/confirm_heldout.py (RUN/confirm-SEED/heldout.jsonl)")
    ap.add_argument("--limit", type=int, default=None, help="the first N of those tasks")
    ap.add_argument("--backend", choices=["hf", "vllm"], default="hf",
                    help="generation backend (vllm: where scripts/setup_vllm.sh made .venv-vllm, run with its Python)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default RUN/ablations)")
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = sorted(set(variants) - set(VARIANTS))
    if bad or "full" not in variants:
        ap.error(f"variants must include full and be among {', '.join(VARIANTS)} (unknown: {bad})")
    if args.capacity < 1:
        ap.error("--capacity must be at least 1")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be at least 1")
    metrics = json.loads((args.run / "metrics.json").read_text())
    ev = metrics["phases"]["eval"]["result"]
    # the run's own evaluation: its autocast and its batch (bf16 greedy paths depend on both)
    autocast = args.autocast or (metrics.get("settings") or {}).get("eval_autocast", "off")
    ckpt = args.run / args.checkpoint
    if not (ckpt / "config.json").exists():
        ap.error(f"{ckpt} is not a model folder")

    from atommem_rl.eval.harness import evaluate
    from atommem_rl.eval.methods import EvalSettings
    from atommem_rl.inference.chat_backends import make_backend
    from atommem_rl.tasks.load import load_dataset

    task_file = args.tasks or args.run / "data" / "heldout.jsonl"
    if not task_file.exists():
        ap.error(f"{task_file} does not exist")
    tasks = {"synthetic": load_dataset(str(task_file), limit=args.limit)}
    base = dict(ev["settings"])
    out_root = args.out or args.run / "ablations"
    # as in scripts/confirm_heldout.py: vLLM's CPU worker computes on all cores but one unless unbound
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    rows, em = {}, {}
    method = f"checkpoint:{args.checkpoint}"
    for v in variants:
        settings = EvalSettings(**{**base, "policy_env": variant_env(base.get("policy_env") or {}, v, args.capacity)})
        factory = lambda: make_backend(args.backend, str(ckpt), batch_size=settings.batch_size, autocast=autocast)  # noqa: E731
        t0 = time.time()
        m = evaluate(tasks, [method], str(out_root / v), settings=settings, checkpoints={method: factory},
                     extra_settings={"variant": v, "checkpoint": str(ckpt), "autocast": autocast, "trains": False,
                                     "backend": args.backend, "task_file": str(task_file), "limit": args.limit})
        r = m["results"][method]["synthetic"]
        em[v] = {t: sc["em"] for t, sc in episode_scores(out_root / v / "trajectories.jsonl")[method].items()}
        rows[v] = {"em": mean_se(list(em[v].values())), "f1": r["f1"], "evidence_recall": r["evidence_recall"],
                   "relation_macro_f1": r.get("relation_macro_f1"), "memory_size": r.get("memory_size"),
                   "ops_per_task": {**(r["ops_per_task"] or {}), "errors": r["tool_errors_per_task"]},
                   "seconds": round(time.time() - t0, 1),
                   "policy_env": settings.policy_env}
        print(f"{v}: EM {rows[v]['em']['mean']:.3f} ({rows[v]['seconds']} s)", flush=True)
    for v in variants:
        common = sorted(set(em[v]) & set(em["full"]))
        rows[v]["em_minus_full"] = mean_se([em[v][t] - em["full"][t] for t in common]) if v != "full" else None
    (out_root / "ablations.json").write_text(json.dumps({"run": str(args.run), "checkpoint": str(ckpt),
                                                         "tasks": str(task_file), "limit": args.limit, "backend": args.backend,
                                                         "capacity": args.capacity, "autocast": autocast,
                                                         "variants": rows}, indent=1))
    table = table_md(rows)
    (out_root / "table.md").write_text(table)
    print(table)
    return 0


def _fmt(x, pct=True):
    return "-" if x is None else (f"{100 * x:.1f}" if pct else f"{x:.1f}")


def table_md(rows: dict) -> str:
    ops = ("create", "read", "update", "delete", "relate", "scratchpad", "answer", "errors")
    head = ("| variant | EM % (± se) | EM - full (± se) | evidence recall % | relation macro-F1 % | memories | "
            + " | ".join(ops) + " | s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for v, r in rows.items():
        d = r["em_minus_full"]
        diff = "-" if d is None else f"{100 * d['mean']:+.1f} ± {100 * d['se']:.1f} ({verdict(d).split(' (')[0]})"
        mem, o = r["memory_size"], r["ops_per_task"] or {}
        lines.append(f"| {v} | {100 * r['em']['mean']:.1f} ± {100 * r['em']['se']:.1f} | {diff} | "
                     f"{_fmt(r['evidence_recall'])} | {_fmt(r['relation_macro_f1'])} | {_fmt(mem, False)} | "
                     + " | ".join(f"{o.get(k, 0):.2f}" for k in ops) + f" | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
