"""Resumable phases: a phase whose settings (and upstream results) are unchanged is not run again.

Algorithm. Each phase has a name, a JSON-able settings dict and the names of the phases it depends
on. Its *key* is the SHA-256 of the settings plus the *stamps* of its dependencies; its stamp is the
key plus the time it finished. When ``<out>/phases/<name>.json`` holds the same key, the phase is
skipped and its recorded result is returned; otherwise it runs and the marker is written only after
it succeeded (a phase killed half-way leaves no marker, so the next run redoes it). Because a stamp
changes whenever a phase reruns, everything downstream of a rerun phase reruns too.

A marker also stands for the phase's output files: it records their SHA-256 (``outputs``: files, or
folders meaning their top-level files), and a phase is skipped only when every one is still there with
the same content; a truncated model or an edited task file makes the phase (and what follows) rerun.

Training phases additionally resume *inside* the phase: :meth:`Phases.work_dir` gives the phase an
output folder tagged with its key; a folder left by an unfinished attempt with the same key is kept
(the trainers resume from its last ``checkpoint-N``), a folder written under other settings is
removed first, because resuming from it would mix two configurations. A folder without the tag that
holds files was not written by the pipeline (a stage run by hand into the same folder): it is never
removed; the run stops with an error naming it. A phase may tag its folder
with a key of fewer settings (``folder_settings``): a training run made longer (more ``max_steps``
under a constant learning rate) then continues from the shorter run's checkpoints instead of starting
over, while the phase itself still reruns because its full key changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

KEY_FILE = "pipeline_key.txt"


def digest_files(paths) -> dict[str, str]:
    """SHA-256 of each file, a folder standing for its top-level files (checkpoint-N/ subfolders are the
    trainer's business), keyed by path."""
    out = {}
    for p in map(Path, paths):
        for f in (sorted(x for x in p.iterdir() if x.is_file() and x.name != KEY_FILE) if p.is_dir() else [p]):
            with f.open("rb") as fh:
                out[str(f)] = hashlib.file_digest(fh, "sha256").hexdigest()
    return out


def changed_outputs(recorded: dict[str, str]) -> list[str]:
    """The recorded outputs that are gone or whose content differs now."""
    bad = []
    for name, sha in recorded.items():
        p = Path(name)
        try:
            if not p.is_file() or digest_files([p])[name] != sha:
                bad.append(name)
        except OSError:
            bad.append(name)
    return bad


def check_owned(folder: str | Path) -> None:
    """Raise unless ``folder`` is absent, empty or tagged by the pipeline (``KEY_FILE``): a run never
    removes what it did not write."""
    folder = Path(folder)
    if folder.is_dir() and not (folder / KEY_FILE).exists() and any(folder.iterdir()):
        raise ValueError(f"{folder} holds files the quickstart did not write (no {KEY_FILE}), which it would "
                         "replace: move them, or choose another --out")
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file where the quickstart writes a folder: move it, or choose another --out")


def settings_key(settings: dict, deps: dict[str, str]) -> str:
    blob = json.dumps({"settings": settings, "deps": deps}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class Phases:
    """Runs named phases into ``out``; ``log`` gets one line per phase (started, skipped, finished)."""

    def __init__(self, out: str | Path, force: bool = False, total: int | None = None, log: Callable = print):
        self.out = Path(out)
        self.dir = self.out / "phases"  # made when the first phase runs: a run refused before that makes nothing
        self.force, self.total, self.log = force, total, log
        self.markers: dict[str, dict] = {}
        self.ran: dict[str, bool] = {}
        self._folder_keys: dict[str, str] = {}
        self._n = 0

    def marker_path(self, name: str) -> Path:
        return self.dir / f"{name}.json"

    def key(self, name: str, settings: dict, deps: tuple[str, ...] = ()) -> str:
        missing = [d for d in deps if d not in self.markers]
        if missing:
            raise RuntimeError(f"phase {name!r} depends on {missing}, which have not run")
        return settings_key(settings, {d: self.markers[d]["stamp"] for d in deps})

    def run(self, name: str, settings: dict, fn: Callable[[], Any], deps: tuple[str, ...] = (),
            title: str | None = None, folder_settings: dict | None = None, outputs: Callable | None = None) -> Any:
        """``folder_settings`` (default ``settings``): what the phase's :meth:`work_dir` must have been
        written under to be kept. ``outputs()``: the files (or folders) the phase wrote, hashed into the
        marker and checked before the marker is trusted."""
        self._n += 1
        head = f"[{self._n}/{self.total or '?'}] {title or name}"
        key = self.key(name, settings, deps)
        self._folder_keys[name] = key if folder_settings is None else self.key(name, folder_settings, deps)
        path = self.marker_path(name)
        old = None
        if path.exists():
            try:
                old = json.loads(path.read_text())
            except json.JSONDecodeError:
                old = None  # a marker cut short by a crash: the phase simply reruns
        if old and old.get("key") == key and not self.force:
            bad = changed_outputs(old.get("outputs") or {})
            if not bad:
                self.log(f"{head}: done already ({old['seconds']:.0f} s on {old['finished']}); skipped")
                self.markers[name], self.ran[name] = old, False
                return old["result"]
            self.log(f"{head}: its output {bad[0]} is missing or changed since it finished"
                     + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "") + "; running it again")
        self.log(f"{head}: running")
        self.dir.mkdir(parents=True, exist_ok=True)
        t0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        seconds = time.perf_counter() - t0
        # CPU seconds of all this process's threads: on a shared machine wall time says little, and
        # CPU time / cores bounds what the phase needs on an idle one
        cpu = time.process_time() - c0
        finished = time.strftime("%Y-%m-%d %H:%M:%S")
        marker = {"name": name, "key": key, "stamp": settings_key({"key": key, "finished": finished}, {}),
                  "settings": settings, "deps": list(deps), "result": result, "seconds": round(seconds, 1),
                  "cpu_seconds": round(cpu, 1), "load_average": [round(x, 1) for x in os.getloadavg()],
                  "finished": finished, "outputs": digest_files(outputs()) if outputs else {}}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(marker, indent=2, default=str))
        tmp.replace(path)  # atomic: a marker is either whole or absent
        self.markers[name], self.ran[name] = marker, True
        self.log(f"{head}: finished in {seconds:.0f} s ({cpu:.0f} CPU s)")
        return result

    def work_dir(self, name: str, folder: str | Path) -> Path:
        """``folder`` prepared for phase ``name`` (call inside the phase's function, after ``run``
        computed its key): kept when tagged with the same folder key (resume), emptied otherwise."""
        folder = Path(folder)
        key = self._folder_keys[name]
        tag = folder / KEY_FILE
        check_owned(folder)
        if folder.exists() and (not tag.exists() or tag.read_text().strip() != key or self.force):
            if self.out.resolve() not in folder.resolve().parents:
                raise RuntimeError(f"refusing to clear {folder}: it is outside the pipeline folder {self.out}")
            if tag.exists():
                self.log(f"{name}: clearing {folder}, written under other settings")
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tag.write_text(key + "\n")
        return folder
