"""Retrieval benchmark: evidence recall@k on LoCoMo with dialogue turns as atoms (no LLM).

Protocol (the reference in ``atommem_rl/data/benchmarks/README.md``): every turn of a conversation becomes one atom
(``atommem_rl.data.locomo.turn_drafts``) in its own AtomStore namespace (in-memory Chroma; the
conversation's turns are embedded once, in one batch, and each question is embedded once). For each
question of categories 1-4 that has evidence, retrieve the top ``k`` atoms and take the share of the
question's evidence dia ids among the retrieved atoms' source turns; recall@k is the mean of those
shares per category and over all questions, in percent. Gold evidence is used for scoring only.

    atommem bench retrieval --dataset locomo --path FILE --k 10 --strategy graph --json

prints ``{"k": 10, "questions": N, "strategy": "...", "recall_at_k": {"multi-hop": x, "temporal": x,
"open-domain": x, "single-hop": x, "all": x}, "seconds": s, ...}``. The lead wires ``add_arguments``
and ``main`` into the CLI; ``python -m atommem_rl.bench.retrieval ...`` works as well.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ..data.locomo import CATEGORIES, load_locomo, turn_drafts
from ..memory.embeddings import Embedder, make_embedder
from ..memory.retrieval import STRATEGIES, RetrievalConfig, retrieve
from ..memory.store import AtomStore
from ..commands import at_most

EVAL_CATEGORIES = (1, 2, 3, 4)


def _embedder(spec: Embedder | str | None) -> Embedder:
    if isinstance(spec, Embedder):
        return spec
    return make_embedder(spec or "minilm")


def run_many(path: str, strategies: Sequence[str], k: int = 10, embedder: Embedder | str | None = None,
             limit_conversations: int | None = None, skip_conversations: int = 0,
             configs: dict[str, dict] | None = None, **cfg: Any) -> list[dict]:
    """One result dict per strategy (or per named config in ``configs``: name -> retrieval options,
    each with a ``strategy`` key), all sharing one store per conversation."""
    for s in strategies:
        if s not in STRATEGIES:
            raise ValueError(f"unknown strategy {s!r}; expected one of {', '.join(STRATEGIES)}")
    runs = {s: dict(cfg, strategy=s) for s in strategies}
    runs.update(configs or {})
    for name, opts in runs.items():  # validate options before the expensive part
        RetrievalConfig.from_kwargs(**{key: v for key, v in opts.items() if key != "strategy"})
    emb = _embedder(embedder)
    convs = load_locomo(path)[skip_conversations:]
    if limit_conversations is not None:
        convs = convs[:limit_conversations]
    hits: dict[str, dict[int, list[float]]] = {name: {c: [] for c in EVAL_CATEGORIES} for name in runs}
    secs = {name: 0.0 for name in runs}
    t_all = time.perf_counter()
    embed_s = 0.0
    for conv in convs:
        qas = [q for q in conv.qa if q.category in EVAL_CATEGORIES and q.evidence]
        if not qas:
            continue
        store = AtomStore(f"bench-{uuid.uuid4().hex[:12]}", embedder=emb)
        try:
            t0 = time.perf_counter()
            store.create_many(turn_drafts(conv, store.keyword_limit))
            qvecs = emb.embed([q.question for q in qas])
            embed_s += time.perf_counter() - t0
            for name, opts in runs.items():
                opts = dict(opts)
                strategy = opts.pop("strategy")
                config = RetrievalConfig.from_kwargs(**opts)
                t0 = time.perf_counter()
                for q, vec in zip(qas, qvecs):
                    views = retrieve(store, q.question, k, strategy, query_embedding=vec.reshape(1, -1), config=config)
                    found = {sid for v in views for sid in v.atom.source_ids}
                    gold = list(dict.fromkeys(q.evidence))
                    hits[name][q.category].append(sum(e in found for e in gold) / len(gold))
                secs[name] += time.perf_counter() - t0
        finally:
            store.drop()
    out = []
    for name, opts in runs.items():
        per = hits[name]
        allv = [x for c in EVAL_CATEGORIES for x in per[c]]
        recall = {CATEGORIES[c]: round(100.0 * sum(per[c]) / len(per[c]), 1) if per[c] else None for c in EVAL_CATEGORIES}
        recall["all"] = round(100.0 * sum(allv) / len(allv), 1) if allv else None
        res = {"k": k, "questions": len(allv), "strategy": opts["strategy"], "recall_at_k": recall,
               "conversations": len(convs), "seconds": round(secs[name] + embed_s, 2),
               "retrieval_ms_per_question": round(1e3 * secs[name] / max(1, len(allv)), 2),
               "embedder": getattr(emb, "name", lambda: type(emb).__name__)()}
        if name != opts["strategy"]:
            res["config"] = name
        out.append(res)
    return out


def run(path: str, k: int = 10, strategy: str = "graph", embedder: Embedder | str | None = None,
        limit_conversations: int | None = None, skip_conversations: int = 0, **cfg: Any) -> dict:
    """Evidence recall@k of one strategy on a LoCoMo file (see the module docstring)."""
    return run_many(path, [strategy], k, embedder, limit_conversations, skip_conversations, **cfg)[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", choices=["locomo"], default="locomo", help="benchmark format (LoCoMo only)")
    parser.add_argument("--path", default=None, help="LoCoMo JSON file (default: the shipped locomo10.json)")
    parser.add_argument("--k", type=at_most(10**6), default=10, help="retrieved atoms per question (recall@k)")
    parser.add_argument("--strategy", choices=list(STRATEGIES) + ["all"], default="graph",
                        help="retrieval strategy; 'all' runs every strategy on shared stores")
    parser.add_argument("--embedder", default="minilm",
                        help="minilm (packaged all-MiniLM-L6-v2, default) | hashing[:DIM] | st:PATH | openai:URL#MODEL")
    parser.add_argument("--limit-conversations", type=at_most(10**6), default=None, help="only the first N conversations")
    parser.add_argument("--skip-conversations", type=at_most(10**6, 0), default=0, help="skip the first N conversations")
    parser.add_argument("--json", action="store_true", help="print JSON only")


def main(args: argparse.Namespace) -> int:
    if args.k < 1:
        raise SystemExit("--k must be positive")
    strategies = list(STRATEGIES) if args.strategy == "all" else [args.strategy]
    if args.path is None:
        from ..data import benchmark_file

        args.path = str(benchmark_file("locomo"))
    results = run_many(args.path, strategies, args.k, args.embedder, args.limit_conversations,
                       args.skip_conversations)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results))
        return 0
    cols = [CATEGORIES[c] for c in EVAL_CATEGORIES] + ["all"]
    print(f"evidence recall@{args.k} on {args.path} ({results[0]['questions']} questions)")
    print("| strategy | " + " | ".join(cols) + " | seconds |")
    print("|---" * (len(cols) + 2) + "|")
    for r in results:
        print(f"| {r['strategy']} | " + " | ".join(str(r["recall_at_k"][c]) for c in cols) + f" | {r['seconds']} |")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="atommem bench retrieval", description=__doc__.split("\n")[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
