"""``atommem ppo --config RECIPE [--key value ...]``: step-wise PPO (see atommem_rl.training.ppo).

The recipe is a YAML of flat keys, the fields of ``PPORecipeConfig`` (TRL's ``GRPOConfig`` (its clipped loss and KL are reused) and
``ModelConfig`` plus the task source and environment settings); ``--key value`` overrides any of
them. The recipe is validated before any work starts. ``atommem ppo --help`` lists every field.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    # flags are the config's fields, parsed by TRL's parser; prefix_chars="+" passes them through
    p = sub.add_parser("ppo", help="PPO (critic + GAE) on step-wise memory episodes", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False, prefix_chars="+",
                       usage="atommem ppo --config RECIPE [--key value ...]")
    p.add_argument("args", nargs="*", metavar="--config RECIPE [--key value ...]",
                   help="a recipe and overrides: fields of PPORecipeConfig (atommem ppo --help lists them)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from trl import TrlParser

    from ..training.ppo import PPORecipeConfig, main as ppo_main

    if "-h" in args.args or "--help" in args.args:
        TrlParser([PPORecipeConfig], prog="atommem ppo", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter).print_help()
        return 0
    return ppo_main(args.args)
