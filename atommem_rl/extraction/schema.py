"""The extractor's output schema: strict JSON, validated fact by fact, with a bounded local repair.

An extractor reply is one JSON object ``{"facts": [FACT, ...]}`` (an empty list is valid: nothing
worth remembering). A FACT is::

    {"text": "Caroline went to an LGBTQ support group on 2023-05-07.",   # self-contained, <= 400 chars
     "participants": ["Caroline"],          # people the fact is about (names, no pronouns)
     "keywords": ["LGBTQ", "support group"],# salient entities/topics, <= 12
     "time": "2023-05-07" | "2023-05" | "2023" | null,   # absolute anchor of what the fact describes
     "source_turns": ["D1:3"],              # ids of the window's turns it comes from (>= 1)
     "profile": [{"participant": "Caroline", "attribute": "identity", "value": "transgender woman",
                  "kind": "trait" | "preference" | "history"}]}     # optional, stable attributes

Parsing (:func:`parse_reply`) is deliberately small and bounded: the first balanced ``{...}`` of the
reply (code fences and prose around it ignored) is read with ``json.loads``; if that fails, one
repair pass removes trailing commas and closes unbalanced brackets/quotes of a reply that was cut at
``max_new_tokens``. Anything still unreadable is an error for the caller to retry. Validation
(:func:`validate`) keeps every valid fact and reports each invalid one with the reason, so a
single bad fact never loses its neighbours. Metadata the window itself determines is repaired
locally rather than by asking the model again (given the window's turn texts): ids outside the
window are dropped from ``source_turns``, and a fact left with none is grounded in the window turn
that holds most of its terms (:func:`ground_turns`), invalid only when no turn does; a ``time`` that
is not a date is dropped (the extractor then anchors the fact from its text or the session date).
``time`` is normalised to a ``(start, end)`` day span
(a month or a year becomes its whole range); a relative phrase ("last week") is not a valid anchor:
the extractor must resolve it against the session date (:func:`anchor_relative` does the same
deterministically for the gold data and for a fact that left ``time`` null).
"""

from __future__ import annotations

import calendar
import datetime as dt
import json
import re
from dataclasses import dataclass, field

PROFILE_KINDS = ("trait", "preference", "history")
MAX_TEXT = 400
MAX_KEYWORDS = 12
MAX_PROFILE = 4


@dataclass
class ProfileItem:
    participant: str
    attribute: str
    value: str
    kind: str = "trait"

    def to_dict(self) -> dict:
        return {"participant": self.participant, "attribute": self.attribute, "value": self.value, "kind": self.kind}


@dataclass
class Fact:
    text: str
    participants: list[str] = field(default_factory=list)
    keywords: list[str] = field(default_factory=list)
    time: tuple[dt.date, dt.date] | None = None
    source_turns: list[str] = field(default_factory=list)
    profile: list[ProfileItem] = field(default_factory=list)
    grounded: bool = False  # source_turns were missing or outside the window and found locally (:func:`ground_turns`)
    retimed: bool = False  # the model's time was not a date; dropped, so normalisation anchors it from the text

    def time_str(self) -> str | None:
        if self.time is None:
            return None
        a, b = self.time
        return a.isoformat() if a == b else span_label(a, b)

    def to_dict(self) -> dict:
        return {"text": self.text, "participants": list(self.participants), "keywords": list(self.keywords),
                "time": self.time_str(), "source_turns": list(self.source_turns),
                "profile": [p.to_dict() for p in self.profile]}


def span_label(a: dt.date, b: dt.date) -> str:
    """``2023-05`` for a whole month, ``2023`` for a whole year, else ``a..b``."""
    if a.day == 1 and b == a.replace(day=calendar.monthrange(a.year, a.month)[1]):
        return f"{a.year:04d}-{a.month:02d}"
    if (a.month, a.day, b.month, b.day) == (1, 1, 12, 31) and a.year == b.year:
        return f"{a.year:04d}"
    return f"{a.isoformat()}..{b.isoformat()}"


class SchemaError(ValueError):
    """The reply as a whole is unusable (not JSON, or no ``facts`` list)."""


# ----------------------------------------------------------------------------- parsing
_FENCE = re.compile(r"```(?:json)?", re.IGNORECASE)
_TRAILING_COMMA = re.compile(r",\s*([}\]])")


def _brackets(text: str, start: int = 0) -> tuple[list[tuple[int, str]], bool]:
    """(position, bracket) of every {, [, } and ] outside JSON strings from ``start``, and whether a
    string is still open at the end (escapes inside strings honoured)."""
    out, in_str, esc = [], False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[]}":
            out.append((i, c))
    return out, in_str


def _first_object(text: str) -> str | None:
    """The first balanced {...} or [...] (string-aware), or the unbalanced tail from its start."""
    found = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if not found:
        return None
    start = min(found)
    depth = 0
    for i, c in _brackets(text, start)[0]:
        depth += 1 if c in "{[" else -1
        if depth == 0:
            return text[start:i + 1]
    return text[start:]


def _close(text: str) -> str:
    """Close what a cut reply left open: a string, then brackets in reverse order; drop a dangling
    key or comma first so the result can parse."""
    marks, in_str = _brackets(text)
    stack: list[str] = []
    for _, c in marks:
        if c in "{[":
            stack.append("}" if c == "{" else "]")
        elif stack:
            stack.pop()
    if in_str:
        text += '"'
    text = re.sub(r",\s*$", "", text.rstrip())
    text = re.sub(r',?\s*"[^"]*"\s*:\s*$', "", text)  # a key without its value
    text = re.sub(r',\s*"[^"]*"$', "", text)  # a cut key (or list item) after a comma
    text = re.sub(r'\{\s*"[^"]*"$', "{", text)  # a cut first key
    return text + "".join(reversed(stack))


def parse_reply(reply: str) -> tuple[dict, bool]:
    """(the reply's JSON object, whether the local repair was needed); SchemaError if unreadable."""
    text = _FENCE.sub("", reply or "")
    obj_text = _first_object(text)
    if obj_text is None:
        raise SchemaError("no JSON object in the reply")
    try:
        obj = json.loads(obj_text)
        repaired = False
    except json.JSONDecodeError:
        try:
            obj = json.loads(_TRAILING_COMMA.sub(r"\1", _close(obj_text)))
            repaired = True
        except json.JSONDecodeError as exc:
            raise SchemaError(f"not valid JSON: {exc.msg} at character {exc.pos}") from None
    if isinstance(obj, list):  # a bare list of facts: accepted as the facts list
        obj = {"facts": obj}
    if not isinstance(obj, dict) or not isinstance(obj.get("facts"), list):
        raise SchemaError('the object has no "facts" list')
    return obj, repaired


# ----------------------------------------------------------------------------- validation
_ISO_DAY = re.compile(r"^(\d{4})-(\d{2})-(\d{2})$")
_ISO_MONTH = re.compile(r"^(\d{4})-(\d{2})$")
_ISO_YEAR = re.compile(r"^(\d{4})$")


def parse_time(value) -> tuple[dt.date, dt.date] | None:
    """``YYYY-MM-DD``, ``YYYY-MM``, ``YYYY``, or ``[start, end]`` of those -> a day span; None for
    null. ValueError for anything else (a relative phrase included)."""
    if value is None or value == "":
        return None
    if isinstance(value, (list, tuple)) and len(value) == 2:
        a, b = parse_time(value[0]), parse_time(value[1])
        if a is None or b is None or b[1] < a[0]:
            raise ValueError(f"bad time range {value!r}")
        return a[0], b[1]
    if not isinstance(value, str):
        raise ValueError(f"time must be a string or null, got {type(value).__name__}")
    v = value.strip()
    if ".." in v:
        return parse_time(v.split("..", 1))
    try:
        if m := _ISO_DAY.match(v):
            d = dt.date(int(m[1]), int(m[2]), int(m[3]))
            return d, d
        if m := _ISO_MONTH.match(v):
            y, mo = int(m[1]), int(m[2])
            return dt.date(y, mo, 1), dt.date(y, mo, calendar.monthrange(y, mo)[1])
        if m := _ISO_YEAR.match(v):
            y = int(m[1])
            return dt.date(y, 1, 1), dt.date(y, 12, 31)
    except ValueError:
        pass
    raise ValueError(f"time {value!r} is not an absolute date (YYYY-MM-DD, YYYY-MM or YYYY)")


def _strings(value, what: str, limit: int) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ValueError(f"{what} must be a list of strings")
    out = list(dict.fromkeys(" ".join(x.split()) for x in value if x.strip()))
    return out[:limit]


GROUND_MIN_SHARE = 0.6


def ground_turns(text: str, turns: dict[str, str], min_share: float = GROUND_MIN_SHARE) -> list[str]:
    """The window turn a fact that named no ``source_turns`` comes from: the turn sharing the largest
    share of the fact's index terms (stemmed, stop words dropped), if that share is at least
    ``min_share``; ties keep the earliest turn. ``[]`` when no turn supports the fact, which then stays
    invalid. This is the one piece of metadata the window itself determines: asking the model again
    costs a whole extraction call (window, reply and error list re-sent), and small extractors omit the
    field far more often than they invent the fact (measured on LoCoMo, docs/BENCHMARKS.md)."""
    from atommem_rl.memory.text import terms

    want = set(terms(text))
    if not want:
        return []
    best, share = None, 0.0
    for tid, turn in turns.items():
        s = len(want & set(terms(turn))) / len(want)
        if s > share:
            best, share = tid, s
    return [best] if best is not None and share >= min_share else []


def validate_fact(raw, turn_ids: set[str], turn_texts: dict[str, str] | None = None) -> Fact:
    """One fact, or ValueError naming what is wrong. With ``turn_texts`` (turn id -> text), the
    window's own metadata is repaired locally instead of making the fact invalid: ids outside the
    window are dropped from ``source_turns`` and a fact left without any is grounded
    (:func:`ground_turns`); a ``time`` that does not parse is dropped (``retimed``)."""
    if not isinstance(raw, dict):
        raise ValueError(f"a fact must be an object, got {type(raw).__name__}")
    text = raw.get("text")
    if not isinstance(text, str) or not text.strip():
        raise ValueError('"text" must be a non-empty string')
    text = " ".join(text.split())
    if len(text) > MAX_TEXT:
        raise ValueError(f'"text" has {len(text)} characters (at most {MAX_TEXT})')
    named = _strings(raw.get("source_turns"), "source_turns", 32)
    src = [t for t in named if t in turn_ids]
    outside = [t for t in named if t not in turn_ids]
    grounded = False
    if turn_texts and not src:
        # small extractors trained elsewhere often copy a session's first id or invent one
        # ("D2:1", "D1:17:12", measured on LoCoMo): the turn holding the fact's terms is the source
        src = ground_turns(text, turn_texts)
        grounded = bool(src)
    if outside and (not src or not turn_texts):  # without the window's texts nothing is repaired
        raise ValueError(f'"source_turns" names turns outside the window: {outside}')
    if not src:
        raise ValueError('"source_turns" must name at least one turn of the window')
    retimed = False
    try:
        time = parse_time(raw.get("time"))
    except ValueError:
        if not turn_texts:
            raise
        time, retimed = None, True
    profile = []
    for p in (raw.get("profile") or [])[:MAX_PROFILE]:
        if not isinstance(p, dict) or not all(isinstance(p.get(k), str) and p.get(k).strip()
                                              for k in ("participant", "attribute", "value")):
            raise ValueError("a profile item needs participant, attribute and value strings")
        kind = p.get("kind") or "trait"
        if kind not in PROFILE_KINDS:
            raise ValueError(f"profile kind {kind!r} is not one of {', '.join(PROFILE_KINDS)}")
        profile.append(ProfileItem(" ".join(p["participant"].split()), " ".join(p["attribute"].split()),
                                   " ".join(p["value"].split()), kind))
    return Fact(text=text, participants=_strings(raw.get("participants"), "participants", 8),
                keywords=_strings(raw.get("keywords"), "keywords", MAX_KEYWORDS),
                time=time, source_turns=src, profile=profile, grounded=grounded, retimed=retimed)


def validate(obj: dict, turn_ids: set[str], turn_texts: dict[str, str] | None = None) -> tuple[list[Fact], list[str]]:
    """(valid facts, one error message per invalid fact); ``turn_texts`` as in :func:`validate_fact`."""
    facts, errors = [], []
    for i, raw in enumerate(obj.get("facts") or []):
        try:
            facts.append(validate_fact(raw, turn_ids, turn_texts))
        except ValueError as exc:
            errors.append(f"facts[{i}]: {exc}")
    return facts, errors


# ----------------------------------------------------------------------------- dates
MONTHS = {m.lower(): i for i, m in enumerate(calendar.month_name) if m}
_REL = [
    (re.compile(r"\byesterday\b", re.I), lambda d: (d - dt.timedelta(days=1),) * 2),
    (re.compile(r"\btoday\b|\btonight\b|\bthis morning\b", re.I), lambda d: (d, d)),
    (re.compile(r"\btomorrow\b", re.I), lambda d: (d + dt.timedelta(days=1),) * 2),
    (re.compile(r"\blast week\b", re.I), lambda d: _week(d - dt.timedelta(days=7))),
    (re.compile(r"\bthis week\b", re.I), lambda d: _week(d)),
    (re.compile(r"\bnext week\b", re.I), lambda d: _week(d + dt.timedelta(days=7))),
    (re.compile(r"\blast month\b", re.I), lambda d: _month(_add_months(d, -1))),
    (re.compile(r"\bnext month\b", re.I), lambda d: _month(_add_months(d, 1))),
    (re.compile(r"\blast year\b", re.I), lambda d: (dt.date(d.year - 1, 1, 1), dt.date(d.year - 1, 12, 31))),
    (re.compile(r"\bnext year\b", re.I), lambda d: (dt.date(d.year + 1, 1, 1), dt.date(d.year + 1, 12, 31))),
]
_IN_MONTH = re.compile(r"\b(?:in\s+)?(" + "|".join(m for m in MONTHS) + r")\s+(\d{4})\b", re.I)


def _week(d: dt.date) -> tuple[dt.date, dt.date]:
    start = d - dt.timedelta(days=d.weekday())
    return start, start + dt.timedelta(days=6)


def _add_months(d: dt.date, n: int) -> dt.date:
    y, m = divmod(d.month - 1 + n, 12)
    return dt.date(d.year + y, m + 1, 1)


def _month(d: dt.date) -> tuple[dt.date, dt.date]:
    return dt.date(d.year, d.month, 1), dt.date(d.year, d.month, calendar.monthrange(d.year, d.month)[1])


def anchor_relative(text: str, session: dt.date | None) -> tuple[dt.date, dt.date] | None:
    """The absolute span a text's time phrase refers to: an explicit "<Month> <year>" first, then a
    relative phrase resolved against the session date; None when the text has neither."""
    if m := _IN_MONTH.search(text or ""):
        return _month(dt.date(int(m[2]), MONTHS[m[1].lower()], 1))
    if session is None:
        return None
    for pat, fn in _REL:
        if pat.search(text or ""):
            return fn(session)
    return None
