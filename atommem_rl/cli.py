"""The ``atommem`` console script: one subcommand per module in ``atommem_rl.commands``.

Each command module defines ``register(subparsers)`` (adds its parser, sets ``func``) so that a
command's flags and its implementation live together; this file only lists them.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

# subcommand -> module in atommem_rl.commands (an import path, not a registry)
COMMANDS = {
    "quickstart": "quickstart",
    "grpo": "grpo",
    "ppo": "ppo",
    "bench": "bench",
    "sft": "sft",
    "data": "data",
    "rollout": "rollout",
    "eval": "eval",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atommem",
        description="AtomMem-RL: train language models to manage an atomic long-term memory.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        importlib.import_module(f"atommem_rl.commands.{module}").register(sub)
    return parser


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM (kill, scancel, a CI timeout) unwinds like Ctrl-C instead of killing the interpreter on
    # the spot: `finally` blocks drop their Chroma collections and vLLM's finalizers stop its engine
    # processes, which were left running, orphaned, when the default handler ended the process.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, ConnectionError, IsADirectoryError, NotADirectoryError,
            FileExistsError, PermissionError) as exc:
        # one line: a library's multi-line message (transformers lists its tokenizer loaders) is joined
        print(f"atommem {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    finally:
        _close_process_group()


def _close_process_group() -> None:
    """Destroy torch.distributed's process group if the command made one (accelerate launch). Left to
    interpreter exit, gloo's threads are torn down while joinable and a rank can abort ("terminate called
    without an active exception", SIGABRT) after finishing its work, which fails the whole launch."""
    torch = sys.modules.get("torch")  # never import torch just for this
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
