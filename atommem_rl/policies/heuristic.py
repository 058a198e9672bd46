"""The heuristic policy: a ROAM-like baseline that uses no gold information.

Chunk steps: every sentence (document) or substantive turn (dialogue) of the chunk becomes one
memory, prefixed with its document title when the header shows one. In the next step, each memory it
created (known from "stored as Mk") is compared with the older memories the prompt shows, by term
overlap (stemmed index terms, ``memory.text.terms``), and labelled with fixed thresholds:

    Jaccard >= 0.85                                    equivalent
    old terms within new terms (new adds >= 2 terms)    old_subsumed_by_new
    new terms within old terms (old adds >= 2 terms)    new_subsumed_by_old
    same subject (first two terms equal), Jaccard >= 0.3, and both hold different capitalised
    names or numbers                                   conflict
    otherwise                                          no call (independent)

To surface those older memories it reads with up to ``read_budget`` of its new facts.
Answer phase: reads each open question once, then answers from the shown memory line sharing most
terms with the question: the last capitalised span (or number) of that line not already in the
question; yes/no questions get "yes".
"""

from __future__ import annotations

import re

from atommem_rl.memory import text as _text

from .base import Policy, calls_text, memory_lines, sections

_HEADER = re.compile(r"^\[(?:Session )?[^\]]+\](?: (?P<title>.*?))?(?: \((?P<date>[^()]*)\))?(?: \(continued\))?$")
_SENT = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9])")
_SPAN = re.compile(r"(?:[A-Z][\w'\-]*(?:\s+(?:of|de|the|van|von|and)?\s*[A-Z][\w'\-]*)*|\d[\d,.]*)")
_YESNO = re.compile(r"^\s*(is|are|was|were|do|does|did|can|has|have|had)\b", re.IGNORECASE)


def _terms(s: str) -> set[str]:
    return set(_text.terms(s))


def label_for(new: str, old: str) -> str | None:
    a, b = _terms(new), _terms(old)
    if not a or not b:
        return None
    jac = len(a & b) / len(a | b)
    if jac >= 0.85:
        return "equivalent"
    if b <= a and len(a - b) >= 2:
        return "old_subsumed_by_new"
    if a <= b and len(b - a) >= 2:
        return "new_subsumed_by_old"
    ta, tb = _text.terms(new), _text.terms(old)
    if ta[:2] == tb[:2] and jac >= 0.3:
        na = set(_SPAN.findall(new)) - set(_SPAN.findall(old))
        nb = set(_SPAN.findall(old)) - set(_SPAN.findall(new))
        if na and nb:
            return "conflict"
    return None


class HeuristicPolicy(Policy):
    name = "heuristic"

    def __init__(self, max_creates: int = 24, min_words: int = 4):
        self.max_creates = max_creates
        self.min_words = min_words
        self.eps: dict = {}

    def start(self, key, task) -> None:
        self.eps[key] = {"created": {}, "read_q": set(), "labelled": set()}

    def end(self, key) -> None:
        self.eps.pop(key, None)

    def act_one(self, key, observation, info) -> str:
        ep = self.eps.setdefault(key, {"created": {}, "read_q": set(), "labelled": set()})
        sec = sections(observation)
        shown = memory_lines(observation)
        tools = set(info.get("tools") or [])
        calls: list[tuple[str, dict]] = []
        new_handles = [r["handle"] for r in info.get("results", []) if r.get("name") == "create_memory" and r.get("ok")]
        for h in new_handles:
            ep["created"][h] = True
        # relation labels between last step's memories and older shown ones
        if "label_relation" in tools:
            for h in new_handles:
                text = shown.get(h)
                if text is None:
                    continue
                for old, old_text in shown.items():
                    if old == h or int(old[1:]) > int(h[1:]) or (h, old) in ep["labelled"]:
                        continue
                    label = label_for(text, old_text)
                    if label:
                        calls.append(("label_relation", {"new": h, "old": old, "label": label}))
                        ep["labelled"].add((h, old))
        if info.get("phase") == "chunks" and "chunk" in sec:
            facts = []
            title = None
            for line in sec["chunk"].splitlines():
                line = line.strip()
                m = _HEADER.match(line) if line.startswith("[") else None
                if m:
                    title = (m.group("title") or "").strip() or None
                    continue
                for s in _SENT.split(line):
                    if len(s.split()) >= self.min_words:
                        facts.append(f"{title}: {s}" if title and not title.startswith("Notes") else s)
            if "create_memory" in tools:
                for f in facts[: self.max_creates]:
                    calls.append(("create_memory", {"content": f[:1000]}))
                for f in facts[:3]:
                    calls.append(("read_memory", {"query": f[:300]}))
            return calls_text(calls)
        # answer phase
        questions = dict(line.split(": ", 1) for line in sec.get("question", "").splitlines() if ": " in line)
        open_ids = info.get("open_questions") or list(questions)
        reads = 0
        last = info.get("answer_steps_left", 2) <= 1
        for qid in open_ids:
            q = questions.get(qid, "")
            if qid not in ep["read_q"] and not last and "read_memory" in tools:
                if reads < 3:
                    calls.append(("read_memory", {"query": q[:300] or qid}))
                    ep["read_q"].add(qid)
                    reads += 1
                continue
            calls.append(("answer", {"question_id": qid, "answer": self._extract(q, shown)}))
        return calls_text(calls)

    @staticmethod
    def _extract(question: str, shown: dict[str, str]) -> str:
        if _YESNO.match(question):
            return "yes"
        qt = _terms(question)
        best = max(shown.values(), key=lambda t: len(qt & _terms(t)), default="")
        best = best.split(" [previously:")[0] if "before" not in question.lower() else best
        qwords = set(question.lower().split())
        spans = [s.strip() for s in _SPAN.findall(best.split(": ", 1)[-1]) if s.strip()]
        spans = [s for s in spans if not set(s.lower().split()) <= qwords and s not in ("In", "The", "A", "An")]
        if "before" in question.lower() and "[previously:" in best:
            prev = best.split("[previously:", 1)[1]
            spans = [s for s in _SPAN.findall(prev) if not set(s.lower().split()) <= qwords] or spans
            return spans[-1] if spans else "unknown"
        return spans[-1] if spans else "unknown"
