"""The ``atommem`` console script: one subcommand per module in ``atommem_rl.commands``.

Each command module defines ``register(subparsers)`` (adds its parser, sets ``func``) so that a
command's flags and its implementation live together; this file only lists them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
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
    "serve": "serve",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atommem",
        description="AtomMem-RL: train language models to manage an atomic long-term memory.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        importlib.import_module(f"atommem_rl.commands.{module}").register(sub)
    return parser


def _version() -> str:
    """The installed distribution's version (pyproject.toml's, via the package metadata pip wrote)."""
    try:
        return importlib.metadata.version("atommem-rl")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed: pip install -e .)"


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    from .cli_refusal import HeldNotices, OutputFolders, StdoutKeptForOutput

    # trl.experimental warns on import that its APIs may change; the project pins TRL and imports
    # TreeRow from there on purpose, so the notice is for TRL's developers, not for a user's terminal
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    StdoutKeptForOutput.install()  # a --json command's stdout is its JSON, nothing a library printed on import
    args = build_parser().parse_args(argv)
    # SIGTERM (kill, scancel, a CI timeout) unwinds like Ctrl-C instead of killing the interpreter on
    # the spot: `finally` blocks drop their Chroma collections and vLLM's finalizers stop its engine
    # processes, which were left running, orphaned, when the default handler ended the process.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # a command that fails leaves no empty output folder behind, and a refusal reads as its one line
    folders, notices = OutputFolders.of(args), HeldNotices.install()
    rc = 1
    try:
        rc = int(args.func(args) or 0)
        return rc
    except KeyboardInterrupt:
        rc = 130
        return rc
    except (ValueError, FileNotFoundError, ConnectionError, IsADirectoryError, NotADirectoryError,
            FileExistsError, PermissionError) as exc:
        rc = 2
        notices.close(refused=True)
        # one line: a library's multi-line message (transformers lists its tokenizer loaders) is joined
        print(f"atommem {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return rc
    finally:
        notices.close(refused=rc == 2)
        if rc != 0:
            folders.remove_new_empty()
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
