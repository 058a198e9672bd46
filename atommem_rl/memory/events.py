"""The event layer: related atoms grouped into events (AtomMem), persisted in Chroma.

An *event* is ``(id, summary, atom_ids, participants, keywords, time span)``. It lives in its own
collection of the store's client, ``atommem-<namespace>.events``: one record per event, the
document is the summary, the embedding is ``store.embedder`` of the summary (so ``search`` ranks
events by summary similarity), and the metadata holds the atom ids, participants and keywords as
lists (omitted when empty: Chroma rejects empty lists), the time span as day ordinals ``t0``/``t1``
(omitted when unknown), ``closed``, ``summary_by`` (``extractive`` or ``caller``) and ``seq``
(creation order). Chroma is the source of truth; the layer keeps a mirror that a new process
rebuilds from the collection (``EventLayer(store)`` on a reopened store).

Placement (``place`` / ``assign`` without an explicit id) filters the events by open status, shared
participants and time window, ranks the rest by a hybrid of embedding cosine to the members' centroid
and keyword Jaccard, and joins the best one above a threshold, else starts a new event ``e<n>``
(``memory/event_placement.py`` states the algorithm). An atom that already names events in its own
``event_ids`` joins the first of them instead. An explicit ``event_id`` joins that event or creates it.

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
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from .atom import Atom
from .errors import InvalidAtomError, MemoryStoreError
from .event_placement import THRESHOLD, W_COS, W_JAC, EventPlacement, _unit, jaccard  # noqa: F401 (re-exported)
from .event_record import Event, EventHit, EventNotFoundError, Placement, _from_meta, _hull, _to_meta  # noqa: F401 (re-exported)
from .store import COLLECTION_PREFIX, AtomDraft, AtomStore
from .validation import clean_strings

EVENTS_SUFFIX = ".events"
_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


class EventLayer(EventPlacement):
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
