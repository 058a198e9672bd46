"""``atommem bench memory|retrieval|env|rollout|extractor|update|decode|memory-plan|serve``: measured figures as JSON on stdout.

Each benchmark lives in ``atommem_rl/bench/<name>.py`` with ``add_arguments(parser)`` and
``main(args)``; the module is imported only when its benchmark runs.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "memory": "store operations against raw Chroma calls; RWR against networkx",
    "retrieval": "evidence recall@k of a retrieval strategy on a LoCoMo-format file",
    "env": "environment overhead per step (parsing, memory ops, prompt assembly)",
    "rollout": "rollout throughput: Hugging Face generate against vLLM",
    "extractor": "fact-level precision/recall of an atomic fact extractor on held-out synthetic dialogues",
    "update": "GRPO policy update on real step samples: padded rows against prefix-shared packed rows",
    "decode": "Hugging Face decode step: sdpa attention against sdpa_grouped (no key/value copies)",
    "memory-plan": "peak memory per training GPU of a recipe's update under FSDP2, traced on fake tensors",
    "serve": "atommem serve's observe throughput: sessions batched through one policy call against one at a time",
}


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="run a benchmark and print its figures",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, help_text in BENCHMARKS.items():
        module = importlib.import_module(f"atommem_rl.bench.{name.replace('-', '_')}")
        p = kinds.add_parser(name, help=help_text, description=module.__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=module.main)
