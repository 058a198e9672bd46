"""``atommem grpo --config RECIPE [--key value ...]``: step-wise GRPO (see atommem_rl.training.grpo).

The recipe is a YAML of flat keys, the fields of ``GRPORecipeConfig`` (TRL's ``GRPOConfig`` and
``ModelConfig`` plus the task source and environment settings); ``--key value`` overrides any of
them. The recipe is validated before any work starts. ``atommem grpo --help`` lists every field.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    # flags are the config's fields, parsed by TRL's parser; prefix_chars="+" passes them through
    p = sub.add_parser("grpo", help="GRPO on step-wise memory episodes", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False, prefix_chars="+",
                       usage="atommem grpo --config RECIPE [--key value ...]")
    p.add_argument("args", nargs="*", metavar="--config RECIPE [--key value ...]",
                   help="a recipe and overrides: fields of GRPORecipeConfig (atommem grpo --help lists them)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from trl import TrlParser

    from ..training.grpo import GRPORecipeConfig, main as grpo_main

    if "-h" in args.args or "--help" in args.args:
        TrlParser([GRPORecipeConfig], prog="atommem grpo", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter).print_help()
        return 0
    return grpo_main(args.args)
