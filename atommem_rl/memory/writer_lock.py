"""One writer per namespace on a persistent path, enforced with an OS file lock.

Each AtomStore keeps a mirror of its namespace that it updates only with its own writes, so a second
*process* writing the same namespace on the same ``chromadb.PersistentClient`` path would leave both
mirrors disagreeing with Chroma (and, before ids were writer-scoped, lose writes outright). A store
opened on a persistent path therefore takes an exclusive ``flock`` on
``<path>/atommem-locks/<namespace>.lock`` and holds it until ``close()``/``drop()`` or process exit
(the kernel releases it when the process dies, so a killed run leaves no stale lock). Another process
opening that namespace gets :class:`NamespaceLockedError` naming the path, the namespace and the
holder's pid. Stores in one process share the lock (the process is one writer: its code decides).

The in-memory backend lives in one process, and a ``chroma run`` server owns its path itself; neither
takes a lock (on a server, writer-scoped ids keep concurrent writers from colliding).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from .errors import MemoryStoreError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock, the rule is documented only
    fcntl = None


class NamespaceLockedError(MemoryStoreError):
    """Another process holds the namespace on this persistent path."""


_held: dict[Path, list] = {}  # lock file -> [open file, number of stores of this process using it]
_mutex = threading.Lock()


def persistent_path(client) -> str | None:
    """The folder of a ``PersistentClient``, or None for in-memory and server clients."""
    try:
        s = client.get_settings()
    except Exception:  # noqa: BLE001 - not a Chroma client we know: nothing to lock
        return None
    return s.persist_directory if getattr(s, "is_persistent", False) and s.persist_directory else None


def acquire(client, namespace: str) -> Path | None:
    """Take (or share, within this process) the namespace's lock; None when no lock applies."""
    path = persistent_path(client)
    if path is None or fcntl is None:
        return None
    lock = Path(path).resolve() / "atommem-locks" / f"{namespace}.lock"
    with _mutex:
        if lock in _held:
            _held[lock][1] += 1
            return lock
        lock.parent.mkdir(parents=True, exist_ok=True)
        fh = open(lock, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            fh.close()
            raise NamespaceLockedError(
                f"namespace {namespace!r} on {path} is open in another process (pid {holder}); one process "
                "writes a namespace on a persistent path: wait for it to finish, or share the store through "
                "a chroma run server") from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        _held[lock] = [fh, 1]
        return lock


def release(lock: Path | None) -> None:
    """Give back one use of ``lock``; the file lock goes when the last store of the process lets go."""
    if lock is None:
        return
    with _mutex:
        entry = _held.get(lock)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _held[lock]
            entry[0].close()  # closing the file releases the flock
