"""Where the store's validated writes go: to Chroma at once, or into the write-behind buffer.

Write-through is the default: each write goes to Chroma (``send_new``, ``send_text``, ``send_meta``)
before the store commits it to its mirror.

``AtomStore(write_behind=N)``, opt-in; the environments use it with the in-memory backend only, where
nothing is durable anyway. A Chroma write costs milliseconds whatever its size, and an episode writes
a few atoms per step, so per-write round trips dominate a step. With write-behind the store's mirror
takes validated writes at once and :class:`PendingWrites` remembers, per atom id, what Chroma still
lacks: ``new`` (not in Chroma), ``full`` (new text and vector) or ``meta`` (metadata only: roles,
relations). The store flushes it when N writes are pending, before any other Chroma call (filtered
reads, events, profiles) and on ``flush()``: at most three calls (an ``add`` of new atoms, an
``update`` of re-embedded ones, a metadata ``update``), each split at Chroma's batch limit.

Unfiltered reads stay exact without a flush (:meth:`PendingWrites.search`): Chroma answers for the
atoms it holds current vectors for, the pending vectors are scored by exact cosine in numpy, and the
two lists are merged. A failed flush keeps every write pending, and its retry sends new and
re-embedded atoms with ``upsert``, which is idempotent whatever part had landed. Acknowledged but
pending writes are not durable: persistent and server backends therefore default to write-through.
(Exact reads of small namespaces, ``exact_below``, are another mechanism: ``exact.py``.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .atom import Atom, to_chroma_metadata
from .chroma_batches import add_all_or_nothing

if TYPE_CHECKING:
    from .store import AtomStore


class PendingWrites:
    """What Chroma lacks of the mirror, by atom id, with the vectors it has not received."""

    def __init__(self, size: int):
        self.size = size  # flush when this many atoms have pending writes
        self.kinds: dict[str, str] = {}  # atom id -> "new" | "full" (re-embedded) | "meta"
        self.vectors: dict[str, np.ndarray] = {}  # vectors Chroma does not have yet
        self.failed = False  # the last flush failed: the next one must be idempotent (upsert)

    def __len__(self) -> int:
        return len(self.kinds)

    @property
    def due(self) -> bool:
        return len(self.kinds) >= self.size

    def add_new(self, ids: Iterable[str], vectors) -> None:
        """Atoms Chroma has never seen."""
        for aid, v in zip(ids, vectors):
            self.kinds[aid] = "new"
            self.vectors[aid] = np.asarray(v, dtype=np.float32)

    def add_text(self, aid: str, vector) -> None:
        """New text and vector for an atom (still ``new`` if Chroma has not seen it yet)."""
        self.kinds[aid] = "new" if self.kinds.get(aid) == "new" else "full"
        self.vectors[aid] = np.asarray(vector, dtype=np.float32)

    def add_meta(self, ids: Iterable[str]) -> None:
        """Metadata changes (roles, relations); a pending text write already carries them."""
        for aid in ids:
            self.kinds.setdefault(aid, "meta")

    def clear(self) -> None:
        self.kinds.clear()
        self.vectors.clear()

    def flush(self, collection, atoms: Mapping[str, Atom], batch_size: int,
              call: Callable, refuse_existing: Callable[[list[str]], None]) -> None:
        """Send every pending write to ``collection``, the atoms' current state taken from ``atoms``,
        through ``call(what, fn, **kwargs)`` (the store's error-translating wrapper); ``refuse_existing``
        checks the ids of each ``add`` first (Chroma silently ignores an id it holds). Normally one
        ``add`` for new atoms, one ``update`` for re-embedded ones, one metadata ``update`` for the rest.
        A failed flush keeps everything pending; the retry sends new and re-embedded atoms with
        ``upsert``, which is idempotent whatever part had landed. (Upsert is not the normal path: with
        new and existing ids mixed in one call, Chroma 1.5.9's HNSW index missed true nearest neighbours
        in about 1 read in 200 in tests/test_write_behind.py.)"""
        if not self.kinds:
            return
        by_kind: dict[str, list[str]] = {"new": [], "full": [], "meta": []}
        for aid, kind in self.kinds.items():
            by_kind[kind].append(aid)
        # (ids, Chroma method, send text and vector, metadata as an update, ids must be new to Chroma)
        if self.failed:  # whatever landed before, upsert then a metadata update converge
            rewritten = by_kind["new"] + by_kind["full"]
            calls = [(rewritten, collection.upsert, True, False, False),
                     (rewritten, collection.update, False, True, False)]
        else:
            calls = [(by_kind["new"], collection.add, True, False, True),
                     (by_kind["full"], collection.update, True, True, False)]
        calls.append((by_kind["meta"], collection.update, False, True, False))
        self.failed = True  # until every call below has been acknowledged
        for ids_all, fn, with_text, for_update, adding in calls:
            for start in range(0, len(ids_all), batch_size):
                ids = ids_all[start : start + batch_size]
                if adding:
                    refuse_existing(ids)
                batch = [atoms[i] for i in ids]
                payload = {"metadatas": [to_chroma_metadata(a, for_update=for_update) for a in batch]}
                if with_text:
                    payload.update(documents=[a.text for a in batch],
                                   embeddings=np.stack([self.vectors[i] for i in ids]))
                call("writing pending atoms", fn, ids=ids, **payload)
        self.failed = False
        self.clear()

    def search(self, qvec: np.ndarray, n_fetch: int, n_atoms: int,
               query: Callable[[int], dict]) -> list[tuple[str, float]]:
        """(id, cosine) best first over a namespace of ``n_atoms`` atoms: Chroma's neighbours
        (``query(n)``, a Chroma query result with distances) among the atoms it holds current
        vectors for, merged with exact cosine over the pending vectors (a stale Chroma vector is
        never used)."""
        fresh = list(self.vectors)
        in_chroma = n_atoms - sum(1 for kind in self.kinds.values() if kind == "new")
        scored: list[tuple[str, float]] = []
        n = min(n_fetch + len(fresh), in_chroma)
        if n > 0:
            res = query(n)
            scored = [(aid, 1.0 - float(d)) for aid, d in zip(res["ids"][0], res["distances"][0])
                      if aid not in self.vectors]
        if fresh:
            m = np.stack([self.vectors[i] for i in fresh])
            q = qvec[0]
            denom = np.linalg.norm(m, axis=1) * (np.linalg.norm(q) or 1.0)
            cos = (m @ q) / np.where(denom > 0, denom, 1.0)
            scored.extend(zip(fresh, (float(c) for c in cos)))
        scored.sort(key=lambda x: -x[1])
        return scored


# ---------------------------------------------------------------- where a validated write goes
# Write-through (``write_behind=0``): to Chroma now, before the store commits it to its mirror, so a
# failed call leaves both as they were. Write-behind: into the store's PendingWrites.

def send_new(store: "AtomStore", atoms: Sequence[Atom], vectors) -> None:
    """New atoms: added in Chroma-sized batches, all or nothing (``chroma_batches.py``), or staged."""
    if store.write_behind:
        store._pending.add_new([a.id for a in atoms], vectors)
    else:
        add_all_or_nothing(store._chroma, store.collection, atoms, vectors, store.batch_size, store._refuse_existing)


def send_text(store: "AtomStore", atom: Atom, vector) -> None:
    """An atom's new text with its vector (``vector``: one row)."""
    if store.write_behind:
        store._pending.add_text(atom.id, vector[0])
    else:
        store._chroma("updating an atom", store.collection.update, ids=[atom.id], documents=[atom.text],
                      embeddings=vector, metadatas=[to_chroma_metadata(atom, for_update=True)])


def send_meta(store: "AtomStore", staged: Mapping[str, Atom], what: str) -> None:
    """Metadata (roles, relations) of several atoms, in one Chroma call."""
    ids = list(staged)
    if store.write_behind:
        store._pending.add_meta(ids)
    else:
        store._chroma(what, store.collection.update, ids=ids,
                      metadatas=[to_chroma_metadata(staged[i], for_update=True) for i in ids])
