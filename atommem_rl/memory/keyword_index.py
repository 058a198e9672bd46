"""BM25 keyword index over a store's active Primary atoms (``bm25s``, sparse-matrix BM25).

Algorithm. Each Primary atom is one document, tokenised with ``memory.text.terms`` (lower-case,
stop words removed, Snowball-stemmed: the same terms the atoms' keywords and the memory graph use).
``bm25s`` precomputes, per (term, document), the Lucene BM25 weight

    idf(t) * tf(t,d) * (k1 + 1) / (tf(t,d) + k1 * (1 - b + b * |d| / avgdl)),
    idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))

into a sparse matrix, so a query's score vector is a sum of the columns of its (distinct) terms.
Query terms unknown to the index contribute nothing. A candidate filter (an id set, e.g. the atoms
that pass a participant or time filter) is applied as bm25s's ``weight_mask``; atoms scoring 0 (no
shared term) are never returned.

Freshness. The index is rebuilt lazily on the next search after the store changed. The change key is
``(store.clock, len(store))``: ``clock`` ticks once per acknowledged write (create, update, delete,
relate) and ``len`` catches a dropped namespace. ``store.version`` is not used because it also bumps on
every *read* (the store logs reads), which would force a rebuild after every retrieval.
"""

from __future__ import annotations

from collections.abc import Collection

import bm25s
import numpy as np

from . import text as _text
from .atom import Role


def write_key(store) -> tuple[int, int]:
    """A key that changes whenever the store's atoms may have changed (see the module docstring)."""
    return (int(store.clock), len(store))


def query_terms(query: str) -> list[str]:
    """Distinct index terms of a query, first-seen order (a repeated word does not count twice)."""
    return list(dict.fromkeys(_text.terms(query)))


class KeywordIndex:
    """Lazily rebuilt BM25 index of one store's Primary atoms."""

    def __init__(self, store, *, k1: float = 1.2, b: float = 0.75, method: str = "lucene"):
        self.store = store
        self.k1, self.b, self.method = float(k1), float(b), method
        self._key: tuple[int, int] | None = None
        self._bm25: bm25s.BM25 | None = None
        self.ids: list[str] = []
        self.position: dict[str, int] = {}

    # ------------------------------------------------------------------ building
    def refresh(self) -> None:
        key = write_key(self.store)
        if key == self._key:
            return
        atoms = self.store.atoms(roles=(Role.PRIMARY,))
        self.ids = [a.id for a in atoms]
        self.position = {aid: i for i, aid in enumerate(self.ids)}
        corpus = [_text.terms(a.text) for a in atoms]
        self._bm25 = None
        if any(corpus):  # bm25s cannot index a corpus without a single term
            bm25 = bm25s.BM25(k1=self.k1, b=self.b, method=self.method)
            bm25.index(corpus, show_progress=False)
            self._bm25 = bm25
        self._key = key

    # ------------------------------------------------------------------ querying
    def scores(self, query: str, candidates: Collection[str] | None = None) -> np.ndarray:
        """BM25 score of every indexed atom (order: ``self.ids``); 0 outside ``candidates``."""
        self.refresh()
        n = len(self.ids)
        terms = query_terms(query)
        if self._bm25 is None or not terms or n == 0:
            return np.zeros(n, dtype=np.float32)
        mask = None
        if candidates is not None:
            mask = np.zeros(n, dtype=np.float32)
            idx = [self.position[c] for c in candidates if c in self.position]
            mask[idx] = 1.0
        return np.asarray(self._bm25.get_scores(terms, weight_mask=mask), dtype=np.float32)

    def search(self, query: str, k: int = 10, candidates: Collection[str] | None = None) -> list[tuple[str, float]]:
        """Top-``k`` (atom id, BM25 score), best first, ties by creation order; only scores > 0."""
        s = self.scores(query, candidates)
        if s.size == 0 or k < 1:
            return []
        hits = np.flatnonzero(s > 0)
        if hits.size > k:
            hits = hits[np.argpartition(-s[hits], k - 1)[:k]]
        hits = hits[np.lexsort((hits, -s[hits]))]
        return [(self.ids[i], float(s[i])) for i in hits]
