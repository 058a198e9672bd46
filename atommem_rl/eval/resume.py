"""Resuming an evaluation: ``records.partial.jsonl``, the finished (method, dataset) pairs of a run so far.

:func:`~atommem_rl.eval.harness.evaluate` appends every finished pair's records to it and removes it when the
run completes; with ``resume`` a rerun whose fingerprint (settings, the datasets' contents, the named models'
files) matches skips the pairs recorded there, so a run that is killed loses only the pair in progress.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from atommem_rl.tasks.schema import Task


class _Partial:
    """``records.partial.jsonl``: a header line (the run's fingerprint: settings, a SHA-256 of each
    dataset's tasks, the caller's extra settings such as model paths, and name, size and mtime of the
    top-level files of the folders those name: ``_tasks_digest``, ``_files_digest``), then ``{"method_info": ...}`` and
    ``{"record": ...}`` lines as (method, dataset) pairs finish. A pair counts as done when all its
    tasks' records are there; a file whose header differs from this run is not resumed from."""

    def __init__(self, path: Path, settings, datasets: dict, extra: dict | None, log):
        from dataclasses import asdict

        self.path, self.log = path, log
        # contents, not names: a task file edited under the same ids, or a model retrained in the same
        # folder, must not be resumed from (a resumed run mixed old and new records, exit status 0)
        self.header = json.loads(json.dumps({"settings": asdict(settings), "extra": extra or {},
                                             "datasets": {d: _tasks_digest(ts) for d, ts in datasets.items()},
                                             "files": _files_digest(extra or {})}, default=str))
        self.sizes = {d: len(ts) for d, ts in datasets.items()}
        self.records: list[dict] = []
        self.method_info: dict[str, dict] = {}

    def load(self) -> set[tuple[str, str]]:
        if not self.path.exists():
            return set()
        lines = []
        for x in self.path.read_text(encoding="utf-8").splitlines():
            try:
                lines.append(json.loads(x))
            except ValueError:  # the line being written when the run was killed
                break
        if not lines or lines[0].get("header") != self.header:
            self.log(json.dumps({"resume": str(self.path), "skipped": "settings, datasets or models differ: starting over"}))
            return set()
        recs = [x["record"] for x in lines[1:] if "record" in x]
        count: dict[tuple[str, str], int] = {}
        for r in recs:
            count[(r["method"], r["dataset"])] = count.get((r["method"], r["dataset"]), 0) + 1
        done = {k for k, n in count.items() if n == self.sizes.get(k[1])}
        self.records = [r for r in recs if (r["method"], r["dataset"]) in done]
        for x in lines[1:]:
            self.method_info.update({m: i for m, i in (x.get("method_info") or {}).items()
                                     if any(k[0] == m for k in done)})
        self.log(json.dumps({"resume": str(self.path), "done": sorted(f"{m}/{d}" for m, d in done)}))
        return done

    def start(self, keep: bool) -> None:
        """Rewrite the file with the header and what is kept (a torn last line is dropped)."""
        with self.path.open("w", encoding="utf-8") as fh:
            fh.write(json.dumps({"header": self.header}) + "\n")
            if keep:
                for m, info in self.method_info.items():
                    fh.write(json.dumps({"method_info": {m: info}}, default=str) + "\n")
                for r in self.records:
                    fh.write(json.dumps({"record": r}, default=str) + "\n")

    def write(self, obj: dict) -> None:
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(obj, default=str) + "\n")

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def _tasks_digest(tasks: list[Task]) -> dict:
    blob = json.dumps([t.to_dict() for t in tasks], sort_keys=True, default=str).encode()
    return {"tasks": len(tasks), "sha256": hashlib.sha256(blob).hexdigest()}


def _files_digest(extra: dict) -> dict[str, list]:
    """Every existing file or folder the caller's settings name (models, checkpoints, extractor) ->
    (name, size, mtime) of its files; weights are not read whole: a retrained or copied model changes
    these, and hashing gigabytes at every resume would cost more than the check is worth."""
    paths: list[str] = []

    def walk(v):
        if isinstance(v, str):
            paths.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk({k: v for k, v in extra.items() if k != "task_files"})  # tasks are hashed by content
    out = {}
    for p in map(Path, sorted(set(paths))):
        try:
            if p.is_dir():
                out[str(p)] = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(p.iterdir()) if f.is_file()]
            elif p.is_file():
                out[str(p)] = [[p.name, p.stat().st_size, p.stat().st_mtime_ns]]
        except OSError:
            continue
    return out
