"""MemoryGraph: AtomMem's memory graph over atoms, and Random Walk with Restart on it (scipy.sparse).

Nodes are atoms. The weighted adjacency is symmetric, ``A = w_ent A_ent + w_evt A_evt + w_tmp A_tmp``:

Entity edges (keyword overlap weighted by IDF). Each atom is a vector over its keywords (the
    stemmed terms of ``memory.text``) with value ``idf(t) = ln(N / df(t))``, L2-normalised; the edge
    weight is the cosine of two such vectors, i.e. ``sum over shared t of idf(t)^2 / (|x_i| |x_j|)``,
    in [0, 1]. Kept sparse in two principled ways: terms with ``df < 2`` (cannot link) or
    ``df > max_df = min(max_df_cap, max(2, max_df_ratio * N))`` (a term on a large share of atoms,
    such as a speaker's name, is a topic, not an entity, and would add O(df^2) edges) are ignored;
    then only each node's ``top_m`` strongest entity neighbours are kept and the result is
    symmetrised with ``max(S, S^T)``. Computed as a sparse product ``X X^T`` in row blocks.
Event edges (same event, penalised by event size). Atoms sharing an event of ``s`` members are linked
    with weight ``1 / (s - 1)`` (summed over shared events), so each event gives each member a total
    edge weight of 1 however large it is: ``A_evt = E diag(1/(s-1)) E^T`` minus its diagonal, with ``E``
    the atom-event incidence matrix.
Temporal edges (adjacent turns, decaying with distance). Atoms at distance ``d <= temporal_window``
    in *stream order* are linked with weight ``temporal_decay ** (d - 1)``, only when they share an
    event or one of them has none (a session boundary is not adjacency). Stream order is the integer
    metadata field ``"turn"`` when every atom has one (the LoCoMo loader sets it), otherwise the order
    of the atoms given (``AtomStore.atoms()`` = creation order).

Random Walk with Restart = personalised PageRank, computed by power iteration on the cached
column-stochastic CSR matrix ``P = A D^-1`` (``D`` = column sums; float32). With restart
distribution ``p`` (the normalised seed weights) and damping ``alpha`` (probability of following an
edge; the restart probability is ``1 - alpha``)::

    x_{t+1} = alpha * (P x_t + (sum of x_t over dangling nodes) * p) + (1 - alpha) * p

starting from ``x_0 = p`` (or a given ``x0``), stopping when ``||x_{t+1} - x_t||_1 < N * tol``: the
iteration and tolerance of ``networkx.pagerank(G, alpha, personalization=p, tol=tol)`` exactly
(dangling mass goes to the personalisation vector, as networkx does by default), so the two can be
compared at the same tolerance; :func:`bench_rwr` does that on a synthetic graph.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from .atom import Atom, Role


@dataclass(frozen=True)
class GraphConfig:
    # Channel weights. Turn adjacency is the strongest association in a dialogue stream (a reply
    # carries the context of the turn before it); keyword and session links are weaker, broader
    # evidence, so they get a fifth of its weight (measured on LoCoMo: heavier entity/event weights
    # dilute the walk over whole sessions; see the retrieval benchmark report).
    entity_weight: float = 0.2
    event_weight: float = 0.2
    temporal_weight: float = 1.0
    max_df_ratio: float = 0.05  # ignore keywords on more than this share of atoms ...
    max_df_cap: int = 1000  # ... or on more than this many atoms
    top_m: int = 10  # entity neighbours kept per node (before symmetrising)
    temporal_window: int = 2
    temporal_decay: float = 0.5
    block_rows: int = 4096  # rows per block of the X X^T product (bounds memory)


def stream_positions(atoms: Sequence[Atom]) -> np.ndarray:
    """Each atom's position in the source stream (see the module docstring)."""
    turns = [a.metadata.get("turn") for a in atoms]
    if atoms and all(isinstance(t, int) and not isinstance(t, bool) for t in turns):
        return np.asarray(turns, dtype=np.int64)
    return np.arange(len(atoms), dtype=np.int64)


def _top_m_per_row(m: sp.csr_matrix, top: int) -> sp.csr_matrix:
    """Keep the ``top`` largest entries of each row (vectorised: one lexsort over all entries)."""
    counts = np.diff(m.indptr)
    if top <= 0 or counts.max(initial=0) <= top:
        return m
    rows = np.repeat(np.arange(m.shape[0]), counts)
    order = np.lexsort((-m.data, rows))  # by row, then by weight descending
    rank = np.arange(order.size) - m.indptr[rows[order]]
    keep = order[rank < top]
    return sp.csr_matrix((m.data[keep], (rows[keep], m.indices[keep])), shape=m.shape)


def _incidence(labels: Sequence[Sequence[str]]) -> sp.csr_matrix | None:
    """Binary atoms x labels matrix (keywords or event ids); None when no atom has a label."""
    index: dict[str, int] = {}
    rows, cols = [], []
    for i, labs in enumerate(labels):
        for lab in set(labs):
            rows.append(i)
            cols.append(index.setdefault(lab, len(index)))
    if not index:
        return None
    return sp.csr_matrix((np.ones(len(rows), dtype=np.float32), (rows, cols)), shape=(len(labels), len(index)))


def entity_adjacency(keywords: Sequence[Sequence[str]], cfg: GraphConfig) -> sp.csr_matrix:
    n = len(keywords)
    x = _incidence(keywords)
    if x is None:
        return sp.csr_matrix((n, n), dtype=np.float32)
    df = np.asarray(x.sum(axis=0)).ravel()
    max_df = min(cfg.max_df_cap, max(2.0, cfg.max_df_ratio * n))
    idf = np.where((df >= 2) & (df <= max_df), np.log(n / np.maximum(df, 1)), 0.0).astype(np.float32)
    x = (x @ sp.diags(idf)).tocsr()
    x.eliminate_zeros()
    norms = np.sqrt(np.asarray(x.multiply(x).sum(axis=1)).ravel())
    norms[norms == 0] = 1.0
    x = (sp.diags((1.0 / norms).astype(np.float32)) @ x).tocsr()
    xt = x.T.tocsr()
    blocks = []
    for start in range(0, n, cfg.block_rows):
        blk = (x[start : start + cfg.block_rows] @ xt).tocoo()
        off = blk.row + start != blk.col  # no self loops
        blk = sp.csr_matrix((blk.data[off], (blk.row[off], blk.col[off])), shape=blk.shape)
        blocks.append(_top_m_per_row(blk, cfg.top_m))
    s = sp.vstack(blocks).tocsr()
    return s.maximum(s.T).tocsr().astype(np.float32)


def event_adjacency(event_ids: Sequence[Sequence[str]]) -> sp.csr_matrix:
    n = len(event_ids)
    inc = _incidence(event_ids)
    if inc is None:
        return sp.csr_matrix((n, n), dtype=np.float32)
    size = np.asarray(inc.sum(axis=0)).ravel()
    scale = np.where(size >= 2, 1.0 / np.maximum(size - 1, 1), 0.0).astype(np.float32)
    a = (inc @ sp.diags(scale) @ inc.T).tocsr()
    a.setdiag(0)
    a.eliminate_zeros()
    return a.astype(np.float32)


def temporal_adjacency(positions: np.ndarray, event_ids: Sequence[Sequence[str]], cfg: GraphConfig) -> sp.csr_matrix:
    n = len(positions)
    seq = np.argsort(positions, kind="stable")
    events = [frozenset(e) for e in event_ids]
    rows, cols, vals = [], [], []
    for d in range(1, cfg.temporal_window + 1):
        w = cfg.temporal_decay ** (d - 1)
        for a, b in zip(seq[:-d].tolist(), seq[d:].tolist()):
            ea, eb = events[a], events[b]
            if ea and eb and not (ea & eb):
                continue
            rows += (a, b)
            cols += (b, a)
            vals += (w, w)
    return sp.csr_matrix((np.asarray(vals, dtype=np.float32), (rows, cols)), shape=(n, n))


class MemoryGraph:
    """Atoms as nodes, the weighted adjacency of the module docstring, and RWR on it."""

    def __init__(self, ids: Sequence[str], adjacency: sp.spmatrix):
        self.ids = list(ids)
        self.index = {aid: i for i, aid in enumerate(self.ids)}
        a = sp.csr_matrix(adjacency, dtype=np.float32)
        if a.shape != (len(self.ids), len(self.ids)):
            raise ValueError(f"adjacency has shape {a.shape}, expected {(len(self.ids),) * 2}")
        self.adjacency = a
        colsum = np.asarray(a.sum(axis=0)).ravel()
        self.dangling = colsum == 0
        inv = np.where(self.dangling, 0.0, 1.0 / np.where(self.dangling, 1.0, colsum)).astype(np.float32)
        self.transition = (a @ sp.diags(inv)).tocsr().astype(np.float32)  # column-stochastic
        self._dangling_idx = np.flatnonzero(self.dangling)

    @classmethod
    def from_atoms(cls, atoms: Sequence[Atom], config: GraphConfig | None = None) -> "MemoryGraph":
        cfg = config or GraphConfig()
        atoms = list(atoms)
        n = len(atoms)
        adj = sp.csr_matrix((n, n), dtype=np.float32)
        if cfg.entity_weight:
            adj = adj + cfg.entity_weight * entity_adjacency([a.keywords for a in atoms], cfg)
        if cfg.event_weight:
            adj = adj + cfg.event_weight * event_adjacency([a.event_ids for a in atoms])
        if cfg.temporal_weight and cfg.temporal_window > 0:
            adj = adj + cfg.temporal_weight * temporal_adjacency(
                stream_positions(atoms), [a.event_ids for a in atoms], cfg)
        return cls([a.id for a in atoms], adj)

    @classmethod
    def from_store(cls, store, config: GraphConfig | None = None) -> "MemoryGraph":
        """The graph of a store's Primary atoms (evidence and deleted atoms are not nodes)."""
        return cls.from_atoms(store.atoms(roles=(Role.PRIMARY,)), config)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def edges(self) -> int:
        return int(self.adjacency.nnz // 2)

    def personalization(self, seeds: Mapping[str, float] | np.ndarray) -> np.ndarray:
        """A restart distribution from ``{atom id: weight}`` (unknown ids ignored) or a dense vector."""
        if isinstance(seeds, Mapping):
            p = np.zeros(len(self.ids), dtype=np.float32)
            for aid, w in seeds.items():
                i = self.index.get(aid)
                if i is not None and w > 0:
                    p[i] += w
        else:
            p = np.asarray(seeds, dtype=np.float32).copy()
        total = float(p.sum())
        if total <= 0 or not math.isfinite(total):
            raise ValueError("RWR needs at least one seed with a positive weight")
        return p / total

    def rwr(self, seeds: Mapping[str, float] | np.ndarray, *, alpha: float = 0.5, tol: float = 1e-6,
            max_iter: int = 100, x0: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """(stationary scores in ``self.ids`` order, iterations); see the module docstring."""
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"alpha must be in [0, 1), got {alpha}")
        p = self.personalization(seeds)
        x = p.copy() if x0 is None else np.asarray(x0, dtype=np.float32) / np.float32(np.sum(x0))
        limit = len(self.ids) * tol
        a = np.float32(alpha)
        base = np.float32(1.0 - alpha)
        for it in range(1, max_iter + 1):
            dangling = float(x[self._dangling_idx].sum()) if self._dangling_idx.size else 0.0
            nxt = self.transition @ x
            nxt *= a
            nxt += np.float32(alpha * dangling + (1.0 - alpha)) * p if dangling else base * p
            err = float(np.abs(nxt - x).sum())
            x = nxt
            if err < limit:
                return x, it
        return x, max_iter

    def scores(self, seeds: Mapping[str, float], **kwargs) -> dict[str, float]:
        x, _ = self.rwr(seeds, **kwargs)
        return {aid: float(v) for aid, v in zip(self.ids, x)}


# --------------------------------------------------------------------------- benchmark
def synthetic_atoms(nodes: int, seed: int = 0, *, keywords_per_atom: int = 6, event_size: tuple[int, int] = (15, 35)) -> list[Atom]:
    """A dialogue-like stream without Chroma: sessions (events) of 15-35 turns in stream order, two
    speakers per session from a pool, and keywords drawn from a vocabulary of ``nodes // 2`` entity
    terms (uniform) plus a few very common terms (which the df cap removes from entity edges)."""
    rng = np.random.default_rng(seed)
    vocab = max(64, nodes // 2)
    atoms: list[Atom] = []
    session = 0
    while len(atoms) < nodes:
        size = int(rng.integers(event_size[0], event_size[1] + 1))
        speakers = rng.choice(50, size=2, replace=False)
        for j in range(min(size, nodes - len(atoms))):
            i = len(atoms)
            ent = rng.integers(0, vocab, size=keywords_per_atom - 1)
            kws = tuple(f"e{t}" for t in ent) + (f"common{int(rng.integers(0, 5))}",)
            atoms.append(Atom(
                id=f"a{i}", text=f"synthetic atom {i}", participants=(f"p{speakers[j % 2]}",),
                keywords=kws, event_ids=(f"S{session}",), source_ids=(f"D{session}:{j}",),
                role=Role.PRIMARY, created_at=i, updated_at=i, metadata={"turn": i},
            ))
        session += 1
    return atoms


def bench_rwr(nodes: int, seed: int = 0, *, repeats: int | None = None, alpha: float = 0.85, tol: float = 1e-6,
              seeds: int = 10) -> dict:
    """Median RWR latency on a synthetic ``nodes``-atom graph: ours vs ``networkx.pagerank`` with the
    same personalisation, start vector, alpha and tolerance on the identical weighted graph (built
    with ``networkx.from_scipy_sparse_array`` outside the timing). Also checks the two agree
    (top-10 overlap of the score vectors, max absolute difference)."""
    import networkx as nx

    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    graph = MemoryGraph.from_atoms(synthetic_atoms(nodes, seed))
    build_s = time.perf_counter() - t0
    g = nx.from_scipy_sparse_array(graph.adjacency.astype(np.float64))
    if repeats is None:
        repeats = 5 if nodes <= 20_000 else 3
    ours, theirs, overlaps, diffs, iters = [], [], [], [], []
    graph.rwr({graph.ids[0]: 1.0}, alpha=alpha, tol=tol)  # warm-up (allocator, caches)
    for _ in range(repeats):
        picks = rng.choice(nodes, size=min(seeds, nodes), replace=False)
        weights = rng.random(picks.size) + 0.5
        seed_map = {graph.ids[i]: float(w) for i, w in zip(picks, weights)}
        inner = []
        for _ in range(max(3, 20 // repeats)):
            t = time.perf_counter()
            x, it = graph.rwr(seed_map, alpha=alpha, tol=tol)
            inner.append((time.perf_counter() - t) * 1e3)
        ours.append(statistics.median(inner))
        iters.append(it)
        pers = {int(i): float(w) for i, w in zip(picks, weights)}
        t = time.perf_counter()
        ref = nx.pagerank(g, alpha=alpha, personalization=pers, nstart=pers, tol=tol, weight="weight")
        theirs.append((time.perf_counter() - t) * 1e3)
        y = np.fromiter((ref[i] for i in range(nodes)), dtype=np.float64, count=nodes)
        top_ours = set(np.argsort(-x, kind="stable")[:10].tolist())
        top_ref = set(np.argsort(-y, kind="stable")[:10].tolist())
        overlaps.append(len(top_ours & top_ref) / 10)
        diffs.append(float(np.abs(x - y).max()))
    ours_ms, nx_ms = statistics.median(ours), statistics.median(theirs)
    return {
        "nodes": nodes, "edges": graph.edges, "ours_ms": round(ours_ms, 3), "networkx_ms": round(nx_ms, 2),
        "speedup": round(nx_ms / ours_ms, 1), "iterations": int(statistics.median(iters)),
        "top10_overlap": min(overlaps), "max_abs_diff": max(diffs), "alpha": alpha, "tol": tol,
        "build_s": round(build_s, 2), "repeats": repeats,
    }
