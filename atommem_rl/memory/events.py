"""The event layer: related atoms grouped into events (AtomMem), persisted in Chroma.

An *event* is ``(id, summary, atom_ids, participants, keywords, time span)``. It lives in its own
collection of the store's client, ``atommem-<namespace>.events``: one record per event, the
document is the summary, the embedding is ``store.embedder`` of the summary (so ``search`` ranks
events by summary similarity), and the metadata holds the atom ids, participants and keywords as
lists (omitted when empty: Chroma rejects empty lists), the time span as day ordinals ``t0``/``t1``
(omitted when unknown), ``closed``, ``summary_by`` (``extractive`` or ``caller``) and ``seq``
(creation order). Chroma is the source of truth; the layer keeps a mirror that a new process
rebuilds from the collection (``EventLayer(store)`` on a reopened store).

Placement (``place`` / ``assign`` without an explicit id). For an atom ``x`` and each event ``E``:

1. Filters (shared metadata; all must pass):
   * open: ``E`` is not closed and has fewer than ``max_atoms`` members;
   * participants: ``x`` and ``E`` share a participant, or both have none;
   * time: if both have a time span, the gap between the spans (0 when they overlap) is at most
     ``window_days``; an unknown time on either side does not block.
2. Hybrid similarity ``s = w_cos * cos(v(x), c(E)) + w_jac * J(K(x), K(E))`` with the defaults
   ``w_cos = 0.7``, ``w_jac = 0.3``: ``v(x)`` is the atom's embedding, ``c(E)`` the normalised
   mean of its members' embeddings (their vectors in the store's collection; the summary vector
   when none is available), ``K`` keyword sets and ``J`` their Jaccard index.
3. ``x`` joins the event with the highest ``s`` if ``s >= threshold`` (default 0.35; ties go to
   the older event), else it starts a new event ``e<n>``.

An atom that already names events in its own ``event_ids`` joins the first of them instead (the
caller said where it belongs). An explicit ``event_id`` joins that event or creates it.

Event fields after every change (a pure function of the members, so a rebuilt layer agrees):
participants = union in first-seen order; time span = hull of the members' spans; keywords = the
members' keywords ranked by how many members carry them (ties: first seen), at most
``max_keywords``; summary (unless the caller gave one, which then stays until the caller replaces
it, e.g. the LLM extractor) = the text of the most central member (highest cosine to the centroid;
ties: the earliest), cut to ``summary_chars``, followed by ``[+n related: top keywords]`` when the
event has more than one member. Deleted atoms stay members (events record what was said) but do
not shape the summary or keywords while an active member exists.

The atom's own ``event_ids`` field belongs to the store, which has no call to change it after
creation, so an atom must be *created* with its event id: use :func:`create_in_event`, which places
the draft first (no write), creates the atom with ``event_ids=[..., chosen id]`` and then records
the membership; or create the atom with ``event_ids=[id]`` yourself and call ``assign(atom)``.

Every method validates before it writes, writes one event with one ``upsert`` and updates the
mirror only after Chroma acknowledged it, so a failed call leaves the layer as it was.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import text as _text
from .atom import Atom, TimeSpan
from .errors import AtomNotFoundError, InvalidAtomError, MemoryStoreError
from .store import COLLECTION_PREFIX, AtomDraft, AtomStore
from .validation import clean_strings, clean_text

EVENTS_SUFFIX = ".events"
_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")

W_COS = 0.7
W_JAC = 0.3
THRESHOLD = 0.35


class EventNotFoundError(AtomNotFoundError):
    """The event id is unknown in this namespace (a :class:`AtomNotFoundError`, so callers that
    catch the store's errors catch it too)."""


@dataclass(frozen=True)
class Event:
    id: str
    summary: str
    atom_ids: tuple[str, ...] = ()
    participants: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    time: TimeSpan | None = None
    closed: bool = False
    summary_by: str = "extractive"  # extractive | caller
    seq: int = 0  # creation order

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "summary": self.summary,
            "atom_ids": list(self.atom_ids),
            "participants": list(self.participants),
            "keywords": list(self.keywords),
            "time": None if self.time is None else [self.time.start.isoformat(), self.time.end.isoformat()],
            "closed": self.closed,
            "summary_by": self.summary_by,
        }


@dataclass(frozen=True)
class Placement:
    """Where ``place`` would put an atom: an existing event (``new`` False) or a new one."""

    event_id: str
    new: bool
    score: float  # hybrid similarity to the chosen event; 0.0 for a new one; 1.0 when the atom named it


@dataclass(frozen=True)
class EventHit:
    event: Event
    score: float  # cosine similarity of the query to the summary


def _to_meta(ev: Event) -> dict[str, Any]:
    meta: dict[str, Any] = {"seq": ev.seq, "closed": ev.closed, "summary_by": ev.summary_by}
    if ev.atom_ids:
        meta["atoms"] = list(ev.atom_ids)
    if ev.participants:
        meta["participants"] = list(ev.participants)
    if ev.keywords:
        meta["keywords"] = list(ev.keywords)
    if ev.time is not None:
        meta["t0"] = ev.time.start.toordinal()
        meta["t1"] = ev.time.end.toordinal()
    return meta


def _from_meta(eid: str, doc: str, meta: dict[str, Any] | None) -> Event:
    meta = meta or {}
    t0, t1 = meta.get("t0"), meta.get("t1")
    return Event(
        id=eid,
        summary=doc or "",
        atom_ids=tuple(meta.get("atoms") or ()),
        participants=tuple(meta.get("participants") or ()),
        keywords=tuple(meta.get("keywords") or ()),
        time=None if t0 is None else TimeSpan(dt.date.fromordinal(int(t0)), dt.date.fromordinal(int(t1))),
        closed=bool(meta.get("closed", False)),
        summary_by=str(meta.get("summary_by", "extractive")),
        seq=int(meta.get("seq", 0)),
    )


def _unit(v: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(v))
    return v / n if n > 0 else v


def _hull(a: TimeSpan | None, b: TimeSpan | None) -> TimeSpan | None:
    if a is None or b is None:
        return a or b
    return TimeSpan(min(a.start, b.start), max(a.end, b.end))


def _gap_days(a: TimeSpan, b: TimeSpan) -> int:
    return max(0, (a.start - b.end).days, (b.start - a.end).days)


def jaccard(a: Sequence[str], b: Sequence[str]) -> float:
    sa, sb = set(a), set(b)
    return len(sa & sb) / len(sa | sb) if sa and sb else 0.0


class EventLayer:
    """Events of one store's namespace. See the module docstring for the algorithm."""

    def __init__(
        self,
        store: AtomStore,
        *,
        w_cos: float = W_COS,
        w_jac: float = W_JAC,
        threshold: float = THRESHOLD,
        window_days: int = 7,
        max_atoms: int = 50,
        max_keywords: int = 24,
        summary_chars: int = 300,
    ):
        if w_cos < 0 or w_jac < 0 or w_cos + w_jac <= 0:
            raise ValueError("w_cos and w_jac must be non-negative and not both zero")
        self.store = store
        self.w_cos, self.w_jac, self.threshold = float(w_cos), float(w_jac), float(threshold)
        self.window_days, self.max_atoms = int(window_days), int(max_atoms)
        self.max_keywords, self.summary_chars = int(max_keywords), int(summary_chars)
        self.name = COLLECTION_PREFIX + store.namespace + EVENTS_SUFFIX
        self.collection = store._chroma(
            "opening the event collection", store.client.get_or_create_collection,
            name=self.name, embedding_function=store.embedder, configuration={"hnsw": {"space": "cosine"}},
        )
        self._events: dict[str, Event] = {}
        self._summary_vecs: dict[str, np.ndarray] = {}
        self._by_atom: dict[str, set[str]] = {}  # atom id -> ids of the events it belongs to
        self._centroids: dict[str, tuple[tuple[str, ...], np.ndarray]] = {}  # event id -> (members, c)
        # atom vectors, shared by all events; filled lazily from the store's collection because a
        # reopened layer should not pay for re-embedding every member
        self._atom_vecs: dict[str, np.ndarray] = {}
        self._load()

    # ------------------------------------------------------------------ loading
    def _load(self) -> None:
        offset, size = 0, self.store.batch_size
        while True:
            page = self.store._chroma(
                "loading events", self.collection.get,
                include=["documents", "metadatas", "embeddings"], limit=size, offset=offset,
            )
            embs = page["embeddings"]
            for i, (eid, doc, meta) in enumerate(zip(page["ids"], page["documents"], page["metadatas"])):
                ev = _from_meta(eid, doc, meta)
                self._events[eid] = ev
                if embs is not None and len(embs) > i:
                    self._summary_vecs[eid] = np.asarray(embs[i], dtype=np.float32)
            if len(page["ids"]) < size:
                break
            offset += size
        for ev in self._events.values():
            for aid in ev.atom_ids:
                self._by_atom.setdefault(aid, set()).add(ev.id)
        self._next_seq = 1 + max((e.seq for e in self._events.values()), default=0)

    def _vectors(self, atom_ids: Sequence[str]) -> dict[str, np.ndarray]:
        """Embeddings of atoms, from the cache or the store's collection (missing ids are skipped)."""
        missing = [a for a in dict.fromkeys(atom_ids) if a not in self._atom_vecs]
        for s in range(0, len(missing), self.store.batch_size):
            page = self.store._chroma(
                "reading atom embeddings", self.store.collection.get,
                ids=missing[s : s + self.store.batch_size], include=["embeddings"],
            )
            for aid, vec in zip(page["ids"], page["embeddings"] if page["embeddings"] is not None else []):
                self._atom_vecs[aid] = np.asarray(vec, dtype=np.float32)
        return {a: self._atom_vecs[a] for a in atom_ids if a in self._atom_vecs}

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._events)

    def __contains__(self, event_id: object) -> bool:
        return event_id in self._events

    def get(self, event_id: str) -> Event:
        ev = self._events.get(event_id) if isinstance(event_id, str) else None
        if ev is None:
            raise EventNotFoundError(f"no event {event_id!r} in namespace {self.store.namespace!r}")
        return ev

    def events(self) -> list[Event]:
        """All events in creation order."""
        return sorted(self._events.values(), key=lambda e: e.seq)

    def events_of(self, atom_id: str) -> list[Event]:
        """The events an atom belongs to, in creation order (empty if none)."""
        return sorted((self._events[e] for e in self._by_atom.get(atom_id, ())), key=lambda e: e.seq)

    def search(self, query: str, k: int = 5, *, participants: Sequence[str] | None = None) -> list[EventHit]:
        """Top-k events by cosine similarity of ``query`` to their summaries, best first;
        ``participants`` keeps events that name any of them."""
        if not isinstance(query, str) or not query.strip():
            raise InvalidAtomError("event search query is empty or whitespace")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise InvalidAtomError(f"k must be a positive integer, got {k!r}")
        if not self._events:
            return []
        people = clean_strings(participants, "participants")
        where = None
        if people:
            ors = [{"participants": {"$contains": p}} for p in people]
            where = ors[0] if len(ors) == 1 else {"$or": ors}
        res = self.store._chroma(
            "querying events", self.collection.query,
            query_embeddings=self.store.embedder.embed([query[: self.store.max_chars]]),
            n_results=min(k, len(self._events)), where=where, include=["distances"],
        )
        return [
            EventHit(self._events[eid], 1.0 - float(dist))
            for eid, dist in zip(res["ids"][0], res["distances"][0])
            if eid in self._events
        ]

    # ------------------------------------------------------------------ placement
    def _features(self, atom: Atom | AtomDraft | dict) -> tuple[str, tuple, tuple, TimeSpan | None, tuple]:
        """(text, participants, keywords, time, event_ids) of an atom or a draft, validated the
        way the store validates them."""
        if isinstance(atom, dict):
            atom = AtomDraft(**atom)
        if isinstance(atom, Atom):
            return atom.text, atom.participants, atom.keywords, atom.time, atom.event_ids
        if not isinstance(atom, AtomDraft):
            raise InvalidAtomError(f"expected an Atom, AtomDraft or dict, got {type(atom).__name__}")
        text = clean_text(atom.text, self.store.max_chars)
        kws = (
            _text.keywords(text, self.store.keyword_limit)
            if atom.keywords is None
            else clean_strings(atom.keywords, "keywords")
        )
        return (text, clean_strings(atom.participants, "participants"), kws,
                TimeSpan.parse(atom.time), clean_strings(atom.event_ids, "event_ids"))

    def _centroid(self, ev: Event) -> np.ndarray | None:
        cached = self._centroids.get(ev.id)
        if cached is not None and cached[0] == ev.atom_ids:
            return cached[1]
        vecs = self._vectors(ev.atom_ids)
        if not vecs:
            return self._summary_vecs.get(ev.id)
        c = _unit(np.sum(list(vecs.values()), axis=0))
        self._centroids[ev.id] = (ev.atom_ids, c)
        return c

    def _eligible(self, ev: Event, participants: tuple, time: TimeSpan | None) -> bool:
        if ev.closed or len(ev.atom_ids) >= self.max_atoms:
            return False
        # both without participants is a match: there is nothing to disagree on
        if (participants or ev.participants) and not set(participants) & set(ev.participants):
            return False
        if time is not None and ev.time is not None and _gap_days(time, ev.time) > self.window_days:
            return False
        return True

    def similarity(self, vec: np.ndarray, keywords: Sequence[str], ev: Event) -> float:
        """The hybrid similarity of an atom (vector, keywords) to an event."""
        c = self._centroid(ev)
        cos = float(np.dot(vec, c)) if c is not None else 0.0
        return self.w_cos * cos + self.w_jac * jaccard(keywords, ev.keywords)

    def place(self, atom: Atom | AtomDraft | dict, *, vector: np.ndarray | None = None) -> Placement:
        """Where the atom would go, without writing anything (see the module docstring)."""
        text, people, kws, time, named = self._features(atom)
        for eid in named:
            if eid in self._events:
                return Placement(eid, False, 1.0)
        if named:  # the caller named an event that does not exist yet: it will be created
            return Placement(named[0], True, 0.0)
        if vector is None and isinstance(atom, Atom):
            vector = self._vectors([atom.id]).get(atom.id)
        if vector is None:
            vector = self.store.embedder.embed([text])[0]
        best, best_score = None, -np.inf
        for ev in self.events():  # creation order, and a strict '>' keeps ties on the older event
            if not self._eligible(ev, people, time):
                continue
            score = self.similarity(vector, kws, ev)
            if score > best_score:
                best, best_score = ev, score
        if best is not None and best_score >= self.threshold:
            return Placement(best.id, False, best_score)
        return Placement(self._new_id(), True, 0.0)

    def _new_id(self) -> str:
        seq = self._next_seq
        while f"e{seq}" in self._events:
            seq += 1
        return f"e{seq}"

    # ------------------------------------------------------------------ writes
    def assign(self, atom: Atom | str, event_id: str | None = None, *, summary: str | None = None) -> Event:
        """Add a stored atom to an event and return the updated event.

        ``event_id`` given: the atom joins that event, which is created if new (an atom may belong
        to several events). Otherwise an atom this layer already placed stays where it is (the call
        is idempotent); a new one joins the first event named in its ``event_ids``, or the event
        ``place`` chooses. An atom already in the chosen event leaves it unchanged, except that a
        ``summary`` is still applied: it replaces the extractive summary until the next caller
        summary. Unknown or deleted atoms raise AtomNotFoundError.
        """
        atom_id = atom.id if isinstance(atom, Atom) else atom
        # the stored version, not the caller's copy: it may be stale, and it must be active
        atom = self.store.get(atom_id)
        if event_id is not None:
            self._check_id(event_id)
        summary = self._check_summary(summary)
        if event_id is None:
            current = self.events_of(atom.id)
            # already placed: assigning again is a no-op rather than a second, possibly different, event
            event_id = current[0].id if current else self.place(atom).event_id
        old = self._events.get(event_id)
        if old is None:
            old = Event(id=event_id, summary="", seq=self._next_seq)
        if atom.id in old.atom_ids and summary is None:
            return old
        members = old.atom_ids if atom.id in old.atom_ids else old.atom_ids + (atom.id,)
        ev = dataclasses.replace(
            old,
            atom_ids=members,
            participants=tuple(dict.fromkeys(old.participants + atom.participants)),
            time=_hull(old.time, atom.time),
        )
        ev = self._refresh(ev, summary)
        self._write(ev)
        self._by_atom.setdefault(atom.id, set()).add(ev.id)
        return ev

    def set_summary(self, event_id: str, summary: str) -> Event:
        """Replace an event's summary (the LLM extractor's); it stays until replaced again."""
        ev = self.get(event_id)
        summary = self._check_summary(summary)
        if summary is None:
            raise InvalidAtomError("summary must be a non-empty string")
        ev = self._refresh(ev, summary)
        self._write(ev)
        return ev

    def close(self, event_id: str) -> Event:
        """Close an event: no atom joins it automatically any more (explicit ids still can)."""
        ev = dataclasses.replace(self.get(event_id), closed=True)
        self._write(ev)
        return ev

    def drop(self) -> None:
        """Delete the event collection."""
        self.store._chroma("dropping the events", self.store.client.delete_collection, self.name)
        self._events.clear()
        self._summary_vecs.clear()
        self._by_atom.clear()
        self._centroids.clear()

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _check_id(event_id: Any) -> None:
        if not isinstance(event_id, str) or not _ID.match(event_id):
            raise InvalidAtomError(f"event id {event_id!r} must be 1-128 characters of [A-Za-z0-9_.:-]")

    def _check_summary(self, summary: Any) -> str | None:
        if summary is None:
            return None
        if not isinstance(summary, str) or not summary.strip():
            raise InvalidAtomError("summary must be a non-empty string")
        if len(summary.strip()) > self.store.max_chars:
            raise InvalidAtomError(f"summary has {len(summary.strip())} characters; the cap is {self.store.max_chars}")
        return summary.strip()

    def _refresh(self, ev: Event, summary: str | None) -> Event:
        """Recompute keywords and (unless the caller owns it) the summary from the members."""
        atoms = [a for a in (self.store.get_any(i) for i in ev.atom_ids) if a is not None]
        shaping = [a for a in atoms if a.active] or atoms
        counts: dict[str, int] = {}
        for a in shaping:
            for kw in dict.fromkeys(a.keywords):
                counts[kw] = counts.get(kw, 0) + 1
        # sorted() is stable, so equal counts keep first-seen order
        kws = tuple(sorted(counts, key=lambda k: -counts[k])[: self.max_keywords]) or ev.keywords
        ev = dataclasses.replace(ev, keywords=kws)
        if summary is not None:
            return dataclasses.replace(ev, summary=summary, summary_by="caller")
        if ev.summary_by == "caller" and ev.summary:
            return ev
        return dataclasses.replace(ev, summary=self._extractive(ev, shaping), summary_by="extractive")

    def _extractive(self, ev: Event, members: list[Atom]) -> str:
        if not members:
            return ev.summary or ev.id
        vecs = self._vectors([a.id for a in members])
        central = members[0]
        if len(vecs) > 1:
            c = _unit(np.sum(list(vecs.values()), axis=0))
            best = -np.inf
            for a in members:  # strict '>' keeps the earliest member on ties
                if a.id in vecs and float(np.dot(vecs[a.id], c)) > best:
                    central, best = a, float(np.dot(vecs[a.id], c))
        text = central.text
        if len(text) > self.summary_chars:
            text = text[: self.summary_chars - 3].rstrip() + "..."
        if len(ev.atom_ids) > 1:
            text += f" [+{len(ev.atom_ids) - 1} related: {', '.join(ev.keywords[:5])}]"
        return text

    def _write(self, ev: Event) -> None:
        vec = self.store.embedder.embed([ev.summary])
        self.store._chroma(
            "writing an event", self.collection.upsert,
            ids=[ev.id], documents=[ev.summary], embeddings=vec, metadatas=[_to_meta(ev)],
        )
        self._events[ev.id] = ev
        self._summary_vecs[ev.id] = vec[0]
        self._next_seq = max(self._next_seq, ev.seq + 1)


def create_in_event(
    store: AtomStore,
    layer: EventLayer,
    draft: AtomDraft | dict,
    *,
    event_id: str | None = None,
    summary: str | None = None,
) -> tuple[Atom, Event]:
    """Create an atom already carrying its event id, and record it in that event.

    Order: place the draft (no write; ``event_id`` overrides the choice), create the atom with the
    event id appended to its ``event_ids`` (a failure here writes nothing), then ``assign``. If that
    last write fails the new atom is deleted from retrieval (``store.delete``: role ``deleted``, as
    the store keeps deleted atoms) and the error is raised, so no active atom names a missing event.
    """
    draft = AtomDraft(**draft) if isinstance(draft, dict) else draft
    if event_id is not None:
        layer._check_id(event_id)
    layer._check_summary(summary)
    text, *_ = layer._features(draft)
    vector = store.embedder.embed([text])[0]
    eid = event_id or layer.place(draft, vector=vector).event_id
    fields = dataclasses.asdict(draft)
    fields["event_ids"] = tuple(dict.fromkeys(tuple(draft.event_ids) + (eid,)))
    atom = store.create_many([AtomDraft(**fields)])[0]
    layer._atom_vecs[atom.id] = vector
    try:
        ev = layer.assign(atom, eid, summary=summary)
    except MemoryStoreError:
        try:
            store.delete(atom.id)
        except MemoryStoreError:
            pass  # the assign error is the one worth reporting
        raise
    return atom, ev
