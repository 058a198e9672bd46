"""One module per ``atommem`` subcommand (see ``atommem_rl/cli.py``), plus the argparse value types
they share: a number that means nothing (a batch of 0 episodes, a NaN temperature) is refused by
argparse itself, one line naming the flag, before anything is loaded."""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    n = _int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def at_most(limit: int, minimum: int = 1):
    """An integer in ``minimum..limit`` (a count, by default at least 1): beyond ``limit`` a run would
    never finish (10**20 tasks)."""

    def parse(text: str) -> int:
        n = positive_int(text) if minimum == 1 else nonneg_int(text) if minimum == 0 else _int(text)
        if n < minimum:
            raise argparse.ArgumentTypeError(f"expected at least {minimum}, got {text!r}")
        if n > limit:
            raise argparse.ArgumentTypeError(f"expected at most {limit}, got {text!r}")
        return n

    return parse


def count_list(limit: int):
    """Comma-separated positive integers, each at most ``limit`` ("1000,10000"); empty means none."""
    one = at_most(limit)

    def parse(text: str) -> list[int]:
        return [one(x.strip()) for x in text.split(",") if x.strip()]

    return parse


def nonneg_int(text: str) -> int:
    n = _int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return n


def seed_int(text: str) -> int:
    n = _int(text)
    if not 0 <= n < 2**32:  # numpy and torch seeds
        raise argparse.ArgumentTypeError(f"expected a seed in 0..4294967295, got {text!r}")
    return n


def nonneg_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(x) or x < 0:
        raise argparse.ArgumentTypeError(f"expected a finite non-negative number, got {text!r}")
    return x


def fraction(text: str) -> float:
    """A number in (0, 1]: a share of memory, a threshold."""
    x = nonneg_float(text)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return x


def unit_float(text: str) -> float:
    """A number in [0, 1]: a score threshold."""
    x = nonneg_float(text)
    if x > 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return x


def positive_float(text: str) -> float:
    x = nonneg_float(text)
    if x == 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return x


def input_file(path: str, what: str) -> Path:
    """``path`` as a file to read: missing or a folder is a one-line error naming it."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{what} {p} does not exist")
    if not p.is_file():
        raise ValueError(f"{what} {p} is a folder, expected a file")
    return p


def _nearest_existing_parent_is_a_folder(p: Path, what: str) -> Path:
    """``p`` unchanged, unless the nearest of its parents that exists is a file (the folders to make
    under it cannot be made): then a one-line error naming both."""
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{what} {p}: {parent} is a file, not a folder")
            break
    return p


def output_file(path: str, what: str) -> Path:
    """``path`` as a file to write: an existing folder there (or a file where its folder should be)
    is a one-line error naming it, raised before any work."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {p} is a folder, expected a file path")
    return _nearest_existing_parent_is_a_folder(p, what)


def output_dir(path: str, what: str) -> Path:
    """``path`` as a folder to write into: an existing file there is a one-line error naming it."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{what} {p} is an existing file, expected a folder")
    return _nearest_existing_parent_is_a_folder(p, what)
