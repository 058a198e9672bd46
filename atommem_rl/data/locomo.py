"""LoCoMo (snap-research/LoCoMo, ``locomo10.json``): loader and turn-to-atom conversion, no LLM.

File format (see ``atommem_rl/data/benchmarks/README.md``): a JSON list of samples; each sample has ``sample_id``,
``conversation`` (``speaker_a``, ``speaker_b``, ``session_N`` = list of turns ``{speaker, dia_id,
text[, img_url, blip_caption]}``, ``session_N_date_time`` like ``"1:56 pm on 8 May, 2023"``) and
``qa`` (``question``, ``answer`` or ``adversarial_answer``, ``evidence`` = dia ids, ``category``).

Conversion (one atom per dialogue turn, the retrieval unit of the evidence-recall benchmark):

    text         "Speaker: utterance" (+ " [shares a photo: <blip_caption>]" for image turns)
    participants [speaker]
    time         the session's date (day granularity)
    keywords     ``memory.text.keywords(text)``
    event_ids    [session id, e.g. "S3"]  (a session is the event of its turns)
    source_ids   [dia_id, e.g. "D3:7"]
    id           the dia id with characters outside [A-Za-z0-9_.:-] replaced by "_" (``atom_id``)
    metadata     {"session": N, "turn": position of the turn in the whole conversation (0-based)}
                 -- ``turn`` is the stream order the memory graph's temporal edges use.

QA categories: 1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop, 5 adversarial. Answers are
converted with ``str()`` (some are numbers); adversarial items keep ``adversarial_answer``.
Malformed input raises :class:`LocomoFormatError` naming the file and the record.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..memory import text as _text
from ..memory.store import AtomDraft

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}

_SESSION_KEY = re.compile(r"^session_(\d+)$")
_DATE = re.compile(
    r"^\s*(\d{1,2}):(\d{2})\s*([ap])\.?m\.?\s+on\s+(\d{1,2})\s+([A-Za-z]+),?\s+(\d{4})\s*$", re.IGNORECASE
)
_MONTHS = {m.lower(): i for i, m in enumerate(
    ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
     "November", "December"], start=1)}
_MONTHS.update({k[:3]: v for k, v in list(_MONTHS.items())})
_BAD_ID_CHARS = re.compile(r"[^A-Za-z0-9_.:-]")


class LocomoFormatError(ValueError):
    """The file is not in LoCoMo format; the message names the file and the offending record."""


@dataclass(frozen=True)
class Turn:
    dia_id: str
    speaker: str
    text: str
    session: int
    position: int  # 0-based position in the whole conversation (stream order)
    blip_caption: str | None = None

    @property
    def atom_text(self) -> str:
        out = f"{self.speaker}: {self.text}".strip()
        if self.blip_caption:
            out += f" [shares a photo: {self.blip_caption}]"
        return out


@dataclass(frozen=True)
class Session:
    index: int
    date: dt.datetime | None
    turns: tuple[Turn, ...]

    @property
    def event_id(self) -> str:
        return f"S{self.index}"


@dataclass(frozen=True)
class QA:
    question: str
    answer: str | None
    category: int
    evidence: tuple[str, ...]
    adversarial_answer: str | None = None

    @property
    def category_name(self) -> str:
        return CATEGORIES[self.category]


@dataclass
class Conversation:
    sample_id: str
    speakers: tuple[str, str]
    sessions: list[Session]
    qa: list[QA] = field(default_factory=list)

    @property
    def turns(self) -> list[Turn]:
        return [t for s in self.sessions for t in s.turns]


def parse_session_date(value: str) -> dt.datetime:
    """``"1:56 pm on 8 May, 2023"`` -> ``datetime(2023, 5, 8, 13, 56)``; ValueError otherwise."""
    m = _DATE.match(value) if isinstance(value, str) else None
    if not m:
        raise ValueError(f"unrecognised LoCoMo date {value!r} (expected like '1:56 pm on 8 May, 2023')")
    hour, minute, ampm, day, month, year = m.groups()
    mon = _MONTHS.get(month.lower()) or _MONTHS.get(month.lower()[:3])
    if mon is None:
        raise ValueError(f"unknown month {month!r} in LoCoMo date {value!r}")
    h = int(hour) % 12 + (12 if ampm.lower() == "p" else 0)
    return dt.datetime(int(year), mon, int(day), h, int(minute))


def atom_id(dia_id: str) -> str:
    """A store id for a dia id (``D3:7`` stays ``D3:7``; other characters become ``_``)."""
    out = _BAD_ID_CHARS.sub("_", dia_id.strip())[:128]
    return out or "_"


def _need(cond: bool, path: Path, where: str, msg: str) -> None:
    if not cond:
        raise LocomoFormatError(f"{path}: {where}: {msg}")


def _parse_sample(raw: Any, path: Path, index: int) -> Conversation:
    where = f"record {index}"
    _need(isinstance(raw, dict), path, where, f"expected an object, got {type(raw).__name__}")
    sample_id = str(raw.get("sample_id", f"conv-{index}"))
    where = f"record {index} (sample_id {sample_id!r})"
    conv = raw.get("conversation")
    _need(isinstance(conv, dict), path, where, "missing or non-object 'conversation'")
    for key in ("speaker_a", "speaker_b"):
        _need(isinstance(conv.get(key), str) and conv[key].strip() != "", path, where, f"missing {key!r}")
    sessions: list[Session] = []
    numbers = sorted(int(m.group(1)) for k in conv if (m := _SESSION_KEY.match(k)))
    _need(bool(numbers), path, where, "no 'session_N' lists in 'conversation'")
    position = 0
    seen: set[str] = set()
    for n in numbers:
        turns_raw = conv[f"session_{n}"]
        swhere = f"{where}, session_{n}"
        _need(isinstance(turns_raw, list), path, swhere, f"expected a list of turns, got {type(turns_raw).__name__}")
        date = None
        date_raw = conv.get(f"session_{n}_date_time")
        if date_raw is not None:
            try:
                date = parse_session_date(date_raw)
            except ValueError as exc:
                raise LocomoFormatError(f"{path}: {swhere}_date_time: {exc}") from None
        turns = []
        for j, t in enumerate(turns_raw):
            twhere = f"{swhere}, turn {j}"
            _need(isinstance(t, dict), path, twhere, f"expected an object, got {type(t).__name__}")
            for key in ("speaker", "dia_id", "text"):
                _need(isinstance(t.get(key), str), path, twhere, f"missing or non-string {key!r}")
            _need(t["dia_id"].strip() != "", path, twhere, "empty 'dia_id'")
            _need(t["dia_id"] not in seen, path, twhere, f"duplicate dia_id {t['dia_id']!r}")
            seen.add(t["dia_id"])
            caption = t.get("blip_caption")
            caption = caption.strip() if isinstance(caption, str) and caption.strip() else None
            if not t["text"].strip() and caption is None:
                continue  # nothing to store
            turns.append(Turn(t["dia_id"].strip(), t["speaker"].strip(), t["text"].strip(), n, position, caption))
            position += 1
        sessions.append(Session(n, date, tuple(turns)))
    qa_raw = raw.get("qa", [])
    _need(isinstance(qa_raw, list), path, where, "'qa' must be a list")
    qas = []
    for j, q in enumerate(qa_raw):
        qwhere = f"{where}, qa {j}"
        _need(isinstance(q, dict), path, qwhere, f"expected an object, got {type(q).__name__}")
        _need(isinstance(q.get("question"), str) and q["question"].strip() != "", path, qwhere, "missing 'question'")
        cat = q.get("category")
        _need(isinstance(cat, int) and cat in CATEGORIES, path, qwhere, f"category must be 1-5, got {cat!r}")
        ev = q.get("evidence", [])
        _need(isinstance(ev, list) and all(isinstance(e, str) for e in ev), path, qwhere,
              "'evidence' must be a list of dia id strings")
        ans = q.get("answer")
        adv = q.get("adversarial_answer")
        qas.append(QA(
            question=q["question"].strip(),
            answer=None if ans is None else str(ans),
            category=cat,
            evidence=tuple(ev),
            adversarial_answer=None if adv is None else str(adv),
        ))
    return Conversation(sample_id, (conv["speaker_a"].strip(), conv["speaker_b"].strip()), sessions, qas)


def load_locomo(path: str | Path) -> list[Conversation]:
    """Parse a LoCoMo JSON file (a list of samples, or one sample object)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LocomoFormatError(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise LocomoFormatError(f"{path}: not valid JSON: {exc}") from None
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list):
        raise LocomoFormatError(f"{path}: expected a JSON list of conversations, got {type(raw).__name__}")
    return [_parse_sample(r, path, i) for i, r in enumerate(raw)]


def turn_drafts(conv: Conversation, keyword_limit: int = 24) -> list[AtomDraft]:
    """One :class:`AtomDraft` per turn, in stream order (see the module docstring)."""
    drafts = []
    for s in conv.sessions:
        for t in s.turns:
            text = t.atom_text
            drafts.append(AtomDraft(
                text=text,
                participants=[t.speaker],
                keywords=_text.keywords(text, keyword_limit),
                time=None if s.date is None else s.date.date(),
                event_ids=[s.event_id],
                source_ids=[t.dia_id],
                metadata={"session": s.index, "turn": t.position},
                id=atom_id(t.dia_id),
            ))
    return drafts
