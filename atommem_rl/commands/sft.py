"""``atommem sft --config RECIPE [--key value ...]``: the supervised stage (see atommem_rl.training.sft).

The recipe is a YAML of flat keys, the fields of ``SFTRecipeConfig`` (TRL's ``SFTConfig`` and
``ModelConfig`` plus the demonstration source); ``--key value`` overrides any of them. The recipe is
validated before any work starts. ``atommem sft --help`` lists every field.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    # The flags are the config dataclass's fields, parsed by TRL's parser in atommem_rl.training.sft;
    # prefix_chars="+" makes this parser hand every "--key value" through to it untouched.
    p = sub.add_parser("sft", help="supervised fine-tuning on step-wise demonstrations",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       add_help=False, prefix_chars="+", usage="atommem sft --config RECIPE [--key value ...]")
    p.add_argument("args", nargs="*", metavar="--config RECIPE [--key value ...]",
                   help="a recipe and overrides: fields of SFTRecipeConfig (atommem sft --help lists them)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from trl import TrlParser

    from ..training.sft import SFTRecipeConfig, main as sft_main

    if "-h" in args.args or "--help" in args.args:
        TrlParser([SFTRecipeConfig], prog="atommem sft", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter).print_help()
        return 0
    return sft_main(args.args)
