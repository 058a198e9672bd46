"""The extractor: a window of dialogue turns (or a document chunk) -> validated atomic facts.

Algorithm.

1. Windows (:func:`windows`): each block (a dialogue session or a document) is cut into windows of
   at most ``window_turns`` units and ``window_tokens`` tokens, never across blocks, so every window
   has one date: the session date, used to anchor relative times. A window is rendered as a header
   (``Session S3 (date: 2023-05-08). Speakers: A, B.``) and one ``[turn id] Speaker: text`` line per
   unit; the ids are what ``source_turns`` must name.
2. One LLM call per window with :data:`SYSTEM` (the schema of ``schema.py``, one example); all windows
   of a block are sent together (one batched ``generate``).
3. The reply is parsed and validated (``schema.parse_reply``/``validate``); metadata the window
   determines is repaired locally, not by another call: a fact whose ``source_turns`` are missing or
   outside the window is grounded in the window turn that holds most of its terms
   (``schema.ground_turns``, counted in ``grounded``), and a ``time`` that is not a date is dropped
   (counted in ``retimed``) and anchored in step 4. If the reply is unreadable or any
   fact is invalid, the model is asked again with its reply and the list of errors, at most
   ``max_retries`` times (all failing windows of the block in one batch); a reply whose only invalid
   fact is the last one, cut by ``max_new_tokens``, is not retried (counted in ``cut``). The attempt with the most
   valid facts is kept; its invalid facts are counted (``invalid_facts``) and skipped, and a window
   whose every attempt was unreadable is counted (``invalid_windows``) and contributes nothing.
   Nothing here raises on model output.
4. Normalisation: a fact without ``time`` gets the span of its explicit/relative time phrase
   (``schema.anchor_relative``) or else the session day; a fact without participants gets the
   speakers of its source turns.

The extractor runs on any backend of ``atommem_rl.inference.chat_backends`` (Hugging Face, vLLM, OpenAI-compatible):
:func:`extract_block` is a generator that yields lists of ``Request`` and receives the replies, so
the eval harness can batch it with other episodes (``reading.drive``); :func:`extract_tasks` drives
it directly.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any

from atommem_rl.inference.chat_backends import Backend, Request
from atommem_rl.tasks.schema import Block, Task

from .schema import Fact, SchemaError, anchor_relative, parse_reply, validate

SYSTEM = (
    "Extract atomic facts from the dialogue window. Reply with one JSON object and nothing else:\n"
    '{"facts": [{"text": str, "participants": [str], "keywords": [str], "time": "YYYY-MM-DD"|"YYYY-MM"|"YYYY"|null, '
    '"source_turns": [turn id], "profile": [{"participant": str, "attribute": str, "value": str, '
    '"kind": "trait"|"preference"|"history"}]}]}\n'
    "Rules: one fact per piece of information worth remembering; each text is self-contained (full names "
    "instead of pronouns); turn relative times (yesterday, last week) into absolute dates using the session "
    "date; source_turns are the [ids] the fact comes from; profile lists stable traits, preferences or "
    "history of a person stated by the fact (may be empty). Small talk gives no facts: {\"facts\": []}.\n"
    "Example. Session S1 (date: 2023-05-08). [S1:1] Ana: I moved to Lisbon last month.\n"
    '{"facts": [{"text": "Ana moved to Lisbon in April 2023.", "participants": ["Ana"], "keywords": '
    '["Lisbon", "moved"], "time": "2023-04", "source_turns": ["S1:1"], "profile": [{"participant": "Ana", '
    '"attribute": "home city", "value": "Lisbon", "kind": "trait"}]}]}'
)
REPAIR = ("Your reply was not valid: {errors}. Reply again with the corrected JSON object only, following "
          "the schema exactly.")


@dataclass
class ExtractSettings:
    window_turns: int = 8
    window_tokens: int = 384
    max_new_tokens: int = 384
    max_retries: int = 1


@dataclass
class Window:
    block_id: str
    date: dt.date | None
    turn_ids: list[str]
    speakers: dict[str, str]  # turn id -> speaker ("" for a document sentence)
    text: str  # the rendered window the extractor reads
    turns: dict[str, str] = field(default_factory=dict)  # turn id -> text (grounds a fact without source_turns)


@dataclass
class WindowResult:
    window: Window
    facts: list[Fact]
    stats: dict[str, int] = field(default_factory=dict)
    replies: list[str] = field(default_factory=list)


STAT_KEYS = ("windows", "calls", "retries", "repaired", "cut", "invalid_replies", "invalid_facts", "invalid_windows",
             "facts", "grounded", "retimed")


def block_date(block: Block) -> dt.date | None:
    """The block's day: ISO (synthetic tasks) or LoCoMo's "1:56 pm on 8 May, 2023"; None if unknown."""
    if not block.date:
        return None
    try:
        return dt.date.fromisoformat(block.date.strip()[:10])
    except ValueError:
        pass
    from atommem_rl.data.locomo import parse_session_date

    try:
        return parse_session_date(block.date).date()
    except ValueError:
        return None


def windows(task: Task, backend: Backend, s: ExtractSettings, block: Block | None = None) -> list[Window]:
    """The windows of one block (or of every block); see step 1 of the module docstring."""
    out = []
    for b in [block] if block is not None else task.blocks:
        day = block_date(b)
        speakers = sorted({u.speaker for u in b.units if u.speaker})
        if task.kind == "dialogue":
            head = f"Session {b.id} (date: {day.isoformat() if day else 'unknown'})." + (
                f" Speakers: {', '.join(speakers)}." if speakers else "")
        else:
            head = f"Document {b.id}" + (f' "{b.title}"' if b.title else "") + (
                f" (date: {day.isoformat()})." if day else ".")
        units = [u for u in b.units if u.text.strip()]
        cur: list = []
        used = 0

        def flush():
            if cur:
                lines = [head] + [f"[{u.id}] " + (f"{u.speaker}: " if u.speaker else "") + " ".join(u.text.split())
                                  for u in cur]
                out.append(Window(b.id, day, [u.id for u in cur], {u.id: u.speaker or "" for u in cur},
                                  "\n".join(lines), {u.id: u.text for u in cur}))

        for u in units:
            n = backend.count(u.text) + 8
            if cur and (len(cur) >= s.window_turns or used + n > s.window_tokens):
                flush()
                cur, used = [], 0
            cur.append(u)
            used += n
        flush()
    return out


def messages(window: Window) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": window.text + "\nJSON:"}]


def _attempt(reply: str, window: Window) -> tuple[list[Fact], list[str], bool, bool, bool]:
    """(facts, errors, readable, repaired, cut_only) of one reply; ``cut_only``: the only invalid
    fact is the last one of a reply that needed the repair, i.e. the fact the token limit cut."""
    try:
        obj, repaired = parse_reply(reply)
    except SchemaError as exc:
        return [], [str(exc)], False, False, False
    facts, errors = validate(obj, set(window.turn_ids), window.turns)
    last = f"facts[{len(obj['facts']) - 1}]"
    return facts, errors, True, repaired, repaired and len(errors) == 1 and errors[0].startswith(last)


def _rank(attempt: tuple[list[Fact], list[str], bool]) -> tuple:
    """Readable first, then more valid facts, then fewer errors."""
    facts, errors, readable = attempt
    return readable, len(facts), -len(errors)


def _normalise(f: Fact, w: Window) -> Fact:
    if f.time is None:
        f.time = anchor_relative(f.text, w.date) or ((w.date, w.date) if w.date else None)
    if not f.participants:
        f.participants = list(dict.fromkeys(w.speakers[t] for t in f.source_turns if w.speakers.get(t)))
    return f


def extract_windows(wins: list[Window], s: ExtractSettings, key: Any):
    """Generator: yields lists of requests (all windows at once, then the retries), returns one
    :class:`WindowResult` per window, in order. See steps 2-4 of the module docstring."""
    results = [WindowResult(w, [], dict.fromkeys(STAT_KEYS, 0)) for w in wins]
    best: list[tuple[list[Fact], list[str], bool] | None] = [None] * len(wins)
    convo = [messages(w) for w in wins]
    todo = list(range(len(wins)))
    for attempt in range(s.max_retries + 1):
        if not todo:
            break
        replies = yield [Request(convo[i], s.max_new_tokens, key, role="extract") for i in todo]
        again = []
        for i, reply in zip(todo, replies):
            r = results[i]
            r.replies.append(reply)
            r.stats["calls"] += 1
            r.stats["retries"] += attempt > 0
            facts, errors, readable, repaired, cut_only = _attempt(reply, wins[i])
            r.stats["repaired"] += repaired
            r.stats["cut"] += cut_only
            r.stats["invalid_replies"] += not readable
            cand = (facts, errors, readable)
            if best[i] is None or _rank(cand) > _rank(best[i]):
                best[i] = cand
            # a cut last fact is not retried: greedy decoding under the same limit would cut it again
            if errors and not cut_only and attempt < s.max_retries:
                convo[i] = convo[i][:2] + [{"role": "assistant", "content": reply[:2000]},
                                           {"role": "user", "content": REPAIR.format(errors="; ".join(errors[:4])[:600])}]
                again.append(i)
        todo = again
    for i, r in enumerate(results):
        facts, errors, readable = best[i] or ([], [], False)
        r.stats["windows"] = 1
        r.stats["invalid_facts"] = len(errors) if readable else 0
        r.stats["invalid_windows"] = int(not readable)
        r.facts = [_normalise(f, wins[i]) for f in facts]
        r.stats["facts"] = len(r.facts)
        r.stats["grounded"] = sum(f.grounded for f in r.facts)
        r.stats["retimed"] = sum(f.retimed for f in r.facts)
    return results


def extract_block(task: Task, block: Block, backend: Backend, s: ExtractSettings, key: Any):
    """Generator over one block's windows (see :func:`extract_windows`)."""
    return (yield from extract_windows(windows(task, backend, s, block), s, key))


def add_stats(total: dict[str, int], results: list[WindowResult]) -> dict[str, int]:
    for r in results:
        for k, v in r.stats.items():
            total[k] = total.get(k, 0) + v
    return total


def extract_tasks(tasks: list[Task], backend: Backend, s: ExtractSettings | None = None) -> list[list[WindowResult]]:
    """Every window of every task through ``backend`` (tasks batched together); results per task."""
    from atommem_rl.eval.reading import drive

    s = s or ExtractSettings()

    def one(i, t):
        return (yield from extract_windows(windows(t, backend, s), s, ("extract", i)))

    done = drive({i: one(i, t) for i, t in enumerate(tasks)}, backend)
    return [done[i] for i in range(len(tasks))]


def target_json(facts: list[Fact]) -> str:
    """The canonical reply for a list of facts (training targets)."""
    return json.dumps({"facts": [f.to_dict() for f in facts]}, ensure_ascii=False)
