"""AtomStore: one episode's long-term memory of atomic facts, on a Chroma collection.

Operations (AtomMem's CRUD plus ROAM's relation labels):

    create / create_many   validate, embed, add in batches within Chroma's limit (all or nothing)
    read                   top-k Primary atoms by similarity, optional participant and time-window
                           filters; each hit is a *fused view* (see ``fusion.py``)
    update                 new text, previous text kept in the atom's history
    delete                 role -> deleted: gone from retrieval, kept in the log and in Chroma
    relate(new, old, lbl)  record a ROAM label; deterministic rules re-derive the roles of the atoms
                           it touches; text is never rewritten

Roles are a pure function of the relation links between *active* atoms (``_derive_role``), so a
label, a deletion or a reopened store always yields the same roles. Priority when one new atom carries
several labels: conflict > old-subsumed-by-new > equivalent > new-subsumed-by-old > independent.

Consistency model: a namespace has one writer (the episode that owns it). Chroma is the source of
truth; the store keeps a write-through mirror of atom metadata so relation rules, fusion and keyword
scoring never need a round trip, and reopening a namespace (another process, a restarted server)
rebuilds the mirror from Chroma. Every method validates before it writes and updates the mirror only
after Chroma acknowledged the write, so a failed call leaves both exactly as they were.

Write-behind (``write_behind=N``, opt-in; the environments use it with the in-memory backend only,
where nothing is durable anyway). A Chroma write costs milliseconds whatever its size, and an
episode writes a few atoms per step, so per-write round trips dominate a step. With write-behind the
mirror takes validated writes at once and Chroma receives them in batches: at most two calls (an
upsert of new/re-embedded atoms, a metadata update) when N writes are pending, before any other
Chroma call (filtered reads, events, profiles) and on ``flush()``. Unfiltered reads stay exact
without a flush: Chroma answers for the atoms it has, the pending vectors are scored by exact cosine
in numpy, and the two lists are merged. Flush calls are idempotent (upsert / metadata update), so a
failed flush keeps its writes pending and can simply be retried. Acknowledged-but-pending writes are
not durable: persistent and server backends therefore default to write-through.

Exact reads (``exact_below=N``, opt-in; the environments use it with the in-memory backend): the
store also keeps every atom's current vector (``exact.py``) and answers unfiltered reads of a
namespace of at most N atoms with exact cosine in process instead of a Chroma query.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import time
import uuid
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import chromadb
import numpy as np
from chromadb.errors import ChromaError

from . import fusion
from . import text as _text
from . import writer_lock
from .atom import (
    DEMOTES_NEW,
    DEMOTES_OLD,
    PRIORITY,
    RESERVED_PREFIX,
    Atom,
    HistoryEntry,
    Relation,
    Role,
    TimeSpan,
    from_chroma,
    to_chroma_metadata,
)
from .backends import address, is_unavailable, make_client
from .embeddings import Embedder, HashingEmbedder
from .exact import VectorMirror
from .errors import (
    AtomNotFoundError,
    InvalidAtomError,
    InvalidMetadataError,
    InvalidRelationError,
    MemoryStoreError,
    StoreUnavailableError,
)

_NAMESPACE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,180}[A-Za-z0-9])?$")
_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_AUTO_ID = re.compile(r"^a(\d+)(?:-[0-9a-f]{4})?$")  # a12-3f9c (and a12, written before writer tags)
COLLECTION_PREFIX = "atommem-"


@dataclass
class AtomDraft:
    """The fields a caller supplies for a new atom (everything else is derived)."""

    text: str
    participants: Sequence[str] = ()
    keywords: Sequence[str] | None = None  # None: extracted from the text
    time: Any = None  # date, ISO string, (start, end) or TimeSpan
    event_ids: Sequence[str] = ()
    source_ids: Sequence[str] = ()
    metadata: dict[str, Any] | None = None
    id: str | None = None  # None: the store assigns a1-<writer>, a2-<writer>, ... (see AtomStore)


@dataclass
class MemoryView:
    """What retrieval returns: a Primary atom's fused view and how it was found."""

    id: str
    text: str  # fused: the atom's text plus folded-in changes and complementary details
    score: float
    atom: Atom
    evidence_ids: list[str] = field(default_factory=list)


def _translate(exc: Exception, what: str, url: str) -> MemoryStoreError:
    """Map an exception from Chroma or its transport to the store's documented types."""
    name = type(exc).__name__
    if is_unavailable(exc):
        return StoreUnavailableError(f"Chroma server {url} unreachable during {what}: {name}: {exc}",
                                     url=url, operation=what)
    return MemoryStoreError(f"Chroma rejected {what}: {name}: {exc}")


class AtomStore:
    """The long-term store of one namespace (one episode). See the module docstring."""

    def __init__(
        self,
        namespace: str,
        *,
        client: "chromadb.api.ClientAPI | None" = None,
        embedder: Embedder | None = None,
        max_chars: int = 4000,
        keyword_limit: int = 24,
        write_behind: int = 0,
        exact_below: int = 0,
        writer: str | None = None,
    ):
        if not isinstance(namespace, str) or not _NAMESPACE.match(namespace):
            raise InvalidAtomError(
                f"namespace {namespace!r} must be 1-182 characters of [A-Za-z0-9._-], "
                "starting and ending with a letter or digit"
            )
        self.namespace = namespace
        # ids the store assigns are a<seq>-<writer>: two writers of one namespace (two processes on a
        # server, two stores in one process) never pick the same id, where a1, a2, ... per writer
        # collided and Chroma ignored the second add of each id
        # (``writer``: a fixed tag of 4 hex digits, for tests that compare two stores id for id)
        self.writer = writer if writer is not None else uuid.uuid4().hex[:4]
        if not re.fullmatch(r"[0-9a-f]{4}", self.writer):
            raise ValueError(f"writer must be 4 hex digits, got {writer!r}")
        self._stale = False  # set when a call's outcome is unknown (transport failure): resync first
        self.client = client if client is not None else make_client("memory")
        self.embedder = embedder if embedder is not None else HashingEmbedder()
        self.max_chars = int(max_chars)
        self.keyword_limit = int(keyword_limit)
        if not isinstance(write_behind, int) or write_behind < 0:
            raise ValueError(f"write_behind must be a non-negative int, got {write_behind!r}")
        self.write_behind = write_behind
        self._pending: dict[str, str] = {}  # atom id -> "new" | "full" (re-embedded) | "meta"
        self._pending_vec: dict[str, np.ndarray] = {}  # vectors Chroma does not have yet
        self._flush_failed = False  # the next flush must be idempotent (upsert)
        if not isinstance(exact_below, int) or exact_below < 0:
            raise ValueError(f"exact_below must be a non-negative int, got {exact_below!r}")
        self.exact_below = exact_below
        self._vectors = VectorMirror() if exact_below else None  # every atom's vector (exact reads)
        lock = writer_lock.acquire(self.client, namespace)  # a persistent path: one writing process
        self._release = weakref.finalize(self, writer_lock.release, lock)
        try:
            self._open()
        except BaseException:
            self._release()
            raise

    def _open(self) -> None:
        self.collection = self._chroma(
            "opening the collection",
            self.client.get_or_create_collection,
            name=COLLECTION_PREFIX + self.namespace,
            embedding_function=self.embedder,
            configuration={"hnsw": {"space": "cosine"}},
        )
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
            err = _translate(exc, what, address(self.client))
            if isinstance(err, StoreUnavailableError):
                self._stale = True  # a write may or may not have landed: the mirror is rebuilt before the next call
            elif isinstance(exc, (ChromaError, ValueError, TypeError)):
                err = MemoryStoreError(f"Chroma rejected {what}: {exc}")
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
        offset = 0
        while True:
            page = self._chroma(
                "loading atoms", self.collection.get,
                include=["documents", "metadatas"] + (["embeddings"] if self._vectors is not None else []),
                limit=self.batch_size, offset=offset,
            )
            for aid, doc, meta in zip(page["ids"], page["documents"], page["metadatas"]):
                atom = from_chroma(aid, doc, meta)
                self._atoms[aid] = atom
                self.clock = max(self.clock, atom.updated_at, atom.created_at)
            if self._vectors is not None and len(page["ids"]):
                self._vectors.put(list(page["ids"]), page["embeddings"])
            if len(page["ids"]) < self.batch_size:
                break
            offset += self.batch_size
        for atom in self._atoms.values():
            self._role_counts[atom.role] += 1
            for old in atom.relations:
                self._incoming.setdefault(old, set()).add(atom.id)
        self._next_seq = 1 + max((int(m.group(1)) for m in map(_AUTO_ID.match, self._atoms) if m), default=0)

    def _touch(self, op: str, **details) -> None:
        if op != "read":  # reads change nothing that derived indexes depend on
            self.version += 1
        self.log.append({"op": op, "clock": self.clock, **details})

    # ------------------------------------------------------------------ validation
    def _clean_text(self, text: Any) -> str:
        if not isinstance(text, str):
            raise InvalidAtomError(f"atom text must be a string, got {type(text).__name__}")
        cleaned = text.strip()
        if not cleaned:
            raise InvalidAtomError("atom text is empty or whitespace")
        if len(cleaned) > self.max_chars:
            raise InvalidAtomError(
                f"atom text has {len(cleaned)} characters; the cap is {self.max_chars} "
                "(store an atomic fact, or split the text)"
            )
        if "\x00" in cleaned:
            raise InvalidAtomError("atom text contains a NUL character")
        return cleaned

    @staticmethod
    def _clean_strings(values: Any, what: str) -> tuple[str, ...]:
        if values is None:
            return ()
        if isinstance(values, str):
            values = [values]
        if not isinstance(values, (list, tuple)):
            raise InvalidAtomError(f"{what} must be a list of strings, got {type(values).__name__}")
        out: dict[str, None] = {}
        for v in values:
            if not isinstance(v, str) or not v.strip():
                raise InvalidAtomError(f"{what} must be non-empty strings, got {v!r}")
            out.setdefault(v.strip(), None)
        return tuple(out)

    @staticmethod
    def _clean_metadata(meta: Any) -> dict[str, Any]:
        if meta is None:
            return {}
        if not isinstance(meta, dict):
            raise InvalidMetadataError(f"metadata must be a dict, got {type(meta).__name__}")
        out = {}
        for key, value in meta.items():
            if not isinstance(key, str) or not key:
                raise InvalidMetadataError(f"metadata keys must be non-empty strings, got {key!r}")
            if key.startswith(RESERVED_PREFIX):
                raise InvalidMetadataError(f"metadata key {key!r} uses the store's reserved prefix")
            if value is None or isinstance(value, (str, bool, int, float)):
                if isinstance(value, float) and not np.isfinite(value):
                    raise InvalidMetadataError(f"metadata {key!r} is not a finite number: {value!r}")
                out[key] = value
                continue
            if isinstance(value, (list, tuple)):
                if not value:
                    raise InvalidMetadataError(f"metadata {key!r} is an empty list; Chroma stores None instead")
                kinds = {type(v) for v in value}
                if len(kinds) != 1 or not kinds <= {str, int, float, bool}:
                    raise InvalidMetadataError(
                        f"metadata {key!r} must be a list of one scalar type, got {sorted(k.__name__ for k in kinds)}"
                    )
                out[key] = list(value)
                continue
            raise InvalidMetadataError(
                f"metadata {key!r} has a {type(value).__name__}; Chroma stores str, int, float, bool, None "
                "or non-empty lists of one of those"
            )
        return out

    def _draft_to_atom(self, draft: AtomDraft, atom_id: str, clock: int) -> Atom:
        text = self._clean_text(draft.text)
        kws = (
            _text.keywords(text, self.keyword_limit)
            if draft.keywords is None
            else self._clean_strings(draft.keywords, "keywords")
        )
        return Atom(
            id=atom_id,
            text=text,
            participants=self._clean_strings(draft.participants, "participants"),
            keywords=kws,
            time=TimeSpan.parse(draft.time),
            event_ids=self._clean_strings(draft.event_ids, "event_ids"),
            source_ids=self._clean_strings(draft.source_ids, "source_ids"),
            created_at=clock,
            updated_at=clock,
            metadata=self._clean_metadata(draft.metadata),
        )

    def _live(self, atom_id: Any) -> Atom:
        if not isinstance(atom_id, str):
            raise AtomNotFoundError(f"atom id must be a string, got {type(atom_id).__name__}")
        atom = self._atoms.get(atom_id)
        if atom is None:
            raise AtomNotFoundError(f"no atom {atom_id!r} in namespace {self.namespace!r}")
        if not atom.active:
            raise AtomNotFoundError(f"atom {atom_id!r} was deleted")
        return atom

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
            if d.id is None:
                while f"a{seq}-{self.writer}" in self._atoms or f"a{seq}-{self.writer}" in seen:
                    seq += 1
                aid = f"a{seq}-{self.writer}"
                seq += 1
            else:
                aid = d.id
                if not isinstance(aid, str) or not _ID.match(aid):
                    raise InvalidAtomError(f"atom id {aid!r} must be 1-128 characters of [A-Za-z0-9_.:-]")
                if aid in self._atoms or aid in seen:
                    raise InvalidAtomError(f"atom id {aid!r} already exists in namespace {self.namespace!r}")
            seen.add(aid)
            atoms.append(self._draft_to_atom(d, aid, clock))
        vectors = self.embedder.embed([a.text for a in atoms])
        if self.write_behind:
            for a, v in zip(atoms, vectors):
                self._pending[a.id] = "new"
                self._pending_vec[a.id] = np.asarray(v, dtype=np.float32)
            self._commit_created(atoms, clock, seq, vectors)
            self._maybe_flush()
            return atoms
        written: list[str] = []
        try:
            for start in range(0, len(atoms), self.batch_size):
                chunk = atoms[start : start + self.batch_size]
                self._refuse_existing([a.id for a in chunk])
                self._chroma(
                    "adding atoms", self.collection.add,
                    ids=[a.id for a in chunk],
                    documents=[a.text for a in chunk],
                    embeddings=vectors[start : start + len(chunk)],
                    metadatas=[to_chroma_metadata(a) for a in chunk],
                )
                written.extend(a.id for a in chunk)
        except MemoryStoreError:
            if written:  # roll back the batches that did land
                for s in range(0, len(written), self.batch_size):
                    try:
                        self.collection.delete(ids=written[s : s + self.batch_size])
                    except Exception:  # the original error is the one worth reporting
                        pass
            raise
        self._commit_created(atoms, clock, seq, vectors)
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
        if len(self._pending) >= self.write_behind:
            self.flush()

    def flush(self) -> None:
        """Send pending writes to Chroma (write-behind mode; a no-op otherwise): one ``add`` for new
        atoms, one ``update`` for re-embedded ones, one metadata ``update`` for the rest, each split at
        Chroma's batch limit. A failed flush keeps everything pending; the retry sends new and
        re-embedded atoms with ``upsert``, which is idempotent whatever part had landed. (Upsert is
        not the normal path: with new and existing ids mixed in one call, Chroma 1.5.9's HNSW index
        missed true nearest neighbours in about 1 read in 200 in tests/test_write_behind.py.)"""
        if not self._pending:
            return
        kinds = {"new": [], "full": [], "meta": []}
        for aid, kind in self._pending.items():
            kinds[kind].append(aid)
        if self._flush_failed:  # whatever landed before, upsert then a metadata update converge
            calls = [(kinds["new"] + kinds["full"], self.collection.upsert, True, False),
                     (kinds["new"] + kinds["full"], self.collection.update, False, True)]
        else:
            calls = [(kinds["new"], self.collection.add, True, False),
                     (kinds["full"], self.collection.update, True, True)]
        calls.append((kinds["meta"], self.collection.update, False, True))
        self._flush_failed = True  # until every call below has been acknowledged
        for ids_all, fn, with_text, for_update in calls:
            for start in range(0, len(ids_all), self.batch_size):
                ids = ids_all[start : start + self.batch_size]
                if fn == self.collection.add:
                    self._refuse_existing(ids)
                atoms = [self._atoms[i] for i in ids]
                payload = {"metadatas": [to_chroma_metadata(a, for_update=for_update) for a in atoms]}
                if with_text:
                    payload.update(documents=[a.text for a in atoms],
                                   embeddings=np.stack([self._pending_vec[i] for i in ids]))
                self._call("writing pending atoms", fn, ids=ids, **payload)
        self._flush_failed = False
        self._pending.clear()
        self._pending_vec.clear()

    @property
    def pending(self) -> int:
        """Writes acknowledged to the caller but not yet sent to Chroma (write-behind mode)."""
        return len(self._pending)

    # ------------------------------------------------------------------ read
    def read(
        self,
        query: str,
        k: int = 6,
        *,
        participants: Sequence[str] | None = None,
        time_window: Any = None,
        include_evidence: bool = False,
        query_embedding: np.ndarray | None = None,
    ) -> list[MemoryView]:
        """Top-k atoms by embedding similarity to ``query``, as fused views, best first.

        Only Primary atoms are returned unless ``include_evidence``; ``participants`` keeps atoms that
        name any of them; ``time_window`` (date, ISO string or range) keeps atoms whose time anchor
        overlaps it (atoms without one are dropped by a time filter).
        """
        if self._stale:
            self.resync()
        if not isinstance(query, str) or not query.strip():
            raise InvalidAtomError("read query is empty or whitespace")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise InvalidAtomError(f"k must be a positive integer, got {k!r}")
        if query_embedding is None:
            query_embedding = self.embedder.embed([query[: self.max_chars]])
        allowed = {Role.PRIMARY, Role.EVIDENCE} if include_evidence else {Role.PRIMARY}
        hidden = sum(n for role, n in self._role_counts.items() if role not in allowed)
        if participants is None and time_window is None and hidden <= max(64, 4 * k):
            # Chroma answers a ``where`` query by scanning metadata (linear in the namespace: 2.6 s at
            # 100k atoms here); when few atoms are hidden, over-fetching k + hidden nearest neighbours
            # without a filter and dropping the hidden ones is exact and takes milliseconds
            where, n_fetch = None, min(k + hidden, len(self._atoms))
        else:
            where = self.where(participants=participants, time_window=time_window, include_evidence=include_evidence)
            n_fetch = k
        qvec = np.asarray(query_embedding, dtype=np.float32).reshape(1, -1)
        if where is None and self._vectors is not None and len(self._atoms) <= self.exact_below:
            scored = self._vectors.search(qvec[0], n_fetch)
        elif where is None and self._pending:
            scored = self._read_with_pending(qvec, n_fetch)
        else:
            res = self._chroma(
                "querying atoms", self.collection.query, query_embeddings=qvec,
                n_results=max(1, n_fetch), where=where, include=["distances"],
            ) if self._atoms else {"ids": [[]], "distances": [[]]}
            scored = [(aid, 1.0 - float(dist)) for aid, dist in zip(res["ids"][0], res["distances"][0])]
        keep = self._filter(participants, time_window) if where is not None else None
        views = []
        for aid, score in scored:
            atom = self._atoms.get(aid)
            if atom is not None and atom.role in allowed and len(views) < k and (keep is None or keep(atom)):
                views.append(self.view(aid, score=score))
        self._touch("read", query=query[:200], ids=[v.id for v in views])
        return views

    def _filter(self, participants, time_window):
        """The read filter checked again on the mirror. Chroma 1.5.9 can answer a ``$contains`` filter
        with an atom that lacks the key, after a dropped collection whose atoms had the same ids
        (tests/test_write_behind.py::test_filtered_read_ignores_a_dropped_namespaces_index)."""
        people = set(self._clean_strings(participants, "participants"))
        span = TimeSpan.parse(time_window)

        def keep(atom: Atom) -> bool:
            if people and not people & set(atom.participants):
                return False
            return span is None or (atom.time is not None and atom.time.overlaps(span))

        return keep

    def _read_with_pending(self, qvec: np.ndarray, n_fetch: int) -> list[tuple[str, float]]:
        """(id, cosine) best first: Chroma's neighbours among the atoms it holds current vectors for,
        merged with exact cosine over the pending vectors (a stale Chroma vector is never used)."""
        fresh = list(self._pending_vec)
        in_chroma = len(self._atoms) - sum(1 for kind in self._pending.values() if kind == "new")
        scored: list[tuple[str, float]] = []
        n = min(n_fetch + len(fresh), in_chroma)
        if n > 0:
            res = self._call("querying atoms", self.collection.query, query_embeddings=qvec,
                             n_results=n, include=["distances"])
            scored = [(aid, 1.0 - float(d)) for aid, d in zip(res["ids"][0], res["distances"][0])
                      if aid not in self._pending_vec]
        if fresh:
            m = np.stack([self._pending_vec[i] for i in fresh])
            q = qvec[0]
            denom = np.linalg.norm(m, axis=1) * (np.linalg.norm(q) or 1.0)
            cos = (m @ q) / np.where(denom > 0, denom, 1.0)
            scored.extend(zip(fresh, (float(c) for c in cos)))
        scored.sort(key=lambda x: -x[1])
        return scored

    def where(self, *, participants=None, time_window=None, include_evidence=False) -> dict:
        """The Chroma ``where`` filter for a read (one top-level key, clauses joined with $and)."""
        roles = [Role.PRIMARY.value, Role.EVIDENCE.value] if include_evidence else [Role.PRIMARY.value]
        clauses: list[dict] = [{RESERVED_PREFIX + "role": {"$in": roles}}]
        people = self._clean_strings(participants, "participants")
        if people:
            ors = [{RESERVED_PREFIX + "participants": {"$contains": p}} for p in people]
            clauses.append(ors[0] if len(ors) == 1 else {"$or": ors})
        span = TimeSpan.parse(time_window)
        if span is not None:
            clauses.append({RESERVED_PREFIX + "t0": {"$lte": span.end.toordinal()}})
            clauses.append({RESERVED_PREFIX + "t1": {"$gte": span.start.toordinal()}})
        return clauses[0] if len(clauses) == 1 else {"$and": clauses}

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
        new_text = self._clean_text(text)
        span = TimeSpan.parse(time)
        kws = _text.keywords(new_text, self.keyword_limit) if keywords is None else self._clean_strings(keywords, "keywords")
        clock = self.clock + 1
        new = dataclasses.replace(
            atom,
            text=new_text,
            keywords=kws,
            time=span if span is not None else atom.time,
            history=atom.history + [HistoryEntry(atom.text, clock, None if span is None else span.start.isoformat())],
            relations=dict(atom.relations),
            metadata=dict(atom.metadata),
            updated_at=clock,
        )
        vector = self.embedder.embed([new.text])
        if self.write_behind:
            self._pending[new.id] = "new" if self._pending.get(new.id) == "new" else "full"
            self._pending_vec[new.id] = np.asarray(vector[0], dtype=np.float32)
        else:
            self._chroma(
                "updating an atom", self.collection.update,
                ids=[new.id], documents=[new.text], embeddings=vector,
                metadatas=[to_chroma_metadata(new, for_update=True)],
            )
        self.clock = clock
        self._atoms[new.id] = new
        if self._vectors is not None:
            self._vectors.put([new.id], vector)
        self._touch("update", id=new.id, previous=atom.text)
        if self.write_behind:
            self._maybe_flush()
        return new

    def delete(self, atom_id: str) -> Atom:
        """Remove an atom from retrieval. Atoms it had demoted are re-derived (they may become
        Primary again); it stays in Chroma and in the log with role ``deleted``."""
        if self._stale:
            self.resync()
        atom = self._live(atom_id)
        changed = {atom.id: Role.DELETED}
        affected = set(atom.relations) | self._incoming.get(atom.id, set())
        changed.update(self._rederive(affected, overrides=changed))
        self._write_roles(changed, "deleting an atom")
        self._touch("delete", id=atom.id, text=atom.text, roles={k: v.value for k, v in changed.items()})
        return self._atoms[atom.id]

    # ------------------------------------------------------------------ relations
    def relate(self, new_id: str, old_id: str, label: str | Relation) -> dict[str, Role]:
        """Record ``label(new, old)``; returns the roles that changed (id -> role).

        A pair carries one label: relating it again (either direction) replaces the earlier label.
        Labels that would make atoms demote each other in a cycle are refused.
        """
        try:
            rel = Relation.parse(label)
        except ValueError as exc:
            raise InvalidRelationError(str(exc)) from None
        if new_id == old_id:
            raise InvalidRelationError(f"an atom cannot be related to itself ({new_id!r})")
        if self._stale:
            self.resync()
        new, old = self._live(new_id), self._live(old_id)
        links = {new.id: dict(new.relations), old.id: dict(old.relations)}
        links[old.id].pop(new.id, None)  # one label per pair
        links[new.id][old.id] = rel
        if self._would_cycle(new.id, old.id, rel, links):
            raise InvalidRelationError(
                f"{rel.value}({new.id}, {old.id}) would make atoms demote each other in a cycle"
            )
        clock = self.clock + 1
        staged = {aid: dataclasses.replace(self._atoms[aid], relations=rels, updated_at=clock) for aid, rels in links.items()}
        roles = self._rederive({new.id, old.id}, staged=staged)
        for aid, role in roles.items():
            base = staged.get(aid, self._atoms[aid])
            staged[aid] = dataclasses.replace(base, role=role, updated_at=clock)
        self._write(staged, "relating atoms", clock)
        self._incoming.setdefault(old.id, set()).add(new.id)
        self._incoming.get(new.id, set()).discard(old.id)
        self._touch("relate", new=new.id, old=old.id, label=rel.value, roles={k: v.value for k, v in roles.items()})
        return roles

    def _demoters(self, atom_id: str, staged: dict[str, Atom]) -> Iterable[tuple[Atom, Relation]]:
        """(atom, label) for every active atom holding a label *about* ``atom_id``."""
        for src in self._incoming.get(atom_id, set()) | {s for s, a in staged.items() if atom_id in a.relations}:
            a = staged.get(src, self._atoms.get(src))
            if a is not None and a.active and atom_id in a.relations:
                yield a, a.relations[atom_id]

    def _top_label(self, atom: Atom, staged: dict[str, Atom]) -> Relation | None:
        best = None
        for old_id, rel in atom.relations.items():
            old = staged.get(old_id, self._atoms.get(old_id))
            if old is None or not old.active:
                continue
            if best is None or PRIORITY[rel] > PRIORITY[best]:
                best = rel
        return best

    def _derive_role(self, atom: Atom, staged: dict[str, Atom]) -> Role:
        """Evidence when its own winning label says it is covered by an older atom (EQV, NSO), or
        when an active atom labelled it outdated or subsumed (CON, OSN); Primary otherwise."""
        if not atom.active:
            return Role.DELETED
        if self._top_label(atom, staged) in DEMOTES_NEW:
            return Role.EVIDENCE
        if any(rel in DEMOTES_OLD for _, rel in self._demoters(atom.id, staged)):
            return Role.EVIDENCE
        return Role.PRIMARY

    def _rederive(self, ids: Iterable[str], *, staged: dict[str, Atom] | None = None,
                  overrides: dict[str, Role] | None = None) -> dict[str, Role]:
        """New roles for ``ids`` (only those that differ from the current one)."""
        staged = dict(staged or {})
        for aid, role in (overrides or {}).items():
            staged[aid] = dataclasses.replace(staged.get(aid, self._atoms[aid]), role=role)
        out = {}
        for aid in ids:
            atom = staged.get(aid, self._atoms.get(aid))
            if atom is None or not atom.active:
                continue
            role = self._derive_role(atom, staged)
            if role is not self._atoms[aid].role:
                out[aid] = role
        return out

    def _would_cycle(self, new_id: str, old_id: str, rel: Relation, links: dict[str, dict]) -> bool:
        """Would the label close a loop in the demotion graph (edge a -> b: a keeps b as evidence)?

        ``links`` overrides the outgoing labels of the two atoms being related. Every CON/OSN and
        EQV/NSO label counts, whether or not it currently wins, so no later change can form a loop.
        """
        if rel is Relation.INDEPENDENT:
            return False
        winner, covered = (new_id, old_id) if rel in DEMOTES_OLD else (old_id, new_id)

        def outgoing(aid: str) -> dict:
            return links.get(aid, self._atoms[aid].relations)

        def successors(aid: str) -> Iterable[str]:
            for other, r in outgoing(aid).items():
                if r in DEMOTES_OLD and other in self:
                    yield other
            for src in self._incoming.get(aid, set()) | {s for s, l in links.items() if aid in l}:
                if src in self and outgoing(src).get(aid) in DEMOTES_NEW:
                    yield src

        stack, seen = [covered], set()
        while stack:  # is there already a path covered -> ... -> winner?
            cur = stack.pop()
            if cur == winner:
                return True
            if cur not in seen:
                seen.add(cur)
                stack.extend(successors(cur))
        return False

    # ------------------------------------------------------------------ role writes
    def _write_roles(self, roles: dict[str, Role], what: str) -> None:
        clock = self.clock + 1
        staged = {aid: dataclasses.replace(self._atoms[aid], role=r, updated_at=clock) for aid, r in roles.items()}
        self._write(staged, what, clock)

    def _write(self, staged: dict[str, Atom], what: str, clock: int) -> None:
        """Write metadata of several atoms in one Chroma call, then commit them to the mirror."""
        if staged:
            ids = list(staged)
            if self.write_behind:
                for aid in ids:
                    self._pending.setdefault(aid, "meta")
            else:
                self._chroma(what, self.collection.update, ids=ids,
                             metadatas=[to_chroma_metadata(staged[i], for_update=True) for i in ids])
            for aid, atom in staged.items():
                self._role_counts[self._atoms[aid].role] -= 1
                self._role_counts[atom.role] += 1
            self._atoms.update(staged)
        self.clock = clock
        if self.write_behind and staged:
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
        self._pending_vec.clear()
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
        got = self._chroma("reading the namespace", self.collection.get,
                           include=["documents", "metadatas", "embeddings"])
        return {i: (d, m, tuple(round(float(x), 6) for x in e)) for i, d, m, e in
                zip(got["ids"], got["documents"], got["metadatas"], got["embeddings"])}

    @staticmethod
    def now() -> str:
        return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def wall_ms(fn, *args, **kwargs) -> tuple[Any, float]:
    """(result, elapsed milliseconds) of one call; used by the benchmarks."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, (time.perf_counter() - t0) * 1e3
