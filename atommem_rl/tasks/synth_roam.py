"""The ROAM setting of the synthetic world: observations about the same people accumulate as in long
dialogues, so that a store without relation labels floods a small retrieval budget with outdated and
duplicate atoms (issue 40, item 1).

    atommem data synth --setting roam --out tasks/roam.jsonl --tasks 256 --seed 4000 --questions 2-3 \
        --changes 3 --confounders 2
    atommem rollout --tasks tasks/roam.jsonl --policy oracle --retrieval-k 3 --chunk-tokens 128 --out runs/l.jsonl
    (docs/benchmarks/roam_setting.md: the scripted comparison with and without labels)

Algorithm (deterministic for a seed: one ``random.Random(f"roam:{seed}:{index}")`` per task; the world,
the dating and the confounders and distractors are synth.py's).

1. One target person per question. Every target has two attribute histories, whatever is asked: a home
   city and an employer, each with ``changes`` dated changes (``changes + 1`` values; consecutive cities
   in different countries, so a country-level statement is never true across a move).
2. Each value is stated by its *head* ("X lives in Lyon." / "In May 2019, X moved to Berlin.", "X works
   as a nurse at Orbis Labs." / "In May 2019, X joined Helix Media as a pilot."), then, with probability
   ``dup``, a paraphrased duplicate, and with probability ``partial`` a partial fact (the country alone, the
   employer without the job) that the head subsumes; for the first value the partial fact may come first.
   A change never names the value it replaces, so history is only answerable from the older atoms.
3. Gold relations are exhaustive over every pair of statements of one attribute of one person (new =
   later): a different value -> ``conflict``; the same value -> ``equivalent`` at the same specificity,
   ``old_subsumed_by_new`` when the later one is the more specific, ``new_subsumed_by_old`` when it is the
   more general. Pairs across attributes, people, confounders and distractors are ``independent``.
4. Questions: ``current_city`` (where does X live now), ``before_city`` (where did X live before moving
   to C), ``current_employer``, ``before_employer`` (which company did X work for before joining O). The
   gold evidence is the current value's head, or the earlier value's head and the change.
5. ``confounders`` statements per question about a similar name (synth.py), distractors fill ``docs``
   documents; documents hold the statements in date order (``kind="dialogue"``: as sessions between two
   friends, as synth.py renders them).
"""

from __future__ import annotations

import datetime as dt
import random

from .schema import Block, GoldRelation, Question, Task, Unit
from .synth import (_FILLER_A, _FILLER_B, _World, _a, _Builder, _confounders, _distractor, _lives, _month, _works,
                    CITIES, JOBS)

QTYPES = ("current_city", "before_city", "current_employer", "before_employer")

_SPECIFIC, _GENERAL = 1, 0  # specificity of a statement about a value


def _label(new: tuple[int, int], old: tuple[int, int]) -> str:
    """Gold label of (value index, specificity) statements ``new`` (later) and ``old`` of one attribute."""
    if new[0] != old[0]:
        return "conflict"
    if new[1] == old[1]:
        return "equivalent"
    return "old_subsumed_by_new" if new[1] > old[1] else "new_subsumed_by_old"


def _values(rng: random.Random, w: _World, attr: str, n: int) -> list[tuple[str, str, str]]:
    """``n`` successive values: (city, country, "") or (organisation, job, "")."""
    if attr == "city":
        out: list[tuple[str, str, str]] = []
        for _ in range(n):
            prev = out[-1][1] if out else None
            used = {c for c, _, _ in out}
            city, country = rng.choice([c for c in CITIES if c[1] != prev and c[0] not in used])
            out.append((city, country, ""))
        return out
    return [(w.org(), rng.choice(JOBS), "") for _ in range(n)]


def _texts(rng: random.Random, p: str, attr: str, value: tuple[str, str, str], first: bool, when: dt.date):
    """(head, duplicate, partial) texts of one value."""
    a, b, _ = value
    if attr == "city":
        head = (f"{p} lives in {a}." if rng.random() < 0.5 else _lives(rng, p, a, b)) if first else \
            f"In {_month(when)}, {p} moved to {a}."
        dup = rng.choice([f"{p}'s home is in {a}.", f"{p} is living in {a} these days."])
        return head, dup, f"{p} lives somewhere in {b}."
    head = _works(rng, p, b, a) if first else f"In {_month(when)}, {p} joined {a} as {_a(b)}."
    dup = rng.choice([f"{p} is {_a(b)} at {a}.", f"{p} works for {a} as {_a(b)}."])
    return head, dup, f"{p} has a job at {a}."


def _history(rng: random.Random, w: _World, b: _Builder, p: str, attr: str, changes: int, dup: float,
             partial: float) -> tuple[list[str], list[tuple[str, str, str]]]:
    """Adds one attribute history of ``p``; returns (head key of each value, the values)."""
    values = _values(rng, w, attr, changes + 1)
    n = len(values)
    stmts = []  # (date, text, (value index, specificity), is head)
    for i, value in enumerate(values):
        lo, hi = i / n, (i + 1) / n
        t0 = b.date(lo + 0.02 * (i > 0), lo + 0.3 / n)
        head, dtext, ptext = _texts(rng, p, attr, value, i == 0, t0)
        stmts.append((t0, head, (i, _SPECIFIC), True))
        if rng.random() < dup:
            stmts.append((b.date(lo + 0.4 / n, hi - 0.05 / n), dtext, (i, _SPECIFIC), False))
        if rng.random() < partial:
            # the first value's partial fact may come first (then the head subsumes an older atom)
            early = i == 0 and rng.random() < 0.5
            when = b.start + dt.timedelta(days=max(0, (t0 - b.start).days - 30)) if early else \
                b.date(lo + 0.35 / n, hi - 0.05 / n)
            stmts.append((when, ptext, (i, _GENERAL), False))
    stmts.sort(key=lambda s: s[0])
    keys: list[tuple[str, tuple[int, int]]] = []
    heads = [""] * n
    for when, text, spec, is_head in stmts:
        rels = [(k, _label(spec, old)) for k, old in keys]
        key = b.add(text, when, p, relations=rels)
        keys.append((key, spec))
        if is_head:
            heads[spec[0]] = key
    return heads, values


def _question(qtype: str, rng: random.Random, p: str, hist: dict) -> tuple[str, str, list[str]]:
    attr = "city" if qtype.endswith("city") else "employer"
    heads, values = hist[attr]
    if qtype.startswith("current"):
        text = f"In which city does {p} live now?" if attr == "city" else f"Which company does {p} work for now?"
        return text, values[-1][0], [heads[-1]]
    i = rng.randrange(1, len(values))
    text = f"Where did {p} live before moving to {values[i][0]}?" if attr == "city" else \
        f"Which company did {p} work for before joining {values[i][0]}?"
    return text, values[i - 1][0], [heads[i - 1], heads[i]]


def _assemble(b: _Builder, rng: random.Random, kind: str, n_docs: int) -> tuple[list[Block], dict[str, str]]:
    """Statements into date-ordered blocks (contiguous slices keep dates monotone), as synth.py does."""
    stmts = sorted(b.stmts, key=lambda s: (s.date, int(s.key[1:])))
    groups: list[list] = [[] for _ in range(n_docs)]
    for i, s in enumerate(stmts):
        groups[i * n_docs // len(stmts)].append(s)
    key_to_id: dict[str, str] = {}
    blocks = []
    for di, group in enumerate(g for g in groups if g):
        did = f"D{di + 1}" if kind == "documents" else f"S{di + 1}"
        date = group[-1].date.isoformat()
        units = []
        for s in group:
            if kind == "documents":
                uid = f"{did}.s{len(units)}"
                units.append(Unit(id=uid, text=s.text, role=s.role, fact=s.text))
            else:
                units.append(Unit(id=f"{did}:{len(units)}", text=rng.choice(_FILLER_A), speaker="Sam"))
                uid = f"{did}:{len(units)}"
                units.append(Unit(id=uid, text=s.text, role=s.role, speaker="Robin", fact=f"{s.text} (said on {date})"))
                units.append(Unit(id=f"{did}:{len(units)}", text=rng.choice(_FILLER_B), speaker="Sam"))
            key_to_id[s.key] = uid
        title = None if kind == "dialogue" else \
            (f"Notes on {group[0].about}" if len({s.about for s in group}) == 1 else "Notes")
        blocks.append(Block(id=did, title=title, date=date, units=units))
    return blocks, key_to_id


def generate_task(index: int, seed: int = 0, *, kind: str = "documents", docs: int = 24,
                  questions: int | tuple[int, int] = (2, 3), confounders: int = 2, changes: int = 3,
                  dup: float = 0.7, partial: float = 0.5, qtypes: tuple[str, ...] = QTYPES) -> Task:
    """One ROAM-setting task; see the module docstring."""
    if kind not in ("documents", "dialogue"):
        raise ValueError(f"kind must be documents or dialogue, got {kind!r}")
    if not 0 <= confounders <= 8:
        raise ValueError("confounders must be between 0 and 8")
    if not 1 <= changes <= 5:
        raise ValueError("changes must be between 1 and 5")
    if not (0.0 <= dup <= 1.0 and 0.0 <= partial <= 1.0):
        raise ValueError("dup and partial are probabilities between 0 and 1")
    if docs < 1:
        raise ValueError("docs must be at least 1")
    bad = set(qtypes) - set(QTYPES)
    if bad or not qtypes:
        raise ValueError(f"qtypes must be among {', '.join(QTYPES)}, got {sorted(bad) or 'none'}")
    rng = random.Random(f"roam:{seed}:{index}")
    nq = questions if isinstance(questions, int) else rng.randint(*questions)
    if not 1 <= nq <= 10:
        raise ValueError("questions must be between 1 and 10")
    w = _World(rng)
    b = _Builder(rng, dt.date(2015, 1, 1) + dt.timedelta(days=rng.randrange(0, 1500)), span_days=6 * 365)
    qs = []
    for i in range(nq):
        qtype = qtypes[(index + i) % len(qtypes)]
        p = w.person()
        hist = {attr: _history(rng, w, b, p, attr, changes, dup, partial) for attr in ("city", "employer")}
        text, answer, ev = _question(qtype, rng, p, hist)
        b.promote(ev)
        _confounders(w, b, rng, (p, "city" if qtype.endswith("city") else "employer"), confounders)
        qs.append((f"Q{i + 1}", text, answer, ev, qtype))
    n_docs = max(docs, (len(b.stmts) + 2) // 3)
    while len(b.stmts) < n_docs * 2:
        _distractor(w, b, rng)
    blocks, key_to_id = _assemble(b, rng, kind, n_docs)
    relations = [GoldRelation(new=key_to_id[s.key], old=key_to_id[old], label=label)
                 for s in b.stmts for old, label in s.relations]
    return Task(id=f"roam-{kind[:3]}-{seed}-{index}", kind=kind, blocks=blocks, source="synthetic",
                questions=[Question(id=qid, question=text, answers=[answer], evidence=[key_to_id[k] for k in ev],
                                    category=qtype) for qid, text, answer, ev, qtype in qs],
                relations=relations,
                meta={"setting": "roam", "seed": seed, "index": index, "docs": n_docs, "confounders": confounders,
                      "changes": changes, "dup": dup, "partial": partial, "relations_exhaustive": True})


def generate_tasks(n: int, seed: int = 0, **kw) -> list[Task]:
    return [generate_task(i, seed, **kw) for i in range(n)]
