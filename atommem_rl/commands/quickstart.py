"""``atommem quickstart``: the whole pipeline that exists so far, on CPU, with embedded defaults.

Today that is the memory half of the system on real data: LoCoMo conversations are turned into
atoms (dialogue turns, no LLM) in one Chroma namespace per conversation with the packaged MiniLM
embeddings, and every retrieval strategy (dense, bm25, hybrid, graph) is scored by evidence
recall@10 on them. The phases write into ``--out``; a phase whose output is already there with the
same settings is skipped, so a second run resumes instead of redoing work. SFT, GRPO and evaluation
with baselines join as phases when they land (issues 4-6).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def default_locomo() -> Path:
    base = Path(os.environ.get("ATOMMEM_DATA_DIR", REPO.parent / "shared" / "data"))
    return base / "locomo" / "locomo10.json"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quickstart", help="run the whole pipeline on CPU with the embedded defaults",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "checkpoints" / "quickstart"), help="output folder")
    p.add_argument("--locomo", default=None, help="LoCoMo JSON file (default: $ATOMMEM_DATA_DIR or "
                   "../shared/data next to the repository, locomo/locomo10.json)")
    p.add_argument("--conversations", type=int, default=10, help="LoCoMo conversations to use (default all 10)")
    p.add_argument("--k", type=int, default=10, help="recall@k (default 10)")
    p.add_argument("--embedder", default="minilm", help="minilm | hashing[:DIM] | st:PATH | openai:URL#MODEL")
    p.add_argument("--force", action="store_true", help="redo phases that already have outputs")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from ..bench.retrieval import STRATEGIES, run_many

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    locomo = Path(args.locomo) if args.locomo else default_locomo()
    if not locomo.exists():
        raise FileNotFoundError(f"LoCoMo file not found: {locomo} (pass --locomo PATH)")
    settings = {"locomo": str(locomo), "conversations": args.conversations, "k": args.k,
                "embedder": args.embedder, "strategies": list(STRATEGIES)}
    metrics_path = out / "metrics.json"
    previous = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
    if previous.get("settings") == settings and "retrieval" in previous and not args.force:
        print(f"[1/1] memory + retrieval: done already ({metrics_path}); --force redoes it")
        results = previous["retrieval"]
    else:
        print(f"[1/1] memory + retrieval: {args.conversations} LoCoMo conversations -> atoms in Chroma, "
              f"{len(STRATEGIES)} strategies, recall@{args.k}")
        t0 = time.perf_counter()
        results = run_many(str(locomo), list(STRATEGIES), args.k, args.embedder,
                           limit_conversations=args.conversations)
        metrics_path.write_text(json.dumps({"settings": settings, "retrieval": results,
                                            "seconds": round(time.perf_counter() - t0, 1)}, indent=2))
    report = out / "report.md"
    cols = ["multi-hop", "temporal", "open-domain", "single-hop", "all"]
    lines = [
        "# AtomMem-RL quickstart report", "",
        f"LoCoMo: `{locomo}` ({args.conversations} conversations, {results[0]['questions']} questions with evidence, "
        f"categories 1-4); embedder `{args.embedder}`.", "",
        f"## Evidence recall@{args.k} by retrieval strategy (%)", "",
        "| strategy | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|",
    ]
    for r in results:
        lines.append(f"| {r['strategy']} | " + " | ".join(f"{r['recall_at_k'][c]:.1f}" for c in cols) + " |")
    lines += ["", "Reference (shared/data/README.md, dense+BM25 reciprocal-rank fusion): 58.2 overall, 32.5 multi-hop.",
              "", "Training (SFT, GRPO) and evaluation with baselines are added to this report as they land."]
    report.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[6:]))
    print(f"report: {report}")
    return 0
