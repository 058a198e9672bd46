"""Real benchmarks -> tasks (``atommem data prepare``).

HotpotQA (distractor format: ``context`` = [[title, [sentences]]], ``supporting_facts`` =
[[title, sentence index]]) and MuSiQue (``paragraphs`` with ``is_supporting``, ``answer`` and
``answer_aliases``) become N-document tasks as in AtomMem: ``questions`` questions are packed per task
(1-10, consecutive after a seeded shuffle); the documents are every packed question's own paragraphs
(supporting ones are gold evidence, the others are its hard distractors, role ``confounder``) plus
passages drawn from the pool (``*_corpus.json``, role ``distractor``) up to ``docs`` documents, in a
seeded random order. If ``docs`` is smaller than the questions' own paragraphs, supporting paragraphs
are kept first. Units are sentences (MuSiQue paragraphs are split on sentence ends); a unit's
``fact`` is ``"Title: sentence"``; evidence is the supporting sentences (HotpotQA) or all sentences of
supporting paragraphs (MuSiQue): for each step of ``question_decomposition``, the sentence of its
supporting paragraph that contains the step's answer (else the one sharing most terms with it).

LoCoMo (``locomo10.json``, read by ``atommem_rl.data.locomo``): one task per ``questions_per_task``
questions of a conversation (default 10, AtomMem's maximum at once); sessions are blocks (dated), turns are units with their
``dia_id``; categories kept (1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop; 5 adversarial
dropped unless ``keep_adversarial``); evidence = the QA's dia ids.

LongMemEval (the published JSON: a list of instances with ``question_id``, ``question_type``,
``question``, ``answer``, ``question_date``, ``haystack_session_ids``, ``haystack_dates``,
``haystack_sessions`` = lists of ``{role, content[, has_answer]}`` turns, ``answer_session_ids``):
one task per instance; evidence = turns flagged ``has_answer`` (else the user turns of the answer
sessions); sessions that hold no answer are ``distractor`` units (the confounders of ROAM's setting).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from atommem_rl.memory import text as _text
from atommem_rl.scoring import normalize_answer

from .schema import Block, Question, Task, Unit

_SENT = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


def _load_json(path: str | Path):
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def _pack(n_items: int, questions, rng: random.Random) -> list[list[int]]:
    order = list(range(n_items))
    rng.shuffle(order)
    groups, i = [], 0
    while i < len(order):
        q = questions if isinstance(questions, int) else rng.randint(*questions)
        groups.append(order[i:i + q])
        i += q
    return groups


def _corpus_default(path: Path, corpus: str | None) -> Path | None:
    if corpus:
        return Path(corpus)
    cand = list(path.parent.glob("*_corpus.json"))
    return cand[0] if cand else None


def _pool(corpus_path: Path | None) -> list[tuple[str, list[str]]]:
    if corpus_path is None:
        return []
    raw = _load_json(corpus_path)
    out = []
    if isinstance(raw, dict):
        for title, sents in raw.items():
            out.append((str(title), [str(s) for s in sents] if isinstance(sents, list) else _split(str(sents))))
    else:
        for p in raw:
            out.append((str(p.get("title", "")), _split(str(p.get("text", p.get("paragraph_text", ""))))))
    return out


def _split(text: str) -> list[str]:
    return [s.strip() for s in _SENT.split(text.strip()) if s.strip()]


def _doc_tasks(items: list[dict], source: str, pool, *, docs: int, questions, seed: int) -> list[Task]:
    """items: {"id", "question", "answers", "paragraphs": [(title, [sentences], support_idx set|None)]}."""
    rng = random.Random(f"{source}:{seed}")
    tasks = []
    for ti, group in enumerate(_pack(len(items), questions, rng)):
        paras: list[tuple[str, list[str], str, set[int]]] = []  # title, sentences, role, evidence indexes
        seen_titles: set[str] = set()
        for qi in group:
            for title, sents, support in items[qi]["paragraphs"]:
                if title in seen_titles:
                    # the same page serves two packed questions: merge the evidence marks
                    for k, p in enumerate(paras):
                        if p[0] == title and support:
                            paras[k] = (p[0], p[1], "evidence", p[3] | support)
                    continue
                seen_titles.add(title)
                paras.append((title, sents, "evidence" if support else "confounder", set(support or ())))
        if len(paras) > docs:  # keep evidence first, then the questions' own distractors
            ev = [p for p in paras if p[2] == "evidence"]
            rest = [p for p in paras if p[2] != "evidence"]
            paras = ev + rest[: max(0, docs - len(ev))]
        extra = [p for p in pool if p[0] not in seen_titles]
        need = docs - len(paras)
        if need > 0 and extra:
            for title, sents in rng.sample(extra, min(need, len(extra))):
                paras.append((title, sents, "distractor", set()))
        rng.shuffle(paras)
        blocks, ev_ids = [], {}
        for di, (title, sents, role, support) in enumerate(paras):
            bid = f"D{di + 1}"
            units = []
            for si, s in enumerate(sents):
                s = " ".join(str(s).split())
                if not s:
                    continue
                uid = f"{bid}.s{si}"
                urole = "evidence" if si in support else ("context" if role == "evidence" else role)
                units.append(Unit(id=uid, text=s, role=urole, fact=f"{title}: {s}"))
                if si in support:
                    ev_ids[(title, si)] = uid
            blocks.append(Block(id=bid, title=title, units=units))
        qs = []
        for k, qi in enumerate(group):
            it = items[qi]
            evidence = [ev_ids[(t, si)] for t, sents, support in it["paragraphs"] for si in sorted(support or ())
                        if (t, si) in ev_ids]
            qs.append(Question(id=f"Q{k + 1}", question=it["question"], answers=it["answers"],
                               evidence=list(dict.fromkeys(evidence)), category=it.get("category")))
        tasks.append(Task(id=f"{source}-{seed}-{ti}", kind="documents", blocks=blocks, questions=qs, source=source,
                          meta={"source_ids": [items[qi]["id"] for qi in group], "docs": len(blocks)}))
    return tasks


def prepare_hotpotqa(path, *, corpus=None, docs=20, questions=1, limit=None, seed=0, **_) -> list[Task]:
    path = Path(path)
    raw = _load_json(path)
    if not isinstance(raw, list):
        raise ValueError(f"{path}: expected a JSON list of HotpotQA records")
    items = []
    for i, r in enumerate(raw[:limit] if limit else raw):
        try:
            support: dict[str, set[int]] = {}
            for title, idx in r["supporting_facts"]:
                support.setdefault(title, set()).add(int(idx))
            paragraphs = []
            for title, sents in r["context"]:
                valid = {j for j in support.get(title, set()) if 0 <= j < len(sents)}
                paragraphs.append((title, list(sents), valid or None))
            items.append({"id": r.get("_id", str(i)), "question": r["question"], "answers": [str(r["answer"])],
                          "paragraphs": paragraphs, "category": r.get("type")})
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: record {i} is not HotpotQA distractor format ({exc})") from None
    return _doc_tasks(items, "hotpotqa", _pool(_corpus_default(path, corpus)), docs=docs, questions=questions, seed=seed)


def prepare_musique(path, *, corpus=None, docs=20, questions=1, limit=None, seed=0, **_) -> list[Task]:
    path = Path(path)
    raw = _load_json(path)
    if not isinstance(raw, list):
        raise ValueError(f"{path}: expected a JSON list of MuSiQue records")
    items = []
    for i, r in enumerate(raw[:limit] if limit else raw):
        try:
            if r.get("answerable") is False:
                continue
            # evidence: per decomposition step, the supporting paragraph's sentence that holds the step's
            # answer (else the one sharing most terms with the step's question and answer)
            chosen: dict[int, set[int]] = {}
            split = {p["idx"]: _split(p["paragraph_text"]) for p in r["paragraphs"]}
            for step in r.get("question_decomposition") or []:
                pidx = step.get("paragraph_support_idx")
                sents = split.get(pidx)
                if not sents:
                    continue
                ans = normalize_answer(step.get("answer", ""))
                hits = [k for k, s in enumerate(sents) if ans and f" {ans} " in f" {normalize_answer(s)} "]
                if not hits:
                    want = set(_text.terms(f"{step.get('question', '')} {step.get('answer', '')}"))
                    hits = [max(range(len(sents)), key=lambda k: len(want & set(_text.terms(sents[k]))))]
                chosen.setdefault(pidx, set()).add(hits[0])
            paragraphs = []
            for p in r["paragraphs"]:
                sents = split[p["idx"]]
                support = chosen.get(p["idx"]) or (set(range(len(sents))) if p.get("is_supporting") else None)
                paragraphs.append((p["title"], sents, support))
            hops = len(r.get("question_decomposition") or []) or None
            items.append({"id": r.get("id", str(i)), "question": r["question"],
                          "answers": [str(r["answer"])] + [str(a) for a in r.get("answer_aliases") or []],
                          "paragraphs": paragraphs, "category": f"{hops}hop" if hops else None})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: record {i} is not MuSiQue format ({exc})") from None
    return _doc_tasks(items, "musique", _pool(_corpus_default(path, corpus)), docs=docs, questions=questions, seed=seed)


def prepare_locomo(path, *, limit=None, keep_adversarial=False, questions_per_task=None, **_) -> list[Task]:
    from atommem_rl.data.locomo import load_locomo

    convs = load_locomo(path)
    tasks = []
    for conv in convs[:limit] if limit else convs:
        blocks, known = [], set()
        for s in conv.sessions:
            date = s.date.strftime("%-I:%M %p on %-d %B, %Y") if s.date else None
            units = []
            for t in s.turns:
                text = t.text + (f" [shares a photo: {t.blip_caption}]" if t.blip_caption else "")
                units.append(Unit(id=t.dia_id, text=text, speaker=t.speaker, role="context",
                                  fact=f"{t.speaker} ({date}): {text}" if date else f"{t.speaker}: {text}"))
                known.add(t.dia_id)
            blocks.append(Block(id=f"S{s.index}", date=date, units=units))
        qas = [q for q in conv.qa if keep_adversarial or q.category != 5]
        evidence_all = set()
        qs = []
        for k, q in enumerate(qas):
            ans = q.answer if q.answer is not None else "Not mentioned in the conversation"
            ev = [e for e in q.evidence if e in known]
            evidence_all.update(ev)
            qs.append(Question(id=f"Q{k + 1}", question=q.question, answers=[str(ans)], evidence=ev, category=q.category))
        for b in blocks:
            for u in b.units:
                if u.id in evidence_all:
                    u.role = "evidence"
        size = questions_per_task or 10
        for part in range(0, len(qs), size):
            chunk = qs[part:part + size]
            renum = [Question(id=f"Q{j + 1}", question=q.question, answers=q.answers, evidence=q.evidence,
                              category=q.category) for j, q in enumerate(chunk)]
            tasks.append(Task(id=f"locomo-{conv.sample_id}-{part // size}", kind="dialogue", blocks=blocks,
                              questions=renum, source="locomo", meta={"sample_id": conv.sample_id}))
    return tasks


def prepare_longmemeval(path, *, limit=None, **_) -> list[Task]:
    path = Path(path)
    raw = _load_json(path)
    if not isinstance(raw, list):
        raise ValueError(f"{path}: expected a JSON list of LongMemEval instances")
    tasks = []
    for i, r in enumerate(raw[:limit] if limit else raw):
        try:
            sids, dates, sessions = r["haystack_session_ids"], r["haystack_dates"], r["haystack_sessions"]
            if not (len(sids) == len(dates) == len(sessions)):
                raise ValueError("haystack ids, dates and sessions differ in length")
            answer_sids = set(r.get("answer_session_ids") or [])
            blocks, flagged, user_turns = [], [], []
            for sid, date, turns in zip(sids, dates, sessions):
                bid = re.sub(r"[^A-Za-z0-9_.-]", "_", str(sid))
                units = []
                for ti, turn in enumerate(turns):
                    uid = f"{bid}:{ti}"
                    speaker = "User" if turn["role"] == "user" else "Assistant"
                    role = "context" if sid in answer_sids else "distractor"
                    if turn.get("has_answer"):
                        role = "evidence"
                        flagged.append(uid)
                    elif sid in answer_sids and turn["role"] == "user":
                        user_turns.append(uid)
                    units.append(Unit(id=uid, text=str(turn["content"]), speaker=speaker, role=role,
                                      fact=f"{speaker} ({date}): {turn['content']}"))
                blocks.append(Block(id=bid, date=str(date), units=units))
            evidence = flagged or user_turns
            if not flagged:
                for b in blocks:
                    for u in b.units:
                        if u.id in evidence:
                            u.role = "evidence"
            q = Question(id="Q1", question=str(r["question"]), answers=[str(r["answer"])], evidence=evidence,
                         category=r.get("question_type"), date=r.get("question_date"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: instance {i} is not LongMemEval format ({exc})") from None
        tasks.append(Task(id=f"longmemeval-{r.get('question_id', i)}", kind="dialogue", blocks=blocks, questions=[q],
                          source="longmemeval", meta={"question_type": r.get("question_type")}))
    return tasks


PREPARERS = {"hotpotqa": prepare_hotpotqa, "musique": prepare_musique, "locomo": prepare_locomo,
             "longmemeval": prepare_longmemeval}


def prepare(source: str, path, **kw) -> list[Task]:
    if source not in PREPARERS:
        raise ValueError(f"unknown source {source!r}; expected one of {', '.join(PREPARERS)}")
    return PREPARERS[source](path, **kw)
