"""MemoryGraph edge weights and RWR against networkx personalised PageRank."""

import math

import networkx as nx
import numpy as np
import pytest

from atommem_rl.memory.atom import Atom
from atommem_rl.memory.graph import (
    GraphConfig,
    MemoryGraph,
    bench_rwr,
    entity_adjacency,
    event_adjacency,
    stream_positions,
    synthetic_atoms,
    temporal_adjacency,
)


def _atom(i, kws=(), events=(), turn=None):
    meta = {} if turn is None else {"turn": turn}
    return Atom(id=f"a{i}", text=f"atom {i}", keywords=tuple(kws), event_ids=tuple(events), metadata=meta)


def test_event_edges_penalised_by_size():
    a = event_adjacency([("S1",), ("S1",), ("S1",), ("S2",), ("S2",), ()]).toarray()
    assert a[0, 1] == pytest.approx(0.5) and a[1, 2] == pytest.approx(0.5)  # event of 3: 1/(3-1)
    assert a[3, 4] == pytest.approx(1.0)  # event of 2: 1/(2-1)
    assert a[0, 3] == 0 and a[5].sum() == 0 and np.all(np.diag(a) == 0)
    assert a[0].sum() == pytest.approx(1.0)  # each event gives a member total weight 1


def test_temporal_edges_decay_and_stop_at_session_boundaries():
    cfg = GraphConfig(temporal_window=2, temporal_decay=0.5)
    events = [("S1",), ("S1",), ("S1",), ("S2",), ("S2",)]
    pos = np.array([0, 1, 2, 3, 4])
    a = temporal_adjacency(pos, events, cfg).toarray()
    assert a[0, 1] == 1.0 and a[0, 2] == 0.5 and a[1, 2] == 1.0
    assert a[2, 3] == 0 and a[1, 3] == 0  # different sessions
    assert a[3, 4] == 1.0
    assert np.allclose(a, a.T)
    # stream order comes from metadata["turn"] when present, not from list order
    atoms = [_atom(0, turn=2), _atom(1, turn=0), _atom(2, turn=1)]
    assert stream_positions(atoms).tolist() == [2, 0, 1]
    assert stream_positions([_atom(0), _atom(1)]).tolist() == [0, 1]
    b = temporal_adjacency(stream_positions(atoms), [()] * 3, GraphConfig(temporal_window=1)).toarray()
    assert b[1, 2] == 1.0 and b[2, 0] == 1.0 and b[1, 0] == 0


def test_entity_edges_idf_cosine_with_df_cap_and_top_m():
    kws = [("paris", "louvr"), ("paris", "louvr"), ("paris", "wine"), ("wine",), ("common",)] + [("common",)] * 15
    cfg = GraphConfig(max_df_ratio=0.15, max_df_cap=1000, top_m=10)  # max_df = 3
    a = entity_adjacency(kws, cfg).toarray()
    n = len(kws)
    idf_p, idf_l, idf_w = math.log(n / 3), math.log(n / 2), math.log(n / 2)
    assert a[0, 1] == pytest.approx(1.0, rel=1e-5)  # identical keyword sets
    expect = idf_p**2 / (math.hypot(idf_p, idf_l) * math.hypot(idf_p, idf_w))
    assert a[0, 2] == pytest.approx(expect, rel=1e-5)
    assert a[2, 3] == pytest.approx(idf_w / math.hypot(idf_p, idf_w), rel=1e-5)
    assert a[0, 3] == 0
    assert a[4:, 4:].sum() == 0  # "common" is on 16 of 20 atoms (> max_df = 3): no edges
    assert np.allclose(a, a.T) and np.all(np.diag(a) == 0)
    # top-m keeps each node's m strongest neighbours (then symmetrised with max)
    star = [("hub", "x")] + [("hub",)] * 30 + [("z",)] * 200
    s = entity_adjacency(star, GraphConfig(top_m=3, max_df_ratio=0.5))
    assert s.shape == (231, 231)
    deg = s[:31].getnnz(axis=1)
    assert (deg >= 3).all() and s.nnz <= 2 * 3 * 31  # each keeps its top 3; symmetrising at most doubles
    assert s[31:].nnz == 0  # "z" is on 200 of 231 atoms (> max_df): no edges


def _nx_graph(graph):
    return nx.from_scipy_sparse_array(graph.adjacency.astype(np.float64))


@pytest.mark.parametrize("alpha", [0.5, 0.85])
def test_rwr_matches_networkx_personalised_pagerank(alpha):
    atoms = synthetic_atoms(300, seed=3)
    atoms.append(_atom(9999, kws=("lonely",), events=("Solo",)))  # a dangling node
    graph = MemoryGraph.from_atoms(atoms, GraphConfig(entity_weight=1.0, event_weight=1.0))
    assert graph.dangling.sum() == 1
    t = graph.transition
    colsum = np.asarray(t.sum(axis=0)).ravel()
    assert np.allclose(colsum[~graph.dangling], 1.0, atol=1e-5)  # column-stochastic
    seeds = {"a3": 1.0, "a50": 0.5, "a9999": 0.25, "a200": 2.0}
    tol = 1e-10
    x, iters = graph.rwr(seeds, alpha=alpha, tol=tol, max_iter=500)
    pers = {graph.index[k]: v for k, v in seeds.items()}
    ref = nx.pagerank(_nx_graph(graph), alpha=alpha, personalization=pers, tol=tol, max_iter=500)
    y = np.array([ref[i] for i in range(len(graph))])
    assert np.abs(x - y).max() < 1e-5
    assert x.sum() == pytest.approx(1.0, abs=1e-4)
    assert set(np.argsort(-x)[:10]) == set(np.argsort(-y)[:10])
    # same loose tolerance, same start vector: networkx stops at the same iteration with the same vector
    x2, _ = graph.rwr(seeds, alpha=alpha, tol=1e-6)
    ref2 = nx.pagerank(_nx_graph(graph), alpha=alpha, personalization=pers, nstart=pers, tol=1e-6)
    assert np.abs(x2 - np.array([ref2[i] for i in range(len(graph))])).max() < 1e-5


def test_rwr_rejects_bad_input_and_bench_shape():
    graph = MemoryGraph.from_atoms([_atom(0, ("a",), ("S",)), _atom(1, ("a",), ("S",))])
    with pytest.raises(ValueError):
        graph.rwr({"nope": 1.0})
    with pytest.raises(ValueError):
        graph.rwr({"a0": 1.0}, alpha=1.0)
    res = bench_rwr(400, seed=1, repeats=2)
    assert {"nodes", "ours_ms", "networkx_ms", "speedup"} <= set(res)
    assert res["nodes"] == 400 and res["top10_overlap"] == 1.0
