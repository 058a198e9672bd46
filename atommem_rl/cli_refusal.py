"""What a refused ``atommem`` command leaves behind: its one-line error, and nothing else.

* ``OutputFolders``: the output folders a command will write (``--out``; a training stage's
  ``output_dir`` or ``checkpoints/<run_name>``) are looked at before it runs; when it fails, every folder
  under them that it made and left empty is removed again (``os.rmdir`` removes only empty folders, so
  nothing written is ever lost, and folders that existed before are never touched).
* ``HeldNotices``: stderr lines that report a setting rather than a problem (``auto_bf16: ...``, printed
  while a recipe is parsed, before the inputs are checked) are held until the command writes anything
  else to stderr, and dropped when it is refused, so a refusal reads as its one line.
* ``StdoutKeptForOutput``: a library's import-time notice printed to stdout (transformers prints
  ``[INFO] Running in WANDB offline mode`` under ``WANDB_MODE=offline``) goes to stderr instead, so a
  command's ``--json`` output stays one JSON document.

    folders, notices = OutputFolders.of(args), HeldNotices.install()
    ...                              # the command
    notices.close(refused=True); folders.remove_new_empty()
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

# stderr lines that state a choice the command made (shown with the run's output, dropped on refusal)
NOTICE_PREFIXES = ("auto_bf16:",)
STAGES = ("sft", "grpo", "ppo")


def _dirs(root: Path) -> set[Path]:
    return {Path(p) for p, _, _ in os.walk(root)} if root.is_dir() else set()


def stage_output(argv: list[str]) -> Path | None:
    """A training stage's output folder from its ``--config RECIPE [--key value ...]`` words: ``output_dir``
    when set, else the run folder ``checkpoints/<run_name>`` (YAML read only; None when there is no
    readable recipe, which the stage itself then refuses)."""
    from atommem_rl.training.recipes import raw_value, run_dir

    if "--config" not in argv or argv.index("--config") + 1 >= len(argv):
        return None
    i = argv.index("--config")
    recipe, overrides = argv[i + 1], argv[:i] + argv[i + 2:]
    try:
        out = raw_value(recipe, "output_dir", overrides)
        return Path(out) if out else Path(run_dir(recipe, overrides))
    except Exception:  # noqa: BLE001 - an unreadable recipe is the stage's error to report, not ours
        return None


class OutputFolders:
    """The folders under ``roots`` (and the missing parents of each root) that exist before a command."""

    def __init__(self, roots: list[Path]):
        self.roots = [r.absolute() for r in roots]
        self.before = {r: _dirs(r) | {p for p in (r, *r.parents) if p.is_dir()} for r in self.roots}

    @classmethod
    def of(cls, args: argparse.Namespace) -> OutputFolders:
        roots: list[Path] = []
        if getattr(args, "command", None) in STAGES:
            out = stage_output(list(args.args))
            roots += [out] if out is not None else []
        elif isinstance(getattr(args, "out", None), str) and args.command in ("eval", "quickstart"):
            roots.append(Path(args.out))
        return cls(roots)

    def remove_new_empty(self) -> list[Path]:
        """Remove the folders made since ``__init__`` that are empty, deepest first; returns those removed."""
        removed = []
        for root in self.roots:
            new = (_dirs(root) | {p for p in (root, *root.parents) if p.is_dir()}) - self.before[root]
            for d in sorted(new, key=lambda p: len(p.parts), reverse=True):
                try:
                    d.rmdir()
                    removed.append(d)
                except OSError:  # not empty (the command wrote something there) or already gone
                    pass
        return removed


class HeldNotices:
    """A stand-in for ``sys.stderr`` that holds notice lines until something else is written."""

    def __init__(self, stream):
        self.stream = stream
        self.held: list[str] = []
        self.in_notice = False  # print() writes the text and its newline in two calls

    @classmethod
    def install(cls) -> HeldNotices:
        held = cls(sys.stderr)
        sys.stderr = held
        return held

    def write(self, s: str) -> int:
        if self.in_notice or s.startswith(NOTICE_PREFIXES):
            self.held.append(s)
            self.in_notice = "\n" not in s
            return len(s)
        self.release()
        return self.stream.write(s)

    def release(self) -> None:
        if self.held:
            self.stream.write("".join(self.held))
            self.held, self.in_notice = [], False

    def close(self, refused: bool) -> None:
        """Put the real stderr back; the held notices are shown unless the command was refused."""
        if refused:
            self.held = []
        self.release()
        if sys.stderr is self:
            sys.stderr = self.stream

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):  # fileno, isatty, encoding, ... of the real stream
        return getattr(self.stream, name)


class StdoutKeptForOutput(importlib.abc.MetaPathFinder):
    """Runs the imports in ``MODULES`` with stdout sent to stderr: each prints a notice to stdout when it is
    imported. A finder rather than an eager import: the module costs seconds to import and most commands
    never need it."""

    MODULES = ("transformers.integrations.integration_utils",)

    @classmethod
    def install(cls) -> None:
        if not any(isinstance(f, cls) for f in sys.meta_path):
            sys.meta_path.insert(0, cls())

    def find_spec(self, name, path, target=None):
        if name not in self.MODULES or name in sys.modules:
            return None
        sys.meta_path.remove(self)  # find the real spec with the ordinary finders (and never recurse)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            with contextlib.redirect_stdout(sys.stderr):
                run(module)

        spec.loader.exec_module = exec_module  # this file's own loader instance, made for this spec
        return spec
