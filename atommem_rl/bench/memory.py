"""``atommem bench memory``: latency of each store operation next to the raw Chroma call it wraps,
and Random Walk with Restart next to networkx personalised PageRank.

Method. For each size N (default 1k and 10k atoms; ``--sizes`` adds 100k) and each operation, two collections in one
in-memory Chroma database are filled with the same N atoms (hashing embeddings, so the embedding
model's cost is out of the figure): one through ``AtomStore.create_many``, one through
``collection.add`` with the same documents, embeddings and metadata. The operation is then timed
``repeats`` times, the store call and the raw call alternating in one loop so that machine noise
hits both alike, and the medians and their ratio are reported. A fresh pair per operation matters:
Chroma's write latency depends on the collection's recent writes (it climbs with pending log
records and drops after a compaction), so operations timed one after another on one pair were
measuring each other's leftovers (a spurious 5x on delete in an earlier version). The raw call is exactly what the store op sends to Chroma:

    create  collection.add(1 id, document, embedding, metadata)
    read    collection.query(1 embedding, k=6): unfiltered, since no atom is hidden yet (the store
            over-fetches k + hidden neighbours instead of a ``where`` scan when few are hidden)
    read_filtered  collection.query(1 embedding, k=6, where=role and participant filter)
    update  collection.update(1 id, document, embedding, metadata)
    delete  collection.update(1 id, metadata)            (delete = role -> deleted, kept for the log)
    relate  collection.update(2 ids, metadatas)           (the two atoms' labels and roles)

The store's extra cost is validation, keyword extraction, hashing the text, metadata encoding,
the mirror and (for read) building fused views.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import uuid
from typing import Callable

import numpy as np

from ..memory.atom import RESERVED_PREFIX, Atom, HistoryEntry, Relation, Role, to_chroma_metadata
from ..memory.chroma_clients import make_client
from ..memory.embeddings import HashingEmbedder
from ..memory.store import COLLECTION_PREFIX, AtomDraft, AtomStore
from ..commands import at_most, count_list, seed_int

_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar "
          "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
_PEOPLE = ("Ann", "Bob", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hal")


def synthetic_fact(rng: np.random.Generator, i: int) -> AtomDraft:
    who = _PEOPLE[i % len(_PEOPLE)]
    words = " ".join(rng.choice(_WORDS, size=6))
    return AtomDraft(text=f"{who} noted fact {i}: {words} item{i}", participants=[who],
                     time=f"2023-{1 + i % 12:02d}-{1 + i % 28:02d}")


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)


def _paired(ours: Callable[[int], object], raw: Callable[[int], object], repeats: int) -> dict:
    """Alternate ours/raw ``repeats`` times (order flipped every other round) and take medians."""
    t_ours, t_raw = [], []
    for i in range(repeats):
        order = ((ours, t_ours), (raw, t_raw)) if i % 2 == 0 else ((raw, t_raw), (ours, t_ours))
        for fn, bucket in order:
            t0 = time.perf_counter()
            fn(i)
            bucket.append(time.perf_counter() - t0)
    o, r = _median_ms(t_ours), _median_ms(t_raw)
    return {"ours_ms": o, "chroma_ms": r, "ratio": round(o / r, 3) if r else None}


def _fresh_pair(drafts: list[AtomDraft], emb: HashingEmbedder):
    """A store and a raw collection in one in-memory Chroma database, holding identical atoms."""
    client = make_client("memory")
    tag = uuid.uuid4().hex[:8]
    store = AtomStore(f"bench-{tag}", client=client, embedder=emb)
    raw = client.get_or_create_collection(
        f"{COLLECTION_PREFIX}bench-raw-{tag}", embedding_function=emb, configuration={"hnsw": {"space": "cosine"}}
    )
    store.create_many(drafts)
    atoms = store.atoms()
    vecs = emb.embed([a.text for a in atoms])
    for s in range(0, len(atoms), store.batch_size):
        chunk = atoms[s : s + store.batch_size]
        raw.add(ids=[a.id for a in chunk], documents=[a.text for a in chunk],
                embeddings=vecs[s : s + len(chunk)], metadatas=[to_chroma_metadata(a) for a in chunk])
    return client, store, raw, atoms


def bench_ops(n_atoms: int, repeats: int = 200, seed: int = 0) -> dict[str, dict]:
    """Median latency of every store op against its raw Chroma call, with ``n_atoms`` stored.

    Each writing op is measured on a freshly filled pair of collections: Chroma's write latency
    depends on the collection's recent write history (it climbs with pending log records and drops
    after a compaction), so ops measured one after another on the same pair measured each other.
    """
    rng = np.random.default_rng(seed)
    emb = HashingEmbedder(384)
    drafts = [synthetic_fact(rng, i) for i in range(n_atoms)]
    fresh = [synthetic_fact(rng, n_atoms + i) for i in range(repeats)]
    fresh_vecs = emb.embed([d.text for d in fresh])
    queries = [f"what did {_PEOPLE[i % 8]} note about {' '.join(rng.choice(_WORDS, 3))}" for i in range(repeats)]
    query_vecs = emb.embed(queries)
    who = [_PEOPLE[i % len(_PEOPLE)] for i in range(repeats)]
    where = {RESERVED_PREFIX + "role": {"$in": [Role.PRIMARY.value]}}
    out: dict[str, dict] = {}

    def measure(op: str, ours, raw_call, n: int = repeats) -> None:
        client, store, raw, atoms = _fresh_pair(drafts, emb)
        ids = [a.id for a in atoms]
        out[op] = _paired(lambda i: ours(store, ids, i), lambda i: raw_call(raw, atoms, i), n)
        client.delete_collection(raw.name)
        store.drop()

    # The raw calls send exactly the metadata the store op sends (history and relation JSON
    # included), precomputed outside the timing.
    store0 = AtomStore.__new__(AtomStore)
    store0.max_chars, store0.keyword_limit = 4000, 24
    fresh_meta = [to_chroma_metadata(a) for a in _as_atoms(store0, fresh)]

    def upd_meta(a: Atom, i: int) -> dict:
        return to_chroma_metadata(dataclasses.replace(a, text=fresh[i].text, history=[HistoryEntry(a.text, 0)]), for_update=True)

    def rel_meta(new: Atom, old: Atom) -> list[dict]:
        return [to_chroma_metadata(dataclasses.replace(new, relations={old.id: Relation.CONFLICT}), for_update=True),
                to_chroma_metadata(dataclasses.replace(old, role=Role.EVIDENCE), for_update=True)]

    measure("create",
            lambda st, ids, i: st.create(fresh[i].text, participants=fresh[i].participants, time=fresh[i].time),
            lambda raw, atoms, i: raw.add(ids=[f"r{i}"], documents=[fresh[i].text],
                                          embeddings=fresh_vecs[i : i + 1], metadatas=[fresh_meta[i]]))
    measure("read",
            lambda st, ids, i: st.read(queries[i], k=6),
            lambda raw, atoms, i: raw.query(query_embeddings=query_vecs[i : i + 1], n_results=6, include=["distances"]))
    measure("read_filtered",
            lambda st, ids, i: st.read(queries[i], k=6, participants=[who[i]]),
            lambda raw, atoms, i: raw.query(
                query_embeddings=query_vecs[i : i + 1], n_results=6, include=["distances"],
                where={"$and": [where, {RESERVED_PREFIX + "participants": {"$contains": who[i]}}]}),
            min(repeats, max(10, repeats // 10)))  # a metadata scan per call: slow at 100k atoms, fewer
    measure("update",
            lambda st, ids, i: st.update(ids[i], fresh[i].text),
            lambda raw, atoms, i: raw.update(ids=[atoms[i].id], documents=[fresh[i].text],
                                             embeddings=fresh_vecs[i : i + 1], metadatas=[upd_meta(atoms[i], i)]))
    measure("relate",
            lambda st, ids, i: st.relate(ids[2 * i], ids[2 * i + 1], "conflict"),
            lambda raw, atoms, i: raw.update(ids=[atoms[2 * i].id, atoms[2 * i + 1].id],
                                             metadatas=rel_meta(atoms[2 * i], atoms[2 * i + 1])))
    measure("delete",
            lambda st, ids, i: st.delete(ids[i]),
            lambda raw, atoms, i: raw.update(ids=[atoms[i].id],
                                             metadatas=[to_chroma_metadata(dataclasses.replace(atoms[i], role=Role.DELETED), for_update=True)]))
    for op in out.values():
        op["atoms"] = n_atoms
    return out


def _as_atoms(store: AtomStore, drafts: list[AtomDraft]) -> list[Atom]:
    return [store._draft_to_atom(d, f"x{i}", i) for i, d in enumerate(drafts)]


def run(sizes: list[int], repeats: int, rwr_sizes: list[int], seed: int = 0) -> dict:
    ops: dict[str, list[dict]] = {}
    for n in sizes:
        if n < 2 * repeats:
            raise ValueError(f"--sizes {n} is too small for --repeats {repeats} (need >= {2 * repeats})")
        t0 = time.perf_counter()
        _progress(f"{n} atoms: filling and timing each operation ({repeats} calls)")
        for op, figures in bench_ops(n, repeats, seed).items():
            ops.setdefault(op, []).append(figures)
        _progress(f"{n} atoms: done in {time.perf_counter() - t0:.0f} s")
    result: dict = {
        # DESIGN.md's stable shape is {"ops": {"<op>": {...}}}: the largest size is that entry and
        # every size is listed under "by_size".
        "ops": {op: {**rows[-1], "by_size": rows} for op, rows in ops.items()},
        "repeats": repeats,
    }
    result["rwr"] = []
    if rwr_sizes:
        from ..memory import graph

        for n in rwr_sizes:
            _progress(f"random walk with restart on {n} nodes against networkx")
            result["rwr"].append(graph.bench_rwr(n, seed=seed))
    return result


def _progress(text: str) -> None:
    """A line on stderr while the bench runs (stdout holds only the figures)."""
    print(f"bench memory: {text}", file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # 100,000 atoms (and RWR on 100,000 nodes) take this past 10 minutes on a 2-core CPU: flags, not defaults
    parser.add_argument("--sizes", type=count_list(10**7), default=[1000, 10000],
                        help="comma-separated store sizes in atoms (default: 1000,10000; add 100000 for the large store)")
    parser.add_argument("--repeats", type=at_most(10**6), default=200, help="timed calls per op and size (default 200)")
    parser.add_argument("--rwr-sizes", type=count_list(10**7), default=[10000], help="graph sizes for RWR (default 10000)")
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--json", action="store_true", help="print only the JSON result")


def main(args: argparse.Namespace) -> int:
    result = run(args.sizes, args.repeats, args.rwr_sizes, args.seed)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'op':8} {'atoms':>7} {'ours ms':>9} {'chroma ms':>10} {'ratio':>6}")
        for op, fig in result["ops"].items():
            for row in fig["by_size"]:
                print(f"{op:8} {row['atoms']:>7} {row['ours_ms']:>9.3f} {row['chroma_ms']:>10.3f} {row['ratio']:>6.2f}")
        for row in result["rwr"]:
            print(f"rwr      {row['nodes']:>7} ours {row['ours_ms']:.2f} ms, networkx {row['networkx_ms']:.1f} ms, "
                  f"speedup {row['speedup']:.1f}x")
    return 0
