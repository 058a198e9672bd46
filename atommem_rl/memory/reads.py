"""How ``AtomStore.read`` finds its top k: which of three scorers answers, and what it keeps.

    exact mirror   an unfiltered read of a namespace of at most ``exact_below`` atoms: exact cosine
                   over every atom's vector in process (``exact.py``), no Chroma call
    pending merge  an unfiltered read with write-behind writes pending: Chroma's neighbours among
                   the atoms it holds current vectors for, merged with exact cosine over the pending
                   vectors (``write_behind.py``), so no flush is needed
    Chroma         otherwise, one query, with a ``where`` filter (``filters.py``) only when the read
                   filters by participant or time or when many atoms are hidden

Chroma answers a ``where`` query by scanning metadata (linear in the namespace: 2.6 s at 100k atoms
here); when few atoms are hidden (evidence, deleted), over-fetching k + hidden nearest neighbours
without a filter and dropping the hidden ones is exact and takes milliseconds. Every hit is checked
again on the mirror (role, and the filter where there was one) before it becomes a fused view, a
:class:`MemoryView` (``AtomStore.view``, ``fusion.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .atom import Atom, Role
from .filters import mirror_filter, where_filter

if TYPE_CHECKING:
    from .store import AtomStore


@dataclass
class MemoryView:
    """What retrieval returns: a Primary atom's fused view and how it was found."""

    id: str
    text: str  # fused: the atom's text plus folded-in changes and complementary details
    score: float
    atom: Atom
    evidence_ids: list[str] = field(default_factory=list)


def top_k(store: "AtomStore", query_embedding: Any, k: int, *, participants: Any = None, time_window: Any = None,
          include_evidence: bool = False) -> list[MemoryView]:
    """The ``k`` best atoms of ``store`` for the (validated) query vector, as fused views, best first."""
    allowed = {Role.PRIMARY, Role.EVIDENCE} if include_evidence else {Role.PRIMARY}
    hidden = sum(n for role, n in store._role_counts.items() if role not in allowed)
    if participants is None and time_window is None and hidden <= max(64, 4 * k):
        where, n_fetch = None, min(k + hidden, len(store._atoms))
    else:
        where = where_filter(participants=participants, time_window=time_window, include_evidence=include_evidence)
        n_fetch = k
    qvec = np.asarray(query_embedding, dtype=np.float32).reshape(1, -1)
    if where is None and store._vectors is not None and len(store._atoms) <= store.exact_below:
        scored = store._vectors.search(qvec[0], n_fetch)
    elif where is None and store._pending:
        scored = store._pending.search(qvec, n_fetch, len(store._atoms), lambda n: store._call(
            "querying atoms", store.collection.query, query_embeddings=qvec, n_results=n, include=["distances"]))
    else:
        res = store._chroma(
            "querying atoms", store.collection.query, query_embeddings=qvec,
            n_results=max(1, n_fetch), where=where, include=["distances"],
        ) if store._atoms else {"ids": [[]], "distances": [[]]}
        scored = [(aid, 1.0 - float(dist)) for aid, dist in zip(res["ids"][0], res["distances"][0])]
    keep = mirror_filter(participants, time_window) if where is not None else None
    views = []
    for aid, score in scored:
        atom = store._atoms.get(aid)
        if atom is not None and atom.role in allowed and len(views) < k and (keep is None or keep(atom)):
            views.append(store.view(aid, score=score))
    return views
