"""Event placement: which event an atom joins (the event layer's algorithm, ``memory/events.py``).

For an atom ``x`` and each event ``E``:

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
caller said where it belongs).

:class:`EventPlacement` is a mixin of :class:`~atommem_rl.memory.events.EventLayer`: it reads the
layer's mirror (``store``, ``_events``, ``_atom_vecs``, ``_centroids``, ``_summary_vecs``, ``_next_seq``
and the weights) and writes nothing but its caches of vectors and centroids.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import text as _text
from .atom import Atom, TimeSpan
from .errors import InvalidAtomError
from .event_record import Event, Placement
from .store import AtomDraft
from .validation import clean_strings, clean_text

W_COS = 0.7
W_JAC = 0.3
THRESHOLD = 0.35


def _unit(v: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(v))
    return v / n if n > 0 else v


def _gap_days(a: TimeSpan, b: TimeSpan) -> int:
    return max(0, (a.start - b.end).days, (b.start - a.end).days)


def jaccard(a: Sequence[str], b: Sequence[str]) -> float:
    sa, sb = set(a), set(b)
    return len(sa & sb) / len(sa | sb) if sa and sb else 0.0


class EventPlacement:
    """Placement of atoms into the events of an :class:`~atommem_rl.memory.events.EventLayer` (see the
    module docstring); the layer's own state comes from its constructor."""

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

