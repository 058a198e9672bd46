"""Run ``atommem`` in this process (fast: no interpreter start, imports shared) with a time bound, and
compare folder trees before and after a run (what it wrote or removed)."""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Result:
    rc: int | None  # None: still running at the time bound
    stdout: str
    stderr: str
    seconds: float
    exception: BaseException | None = None  # escaped main(): a traceback for the user


def run_cli(argv: list[str], timeout: float = 60.0) -> Result:
    """``atommem argv`` in a daemon thread (a hang cannot hold the test run past ``timeout``)."""
    from atommem_rl.cli import main

    out, err, box = io.StringIO(), io.StringIO(), {}

    def target():
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                box["rc"] = main(list(argv))
            except SystemExit as exc:  # argparse errors exit 2
                box["rc"] = exc.code if isinstance(exc.code, int) else 1
            except BaseException as exc:  # noqa: BLE001 - what the user would see as a traceback
                box["exc"] = exc
                box["rc"] = 1

    t0 = time.perf_counter()
    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(timeout)
    return Result(box.get("rc") if not th.is_alive() else None, out.getvalue(), err.getvalue(),
                  time.perf_counter() - t0, box.get("exc"))


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """path -> (size, mtime_ns) of every file and folder under ``root``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size if p.is_file() else 0, st.st_mtime_ns if p.is_file() else 0)
    return out


def changed_outside(before: dict, after: dict, allowed: tuple[str, ...]) -> list[str]:
    """Paths added, removed or modified that are not under one of ``allowed`` (relative folders)."""
    keys = set(before) | set(after)
    bad = [k for k in keys if before.get(k) != after.get(k)]
    return sorted(k for k in bad if not any(k == a or k.startswith(a.rstrip("/") + "/") for a in allowed))


def error_line(res: Result) -> str:
    """The one line the user is told (argparse puts its usage first; that is not the error)."""
    lines = [x for x in res.stderr.splitlines() if x.strip() and not x.startswith(("usage:", " "))]
    return lines[-1] if lines else ""
