"""The shared shape of the training-stage commands (``atommem sft|grpo|ppo``).

``atommem <stage> --config RECIPE [--key value ...]``: the recipe is a YAML of flat keys, the fields
of the stage's config dataclass (TRL's config plus ours); ``--key value`` overrides any of them and
the recipe is validated before any work starts. ``atommem <stage> --help`` lists every field.
"""

from __future__ import annotations

import argparse
import importlib


def stage_command(name: str, help_text: str, module: str, config: str):
    """A ``register(subparsers)`` for a stage whose entry point is ``<module>.main(argv)`` and whose
    config class is ``<module>.<config>`` (imported only when the command runs)."""

    def main(args: argparse.Namespace) -> int:
        mod = importlib.import_module(module)
        if "-h" in args.args or "--help" in args.args:
            from trl import TrlParser

            TrlParser([getattr(mod, config)], prog=f"atommem {name}", description=mod.__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter).print_help()
            return 0
        return mod.main(args.args)

    def register(sub: argparse._SubParsersAction) -> None:
        # the flags are the config's fields, parsed by TRL's parser in the stage module;
        # prefix_chars="+" makes this parser hand every "--key value" through untouched
        p = sub.add_parser(name, help=help_text, description=__doc__, add_help=False, prefix_chars="+",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           usage=f"atommem {name} --config RECIPE [--key value ...]")
        p.add_argument("args", nargs="*", metavar="--config RECIPE [--key value ...]",
                       help=f"a recipe and overrides: fields of {config} (atommem {name} --help lists them)")
        p.set_defaults(func=main)

    return register
