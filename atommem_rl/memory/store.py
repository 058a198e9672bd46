"""AtomStore: one episode's long-term memory of atomic facts, on a Chroma collection.

Operations (AtomMem's CRUD plus ROAM's relation labels):

    create / create_many   validate, embed, add in batches within Chroma's limit (all or nothing)
    read                   top-k Primary atoms by similarity, optional participant and time-window
                           filters; each hit is a *fused view* (see ``fusion.py``)
    update                 new text, previous text kept in the atom's history
    delete                 role -> deleted: gone from retrieval, kept in the log and in Chroma
    relate(new, old, lbl)  record a ROAM label; deterministic rules re-derive the roles of the atoms
                           it touches; text is never rewritten

Consistency model: a namespace has one writer (the episode that owns it). Chroma is the source of
truth; the store keeps a write-through mirror of atom metadata so relation rules, fusion and keyword
scoring never need a round trip, and reopening a namespace (another process, a restarted server)
rebuilds the mirror from Chroma. Every method validates before it writes and updates the mirror only
after Chroma acknowledged the write, so a failed call leaves both exactly as they were.

The store's parts, each in its own module: input checks and :class:`AtomDraft` (``validation.py``);
roles from relation labels, pure functions of the mirror (``roles.py``); the opt-in write-behind
buffer, ``write_behind=N`` (``write_behind.py``); exact in-process reads of small namespaces,
``exact_below=N`` (``exact.py``); read filters (``filters.py``); the top-k read path (``reads.py``);
Chroma clients and their errors (``chroma_clients.py``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
import uuid
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import chromadb
import numpy as np

from . import fusion, writer_lock
from .atom import Atom, Relation, Role, from_chroma
from .chroma_batches import contents, pages
from .chroma_clients import make_client, translate_error
from .embeddings import Embedder, HashingEmbedder
from .errors import AtomNotFoundError, InvalidAtomError, MemoryStoreError, StoreUnavailableError
from .exact import VectorMirror
from .filters import where_filter
from .reads import MemoryView, top_k
from .roles import deletion, incoming_index, parse_label, relabel
from .validation import (WRITER, AtomDraft, check_count, check_namespace, check_query, draft_to_atom, live_atom,
                         new_atom_id, next_auto_seq, revised_atom)
from .write_behind import PendingWrites, send_meta, send_new, send_text

__all__ = ["COLLECTION_PREFIX", "AtomDraft", "AtomStore", "MemoryView", "wall_ms"]

COLLECTION_PREFIX = "atommem-"


class AtomStore:
    """The long-term store of one namespace (one episode). See the module docstring."""

    def __init__(self, namespace: str, *, client: "chromadb.api.ClientAPI | None" = None,
                 embedder: Embedder | None = None, max_chars: int = 4000, keyword_limit: int = 24,
                 write_behind: int = 0, exact_below: int = 0, writer: str | None = None):
        self.namespace = check_namespace(namespace)
        # ids the store assigns are a<seq>-<writer>: two writers of one namespace (two processes on a
        # server, two stores in one process) never pick the same id, where a1, a2, ... per writer
        # collided and Chroma ignored the second add of each id
        # (``writer``: a fixed tag of 4 hex digits, for tests that compare two stores id for id)
        self.writer = writer if writer is not None else uuid.uuid4().hex[:4]
        if not WRITER.fullmatch(self.writer):
            raise ValueError(f"writer must be 4 hex digits, got {writer!r}")
        self._stale = False  # set when a call's outcome is unknown (transport failure): resync first
        self.client = client if client is not None else make_client("memory")
        self.embedder = embedder if embedder is not None else HashingEmbedder()
        self.max_chars = int(max_chars)
        self.keyword_limit = int(keyword_limit)
        self.write_behind = check_count(write_behind, "write_behind")
        self._pending = PendingWrites(write_behind)  # see write_behind.py
        self.exact_below = check_count(exact_below, "exact_below")
        self._vectors = VectorMirror() if exact_below else None  # every atom's vector (exact reads)
        lock = writer_lock.acquire(self.client, namespace)  # a persistent path: one writing process
        self._release = weakref.finalize(self, writer_lock.release, lock)
        try:
            self._open()
        except BaseException:
            self._release()
            raise

    def _open(self) -> None:
        self.collection = self._chroma("opening the collection", self.client.get_or_create_collection,
                                       name=COLLECTION_PREFIX + self.namespace, embedding_function=self.embedder,
                                       configuration={"hnsw": {"space": "cosine"}})
        self.batch_size = int(self._chroma("reading the batch limit", self.client.get_max_batch_size))
        self._atoms: dict[str, Atom] = {}
        self._incoming: dict[str, set[str]] = {}  # old id -> ids of atoms that labelled it
        self._role_counts: dict[Role, int] = {role: 0 for role in Role}
        self.clock = 0  # logical time: one tick per acknowledged write
        self.version = 0  # bumps on every write; derived indexes (BM25, graph) rebuild lazily on it
        self.log: list[dict[str, Any]] = []
        self._load()

    @classmethod
    def open(cls, namespace: str, *, client: "chromadb.api.ClientAPI", **kwargs) -> "AtomStore":
        """Reopen an existing namespace with the embedder it was written with: Chroma persisted the
        embedder's name and config, and our embedders are registered, so it is rebuilt from them."""
        name = COLLECTION_PREFIX + namespace
        try:
            col = client.get_collection(name)
        except Exception as exc:
            raise AtomNotFoundError(f"no namespace {namespace!r} in this Chroma database ({exc})") from exc
        embedder = col.configuration.get("embedding_function")
        if not isinstance(embedder, Embedder):
            raise MemoryStoreError(f"namespace {namespace!r} was not written by AtomStore (embedder {embedder!r})")
        return cls(namespace, client=client, embedder=embedder, **kwargs)

    # ------------------------------------------------------------------ plumbing
    def _chroma(self, what: str, fn, *args, **kwargs):
        """Call Chroma, translating its errors; pending writes go first, so every caller (events,
        profiles, filtered reads) sees Chroma in the mirror's state."""
        if self._pending:
            self.flush()
        return self._call(what, fn, *args, **kwargs)

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MemoryStoreError:
            raise
        except Exception as exc:  # transport errors (httpx), Chroma's own, Rust binding errors
            err = translate_error(exc, what, self.client)
            if isinstance(err, StoreUnavailableError):
                self._stale = True  # a write may or may not have landed: the mirror is rebuilt before the next call
            raise err from exc

    def resync(self) -> None:
        """Rebuild the mirror from Chroma, the source of truth. Called before the next operation after
        a transport failure, whose write the server may have applied before the connection dropped;
        if Chroma is still unreachable the mirror is left as it was and the error propagates."""
        if self._pending:
            self.flush()  # raises while Chroma is unreachable; the pending writes stay queued
        saved = (self._atoms, self._incoming, self._role_counts, self.clock, self._next_seq, self._vectors)
        self._atoms, self._incoming, self._role_counts = {}, {}, {role: 0 for role in Role}
        self._vectors = VectorMirror() if self.exact_below else None
        try:
            self._load()
        except BaseException:
            self._atoms, self._incoming, self._role_counts, self.clock, self._next_seq, self._vectors = saved
            raise
        self._stale = False
        self._touch("resync")

    def _load(self) -> None:
        """Rebuild the mirror from Chroma (a reopened namespace), page by page."""
        include = ["documents", "metadatas"] + (["embeddings"] if self._vectors is not None else [])
        for page in pages(self._chroma, self.collection, self.batch_size, include):
            for aid, doc, meta in zip(page["ids"], page["documents"], page["metadatas"]):
                atom = from_chroma(aid, doc, meta)
                self._atoms[aid] = atom
                self.clock = max(self.clock, atom.updated_at, atom.created_at)
            if self._vectors is not None and len(page["ids"]):
                self._vectors.put(list(page["ids"]), page["embeddings"])
        for atom in self._atoms.values():
            self._role_counts[atom.role] += 1
        self._incoming = incoming_index(self._atoms.values())
        self._next_seq = next_auto_seq(self._atoms)

    def _touch(self, op: str, **details) -> None:
        if op != "read":  # reads change nothing that derived indexes depend on
            self.version += 1
        self.log.append({"op": op, "clock": self.clock, **details})

    # ------------------------------------------------------------------ validation
    def _draft_to_atom(self, draft: AtomDraft, atom_id: str, clock: int) -> Atom:
        return draft_to_atom(draft, atom_id, clock, max_chars=self.max_chars, keyword_limit=self.keyword_limit)

    def _live(self, atom_id: Any) -> Atom:
        return live_atom(self._atoms, atom_id, self.namespace)

    # ------------------------------------------------------------------ queries on the mirror
    def __len__(self) -> int:
        return len(self._atoms) - self._role_counts[Role.DELETED]

    def __contains__(self, atom_id: object) -> bool:
        atom = self._atoms.get(atom_id)  # type: ignore[arg-type]
        return atom is not None and atom.active

    def get(self, atom_id: str) -> Atom:
        """The atom (a copy is not made: treat it as read-only). Deleted atoms raise."""
        return self._live(atom_id)

    def get_any(self, atom_id: str) -> Atom | None:
        """The atom whatever its role (deleted included), or None."""
        return self._atoms.get(atom_id)

    def atoms(self, *, roles: Iterable[Role] = (Role.PRIMARY, Role.EVIDENCE)) -> list[Atom]:
        """Atoms with the given roles, in creation order."""
        wanted = set(roles)
        return sorted((a for a in self._atoms.values() if a.role in wanted), key=lambda a: a.created_at)

    def count(self, role: Role | None = None) -> int:
        if role is None:
            return len(self)
        return self._role_counts[role]

    # ------------------------------------------------------------------ create
    def create(self, text: str, **fields) -> Atom:
        """Create one atom; ``fields`` are those of :class:`AtomDraft`."""
        return self.create_many([AtomDraft(text=text, **fields)])[0]

    def create_many(self, drafts: Sequence[AtomDraft | dict]) -> list[Atom]:
        """Create atoms in Chroma-sized batches. All are validated first; if a batch fails after
        others were written, those are removed again, so the call is all or nothing."""
        drafts = [d if isinstance(d, AtomDraft) else AtomDraft(**d) for d in drafts]
        if not drafts:
            return []
        if self._stale:
            self.resync()
        clock = self.clock + 1
        atoms, seq, seen = [], self._next_seq, set()
        for d in drafts:
            aid, seq = new_atom_id(d.id, self._atoms, seen, self.writer, seq, self.namespace)
            seen.add(aid)
            atoms.append(self._draft_to_atom(d, aid, clock))
        vectors = self.embedder.embed([a.text for a in atoms])
        send_new(self, atoms, vectors)  # see write_behind.py: to Chroma now, or staged
        self._commit_created(atoms, clock, seq, vectors)
        self._maybe_flush()
        return atoms

    def _commit_created(self, atoms: list[Atom], clock: int, seq: int, vectors) -> None:
        if self._vectors is not None:
            self._vectors.put([a.id for a in atoms], vectors)
        self.clock = clock
        self._next_seq = seq
        for a in atoms:
            self._atoms[a.id] = a
        self._role_counts[Role.PRIMARY] += len(atoms)
        self._touch("create", ids=[a.id for a in atoms])

    def _refuse_existing(self, ids: list[str]) -> None:
        """Chroma's ``add`` silently ignores an id it already holds, which would drop the write while the
        mirror reports it stored: an id another writer created is refused, named, before the add."""
        held = self._call("checking new ids", self.collection.get, ids=ids, include=[])["ids"]
        if held:
            self._stale = True  # the mirror misses another writer's atoms: rebuild it before the next call
            raise InvalidAtomError(f"atom id(s) {', '.join(held[:5])} already exist in Chroma for namespace "
                                   f"{self.namespace!r}, written by another writer; nothing was stored")

    # ------------------------------------------------------------------ write-behind
    def _maybe_flush(self) -> None:
        if self.write_behind and self._pending.due:
            self.flush()

    def flush(self) -> None:
        """Send pending writes to Chroma (write-behind mode; a no-op otherwise): see ``write_behind.py``."""
        if self._pending:
            self._pending.flush(self.collection, self._atoms, self.batch_size, self._call, self._refuse_existing)

    @property
    def pending(self) -> int:
        """Writes acknowledged to the caller but not yet sent to Chroma (write-behind mode)."""
        return len(self._pending)

    # ------------------------------------------------------------------ read
    def read(self, query: str, k: int = 6, *, participants: Sequence[str] | None = None, time_window: Any = None,
             include_evidence: bool = False, query_embedding: np.ndarray | None = None) -> list[MemoryView]:
        """Top-k atoms by embedding similarity to ``query``, as fused views, best first.

        Only Primary atoms are returned unless ``include_evidence``; ``participants`` keeps atoms that
        name any of them; ``time_window`` (date, ISO string or range) keeps atoms whose time anchor
        overlaps it (atoms without one are dropped by a time filter).
        """
        if self._stale:
            self.resync()
        check_query(query, k)
        if query_embedding is None:
            query_embedding = self.embedder.embed([query[: self.max_chars]])
        views = top_k(self, query_embedding, k, participants=participants, time_window=time_window,
                      include_evidence=include_evidence)  # see reads.py: which scorer answers
        self._touch("read", query=query[:200], ids=[v.id for v in views])
        return views

    def where(self, *, participants=None, time_window=None, include_evidence=False) -> dict:
        """The Chroma ``where`` filter for a read (``filters.where_filter``)."""
        return where_filter(participants=participants, time_window=time_window, include_evidence=include_evidence)

    def view(self, atom_id: str, score: float = 1.0) -> MemoryView:
        """The fused view of an atom (see ``fusion.py``)."""
        atom = self._live(atom_id)
        text, evidence = fusion.fused_view(self, atom)
        return MemoryView(id=atom.id, text=text, score=score, atom=atom, evidence_ids=evidence)

    # ------------------------------------------------------------------ update / delete
    def update(self, atom_id: str, text: str, *, time: Any = None, keywords: Sequence[str] | None = None) -> Atom:
        """Replace an atom's text; the previous text goes into its history (with ``time`` as the
        date of the change when given). The atom keeps its id, role and relations."""
        if self._stale:
            self.resync()
        atom = self._live(atom_id)
        clock = self.clock + 1
        new = revised_atom(atom, text, clock, time=time, keywords=keywords, max_chars=self.max_chars,
                           keyword_limit=self.keyword_limit)
        vector = self.embedder.embed([new.text])
        send_text(self, new, vector)
        self.clock = clock
        self._atoms[new.id] = new
        if self._vectors is not None:
            self._vectors.put([new.id], vector)
        self._touch("update", id=new.id, previous=atom.text)
        self._maybe_flush()
        return new

    def delete(self, atom_id: str) -> Atom:
        """Remove an atom from retrieval. Atoms it had demoted are re-derived (they may become
        Primary again); it stays in Chroma and in the log with role ``deleted``."""
        if self._stale:
            self.resync()
        atom = self._live(atom_id)
        changed = deletion(atom, self._atoms, self._incoming)  # see roles.py
        clock = self.clock + 1
        self._write({aid: dataclasses.replace(self._atoms[aid], role=r, updated_at=clock) for aid, r in changed.items()},
                    "deleting an atom", clock)
        self._touch("delete", id=atom.id, text=atom.text, roles={k: v.value for k, v in changed.items()})
        return self._atoms[atom.id]

    # ------------------------------------------------------------------ relations
    def relate(self, new_id: str, old_id: str, label: str | Relation) -> dict[str, Role]:
        """Record ``label(new, old)``; returns the roles that changed (id -> role).

        A pair carries one label: relating it again (either direction) replaces the earlier label.
        Labels that would make atoms demote each other in a cycle are refused.
        """
        rel = parse_label(label, new_id, old_id)
        if self._stale:
            self.resync()
        new, old = self._live(new_id), self._live(old_id)
        clock = self.clock + 1
        staged, changed = relabel(new, old, rel, self._atoms, self._incoming, clock)  # see roles.py
        self._write(staged, "relating atoms", clock)
        self._incoming.setdefault(old.id, set()).add(new.id)
        self._incoming.get(new.id, set()).discard(old.id)
        self._touch("relate", new=new.id, old=old.id, label=rel.value, roles={k: v.value for k, v in changed.items()})
        return changed

    # ------------------------------------------------------------------ metadata writes
    def _write(self, staged: dict[str, Atom], what: str, clock: int) -> None:
        """Write metadata of several atoms in one Chroma call, then commit them to the mirror."""
        if staged:
            send_meta(self, staged, what)
            for aid, atom in staged.items():
                self._role_counts[self._atoms[aid].role] -= 1
                self._role_counts[atom.role] += 1
            self._atoms.update(staged)
        self.clock = clock
        if staged:
            self._maybe_flush()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Flush pending writes and let go of the namespace's writer lock (persistent paths)."""
        try:
            self.flush()
        finally:
            self._release()

    def drop(self) -> None:
        """Delete the namespace's collection (the episode is over)."""
        self._pending.clear()  # nothing left to write: the collection goes
        if self._vectors is not None:
            self._vectors.clear()
        self._chroma("dropping the namespace", self.client.delete_collection, COLLECTION_PREFIX + self.namespace)
        self._release()
        self._atoms.clear()
        self._incoming.clear()
        self._role_counts = {role: 0 for role in Role}
        self._touch("drop")

    def snapshot(self) -> list[dict]:
        """Every atom (deleted included) as plain dicts: for trajectories, the viewer and tests."""
        return [a.to_dict() for a in sorted(self._atoms.values(), key=lambda a: a.created_at)]

    def chroma_contents(self) -> dict[str, tuple]:
        """What Chroma holds for the namespace, id -> (document, metadata, embedding rounded to 6
        places), after pending writes: for tests that compare Chroma's state and for debugging."""
        return contents(self._chroma, self.collection)

    @staticmethod
    def now() -> str:
        return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def wall_ms(fn, *args, **kwargs) -> tuple[Any, float]:
    """(result, elapsed milliseconds) of one call; used by the benchmarks."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, (time.perf_counter() - t0) * 1e3
