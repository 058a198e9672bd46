"""Modules of one concern: no ``.py`` file under ``atommem_rl/`` or ``envs/`` over 400 lines (issue 39, item 6).

A module that grows past the limit is split along a real seam (its records, an algorithm, a cache, the
settings) into modules of one concern each, not cut at a line; the failure lists every offender with its
line count, largest first, so one run shows all the work.

    .venv/bin/python -m pytest tests/test_module_size.py -q
"""

from __future__ import annotations

from .conftest import REPO

PACKAGES = ("atommem_rl", "envs")
MAX_LINES = 400


def line_counts() -> dict[str, int]:
    """Repository-relative path -> number of lines, for every ``.py`` file of the packages."""
    out = {}
    for pkg in PACKAGES:
        for p in sorted((REPO / pkg).rglob("*.py")):
            with p.open("rb") as fh:  # bytes: a stray non-UTF-8 byte must not hide a long file
                out[str(p.relative_to(REPO))] = sum(1 for _ in fh)
    return out


def offenders(counts: dict[str, int], limit: int = MAX_LINES) -> list[tuple[str, int]]:
    return sorted(((p, n) for p, n in counts.items() if n > limit), key=lambda x: (-x[1], x[0]))


def test_offenders_are_found_and_ordered():
    counts = {"a.py": 400, "b.py": 401, "c.py": 900, "d.py": 12}
    assert offenders(counts) == [("c.py", 900), ("b.py", 401)]
    assert offenders(counts, limit=1000) == []


def test_counts_cover_both_packages():
    counts = line_counts()
    assert "atommem_rl/memory/events.py" in counts and "envs/core.py" in counts
    assert all(n > 0 for p, n in counts.items() if not p.endswith("__init__.py"))


def test_no_module_over_400_lines():
    found = offenders(line_counts())
    assert not found, (f"{len(found)} module(s) over {MAX_LINES} lines (split each along a seam of one concern): "
                       + ", ".join(f"{p} ({n})" for p, n in found))
