"""Temporal profiles: stable attributes of each participant, versioned, updated once per session.

Storage. One Chroma collection per namespace, ``atommem-<namespace>.profiles``, in the store's
client, with one record per (participant, attribute): the document is ``"<participant>
<attribute>: <value>"`` (embedded with the store's embedder), the metadata holds ``participant``,
``attribute``, ``value``, ``kind``, ``since`` and ``last_seen`` (ISO days), ``sources`` (list,
omitted when empty) and ``history``, the older versions as a JSON string
``[{"value", "since", "until", "sources", "kind"}, ...]`` in time order. A new process rebuilds
the layer from the collection.

Keys and comparison. Participants match case-insensitively after collapsing whitespace (the first
spelling seen is kept for display). Attributes and values are compared in a normalised form:
Unicode NFKC, case-folded, every run of punctuation/underscores turned into one space, whitespace
collapsed ("Favorite_Food" == "favorite food"; "Sushi!" == "sushi"). The attribute is stored in
that form; a value keeps the caller's spelling (stripped) for display.

Queue, then flush. During a session :meth:`ProfileLayer.queue` validates a candidate
``(participant, attribute, value, time, source_ids, kind)`` (kind: trait, preference or history)
and appends it; nothing is written. :meth:`ProfileLayer.flush` at session end takes the queue in
time order (a candidate without a time gets the session time; ties keep queue order), and
decides each candidate against the state left by the previous ones (``t`` its time):

    create          no record for (participant, attribute): value since ``t``.
    redundant       the value equals the current value: only its sources (union) and
                    ``last_seen = max(last_seen, t)`` change. A candidate about the past whose value
                    equals the history version in force at ``t`` is also redundant (the sources join
                    that version).
    revise_history  ``t`` is earlier than the current value's ``since`` and the value differs: a
                    version ``[t, next start)`` is inserted into the history in time order; the
                    version in force at ``t`` (if any) now ends at ``t``; the current value is
                    untouched.
    update          otherwise (``t >= since``, a different value): the current version moves to the
                    history with ``until = t`` and the candidate becomes the current value since
                    ``t`` (a same-day change keeps the replaced version, as a zero-length one).
                    Old versions are never deleted.

The changed records are written with one ``upsert`` (in Chroma-sized chunks beyond the batch limit,
with the earlier chunks restored if a later one fails); the mirror and the queue change only after
Chroma acknowledged, so a failed flush leaves the stored profiles and the queue as they were.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
from collections.abc import Iterable, Sequence
from typing import Any

from .atom import parse_day
from .embeddings import Embedder
from .errors import AtomNotFoundError, InvalidAtomError, MemoryStoreError
from .profile_record import (DECISIONS, KINDS, FlushReport, ProfileCandidate, ProfileRecord,  # noqa: F401 (re-exported)
                             Version, _pkey, normalise)
from .store import COLLECTION_PREFIX, AtomStore
from .validation import clean_strings

PROFILES_SUFFIX = ".profiles"
MAX_ATTRIBUTE_CHARS = 120


class UnknownParticipantError(AtomNotFoundError):
    """The participant has no profile and is not on the layer's roster (an AtomNotFoundError, so
    callers that catch the store's errors catch it too)."""


class ProfileLayer:
    """Profiles of one store's namespace. See the module docstring for the algorithm.

    ``participants``: an optional roster; when given, candidates for anyone else are refused with
    UnknownParticipantError. Without it every non-empty name is accepted.
    """

    def __init__(self, store: AtomStore, *, participants: Iterable[str] | None = None,
                 embedder: Embedder | None = None):
        self.store = store
        self.embedder = embedder if embedder is not None else store.embedder
        self.name = COLLECTION_PREFIX + store.namespace + PROFILES_SUFFIX
        self.collection = store._chroma(
            "opening the profile collection", store.client.get_or_create_collection,
            name=self.name, embedding_function=self.embedder, configuration={"hnsw": {"space": "cosine"}},
        )
        self.batch_size = store.batch_size
        self._records: dict[tuple[str, str], ProfileRecord] = {}  # (participant key, attribute)
        self._queue: list[ProfileCandidate] = []
        self.roster: dict[str, str] | None = None  # participant key -> display name
        if participants is not None:
            self.roster = {}
            for p in participants:
                if not isinstance(p, str) or not p.strip():
                    raise InvalidAtomError(f"roster names must be non-empty strings, got {p!r}")
                self.roster.setdefault(_pkey(p), " ".join(p.split()))
        self._load()

    def _load(self) -> None:
        offset = 0
        while True:
            page = self.store._chroma("loading profiles", self.collection.get, include=["metadatas"],
                                      limit=self.batch_size, offset=offset)
            for meta in page["metadatas"]:
                rec = ProfileRecord.from_chroma(meta)
                self._records[(_pkey(rec.participant), rec.attribute)] = rec
            if len(page["ids"]) < self.batch_size:
                break
            offset += self.batch_size

    # ------------------------------------------------------------------ validation
    def _clean_participant(self, participant: Any) -> str:
        if not isinstance(participant, str) or not participant.strip():
            raise InvalidAtomError(f"participant must be a non-empty string, got {participant!r}")
        name = " ".join(participant.split())
        if self.roster is not None:
            if _pkey(name) not in self.roster:
                raise UnknownParticipantError(
                    f"participant {name!r} is not on the roster of namespace {self.store.namespace!r}: "
                    f"{sorted(self.roster.values())}"
                )
            return self.roster[_pkey(name)]
        return self._display(name)

    def _display(self, name: str) -> str:
        """The first spelling seen for this participant (roster, then stored records)."""
        key = _pkey(name)
        if self.roster and key in self.roster:
            return self.roster[key]
        for (pk, _), rec in self._records.items():
            if pk == key:
                return rec.participant
        for c in self._queue:
            if _pkey(c.participant) == key:
                return c.participant
        return name

    def candidate(self, participant: str, attribute: str, value: str, *, time: Any = None,
                  source_ids: Sequence[str] = (), kind: str = "trait") -> ProfileCandidate:
        """A validated candidate (not queued). Raises InvalidAtomError or UnknownParticipantError."""
        name = self._clean_participant(participant)
        if not isinstance(attribute, str) or not normalise(attribute):
            raise InvalidAtomError(f"profile attribute must be a non-empty string, got {attribute!r}")
        attr = normalise(attribute)
        if len(attr) > MAX_ATTRIBUTE_CHARS:
            raise InvalidAtomError(f"profile attribute has {len(attr)} characters; the cap is {MAX_ATTRIBUTE_CHARS}")
        if not isinstance(value, str) or not normalise(value):
            raise InvalidAtomError(f"profile value must be a non-empty string, got {value!r}")
        shown = " ".join(value.split())
        if len(shown) > self.store.max_chars:
            raise InvalidAtomError(f"profile value has {len(shown)} characters; the cap is {self.store.max_chars}")
        if kind not in KINDS:
            raise InvalidAtomError(f"profile kind {kind!r} is not one of {', '.join(KINDS)}")
        day = None if time is None else parse_day(time)
        return ProfileCandidate(name, attr, shown, day, clean_strings(source_ids, "source_ids"), kind)

    # ------------------------------------------------------------------ queue
    def queue(self, participant: str, attribute: str, value: str, *, time: Any = None,
              source_ids: Sequence[str] = (), kind: str = "trait") -> ProfileCandidate:
        """Validate a candidate and queue it for the next :meth:`flush` (nothing is written)."""
        cand = self.candidate(participant, attribute, value, time=time, source_ids=source_ids, kind=kind)
        self._queue.append(cand)
        return cand

    @property
    def pending(self) -> tuple[ProfileCandidate, ...]:
        return tuple(self._queue)

    def discard(self) -> int:
        """Drop the queued candidates without applying them; returns how many there were."""
        n = len(self._queue)
        self._queue.clear()
        return n

    # ------------------------------------------------------------------ flush
    def flush(self, session_time: Any) -> FlushReport:
        """Apply the queue (see the module docstring) and return the decisions and their counts."""
        session = parse_day(session_time)
        order = sorted(range(len(self._queue)), key=lambda i: (self._queue[i].time or session, i))
        staged: dict[tuple[str, str], ProfileRecord] = {}
        decisions: list[tuple[ProfileCandidate, str]] = []
        for i in order:
            cand = self._queue[i]
            key = (_pkey(cand.participant), cand.attribute)
            if key not in staged and key in self._records:
                staged[key] = copy.deepcopy(self._records[key])  # never mutate the mirror before the write
            decisions.append((cand, self._apply(staged, key, cand, cand.time or session)))
        counts = {d: 0 for d in DECISIONS}
        for _, d in decisions:
            counts[d] += 1
        self._write(list(staged.values()))
        self._records.update(staged)
        self._queue.clear()
        return FlushReport(session, counts, decisions)

    @staticmethod
    def _apply(staged: dict, key: tuple[str, str], cand: ProfileCandidate, t: dt.date) -> str:
        rec = staged.get(key)
        if rec is None:
            staged[key] = ProfileRecord(cand.participant, cand.attribute,
                                        Version(cand.value, t, None, list(cand.source_ids), cand.kind), t)
            return "create"
        value = normalise(cand.value)
        cur = rec.current
        if value == normalise(cur.value):
            cur.sources = list(dict.fromkeys(cur.sources + list(cand.source_ids)))
            rec.last_seen = max(rec.last_seen, t)
            return "redundant"
        if t < cur.since:
            in_force = next((v for v in rec.history if v.since <= t and (v.until is None or t < v.until)), None)
            if in_force is not None and normalise(in_force.value) == value:
                in_force.sources = list(dict.fromkeys(in_force.sources + list(cand.source_ids)))
                return "redundant"
            later = [v.since for v in rec.history if v.since > t] + [cur.since]
            if in_force is not None:
                in_force.until = t
            rec.history.append(Version(cand.value, t, min(later), list(cand.source_ids), cand.kind))
            rec.history.sort(key=lambda v: v.since)  # stable: a same-day revision follows the version it ends
            return "revise_history"
        rec.history.append(dataclasses.replace(cur, until=t))
        rec.history.sort(key=lambda v: v.since)
        rec.current = Version(cand.value, t, None, list(cand.source_ids), cand.kind)
        rec.last_seen = max(rec.last_seen, t)
        return "update"

    def _write(self, records: list[ProfileRecord]) -> None:
        """Upsert records; if a later chunk fails, restore the earlier chunks, then raise."""
        done: list[ProfileRecord] = []
        try:
            for s in range(0, len(records), self.batch_size):
                chunk = records[s : s + self.batch_size]
                docs = [r.document for r in chunk]
                vectors = self.embedder.embed(docs)  # per chunk: one model call per Chroma call
                self.store._chroma(
                    "writing profiles", self.collection.upsert,
                    ids=[r.id for r in chunk], documents=docs, embeddings=vectors,
                    metadatas=[r.metadata() for r in chunk],
                )
                done.extend(chunk)
        except MemoryStoreError:
            self._restore(done)
            raise

    def _restore(self, written: list[ProfileRecord]) -> None:
        """Put back what ``written`` replaced: the mirror's previous records, or nothing."""
        if not written:
            return
        try:
            old = [self._records[(_pkey(r.participant), r.attribute)] for r in written
                   if (_pkey(r.participant), r.attribute) in self._records]
            new_ids = [r.id for r in written if (_pkey(r.participant), r.attribute) not in self._records]
            for s in range(0, len(old), self.batch_size):
                chunk = old[s : s + self.batch_size]
                self.collection.upsert(ids=[r.id for r in chunk], documents=[r.document for r in chunk],
                                       embeddings=self.embedder.embed([r.document for r in chunk]),
                                       metadatas=[r.metadata() for r in chunk])
            for s in range(0, len(new_ids), self.batch_size):
                self.collection.delete(ids=new_ids[s : s + self.batch_size])
        except Exception:  # the original error is the one worth reporting
            pass

    # ------------------------------------------------------------------ reading
    def participants(self) -> list[str]:
        """Participants with a stored profile or on the roster, sorted."""
        names = {_pkey(r.participant): r.participant for r in self._records.values()}
        for k, v in (self.roster or {}).items():
            names.setdefault(k, v)
        return sorted(names.values())

    def _records_of(self, participant: Any) -> list[ProfileRecord]:
        if not isinstance(participant, str) or not participant.strip():
            raise InvalidAtomError(f"participant must be a non-empty string, got {participant!r}")
        key = _pkey(participant)
        recs = [r for (pk, _), r in self._records.items() if pk == key]
        if not recs and (self.roster is None or key not in self.roster):
            raise UnknownParticipantError(
                f"no profile for participant {participant!r} in namespace {self.store.namespace!r}"
            )
        return recs

    def profile(self, participant: str) -> dict[str, dict]:
        """attribute -> {value, since, kind, sources, last_seen, history: [older versions]}.

        Empty for a roster member without attributes; UnknownParticipantError for anyone else
        without a stored profile."""
        return {r.attribute: r.to_dict() for r in sorted(self._records_of(participant), key=lambda r: r.attribute)}

    def render(self, participant: str, max_chars: int = 600) -> str:
        """Compact text for prompts: one line per attribute, most recently seen first, each with its
        previous value; whole lines are dropped to stay within ``max_chars``. "" when empty."""
        if not isinstance(max_chars, int) or isinstance(max_chars, bool) or max_chars < 1:
            raise InvalidAtomError(f"max_chars must be a positive integer, got {max_chars!r}")
        recs = sorted(self._records_of(participant), key=lambda r: (-r.last_seen.toordinal(), r.attribute))
        if not recs:
            return ""
        out = f"Profile of {recs[0].participant}:"
        if len(out) > max_chars:
            return out[:max_chars]
        for r in recs:
            line = f"\n- {r.attribute}: {r.current.value} (since {r.current.since.isoformat()}"
            if r.history:
                prev = r.history[-1]
                line += f"; before: {prev.value} until {prev.until.isoformat() if prev.until else '?'}"
                if len(r.history) > 1:
                    line += f", +{len(r.history) - 1} older"
            line += ")"
            if len(out) + len(line) > max_chars:
                continue  # a shorter later line may still fit
            out += line
        return out

    def drop(self) -> None:
        """Delete the profile collection."""
        self.store._chroma("dropping the profiles", self.store.client.delete_collection, self.name)
        self._records.clear()
        self._queue.clear()
