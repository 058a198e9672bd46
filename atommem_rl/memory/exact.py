"""Exact cosine search over a small namespace's vectors, in process.

An environment's memory holds hundreds to a few thousand atoms, and an unfiltered read of it through
Chroma costs 1.5-3 ms at 1k atoms here (a fixed cost of the Rust bindings and the HNSW walk, cold
between steps), while scoring every vector with one matrix product costs about 0.05 ms and is exact
rather than approximate. ``AtomStore(exact_below=N)`` keeps every atom's current vector in a
:class:`VectorMirror` and answers unfiltered reads of namespaces up to N atoms from it; Chroma still
receives every write, answers filtered reads and larger namespaces, and is what a reopened store
loads from. (A library kNN index would add a dependency to do less than this one product does at
this size.)
"""

from __future__ import annotations

import numpy as np


class VectorMirror:
    """Unit-normalised vectors by atom id in one growing matrix."""

    def __init__(self) -> None:
        self._mat: np.ndarray | None = None
        self._row: dict[str, int] = {}
        self._ids: list[str] = []

    def __len__(self) -> int:
        return len(self._ids)

    def put(self, ids: list[str], vectors) -> None:
        """Insert or replace the vectors of ``ids`` (rows of ``vectors``)."""
        vecs = np.asarray(vectors, dtype=np.float32).reshape(len(ids), -1)
        norms = np.linalg.norm(vecs, axis=1, keepdims=True)
        vecs = vecs / np.where(norms > 0, norms, 1.0)
        if self._mat is None:
            self._mat = np.zeros((max(64, len(ids)), vecs.shape[1]), dtype=np.float32)
        for aid, v in zip(ids, vecs):
            row = self._row.get(aid)
            if row is None:
                row = self._row[aid] = len(self._ids)
                self._ids.append(aid)
                if row >= len(self._mat):  # grow by doubling: amortised O(1) per insert
                    grown = np.zeros((2 * len(self._mat), self._mat.shape[1]), dtype=np.float32)
                    grown[: len(self._mat)] = self._mat
                    self._mat = grown
            self._mat[row] = v

    def search(self, query, n: int) -> list[tuple[str, float]]:
        """The ``n`` most cosine-similar ids, best first, as (id, cosine)."""
        if self._mat is None or not self._ids or n <= 0:
            return []
        q = np.asarray(query, dtype=np.float32).reshape(-1)
        qn = float(np.linalg.norm(q)) or 1.0
        scores = self._mat[: len(self._ids)] @ (q / qn)
        n = min(n, len(scores))
        top = np.argpartition(-scores, n - 1)[:n] if n < len(scores) else np.arange(len(scores))
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(self._ids[i], float(scores[i])) for i in top]

    def clear(self) -> None:
        self.__init__()
