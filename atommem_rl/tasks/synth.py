"""Synthetic memory tasks: a small world of people and organisations whose attributes change over time.

Algorithm (deterministic for a seed: one ``random.Random(f"{seed}:{index}")`` per task).

1. World. People (unique first+last names), organisations (name, headquarters city), cities with
   their countries. Each *target* person gets a dated history: a home city that changes by a move, an
   employer that changes by a job switch, a partner that changes by a break-up.
2. Statements (units), each dated by its document and labelled against earlier statements:
   - base facts ("X lives in Paris.", "X works as a nurse at Orbis Labs.", "Orbis Labs is
     headquartered in Lyon.", "X is in a relationship with Y.");
   - paraphrases of earlier facts: gold label ``equivalent``;
   - general vs specific ("X lives in France." / "X lives in Lyon, France."): ``old_subsumed_by_new``
     when the specific one comes later, ``new_subsumed_by_old`` when the general one does;
   - dated updates ("In March 2021, X moved to Berlin."): ``conflict`` with the facts they replace;
   - confounders (N per question, 0-8 as in ROAM's controlled setting): the same attribute for a
     person with a similar name (same first or last name), in its own document;
   - distractors: facts about other people and organisations, filling the remaining documents.
3. Questions (1-10 per task), each with its gold answer and evidence unit ids:
   ``current`` (where does X live now: needs the update), ``temporal`` (where did X live before
   moving to C), ``bridge`` (in which city is X's employer headquartered: two hops), ``partner``
   (who is X's current partner), ``country`` (which country does X live in: general or specific).
4. Documents are sorted by date and each holds 1-4 statements; ``kind="dialogue"`` renders the same
   statements as turns of dated sessions between two friends who talk about people they know.

``generate_tasks(n, seed, kind, docs, questions, confounders)`` returns ``Task`` objects; the CLI is
``atommem data synth``.
"""

from __future__ import annotations

import datetime as dt
import random
from dataclasses import dataclass, field

from .schema import Block, GoldRelation, Question, Task, Unit

FIRST = """Alice Bruno Chloe Daniel Elena Farid Greta Hugo Ines Jonas Kira Leon Maya Nadia Oscar Priya Quentin
Rosa Samir Tara Umar Vera Wes Xenia Yusuf Zoe Anton Bianca Carlos Dora Emil Fiona Goran Hana Ivan Julia Kofi Lena
Marco Nora Otto Paula Rafael Sofia Theo Una Viktor Wanda Yara Zaid Amara Basil Celine Dmitri Esra Felix Gaia Henrik
Ilse Jamal""".split()
LAST = """Moreau Schmidt Rossi Novak Silva Tanaka Kowalski Haddad Jensen Okafor Petrov Laurent Fischer Romano
Varga Costa Lindqvist Duarte Morel Becker Ricci Horvat Santos Nakamura Nowak Aziz Larsen Mensah Ivanova Girard
Weber Greco Kovac Pereira Berg Sato Zielinski Farouk Dahl Owusu Sokolov Dubois Keller Marino Toth Almeida Holm Ito
Wojcik Nasser""".split()
CITIES = [
    ("Paris", "France"), ("Lyon", "France"), ("Marseille", "France"), ("Berlin", "Germany"), ("Munich", "Germany"),
    ("Hamburg", "Germany"), ("Rome", "Italy"), ("Milan", "Italy"), ("Turin", "Italy"), ("Madrid", "Spain"),
    ("Seville", "Spain"), ("Valencia", "Spain"), ("Lisbon", "Portugal"), ("Porto", "Portugal"),
    ("Vienna", "Austria"), ("Graz", "Austria"), ("Oslo", "Norway"), ("Bergen", "Norway"), ("Stockholm", "Sweden"),
    ("Gothenburg", "Sweden"), ("Warsaw", "Poland"), ("Krakow", "Poland"), ("Prague", "Czechia"), ("Brno", "Czechia"),
    ("Dublin", "Ireland"), ("Cork", "Ireland"), ("Athens", "Greece"), ("Thessaloniki", "Greece"),
    ("Helsinki", "Finland"), ("Tampere", "Finland"), ("Osaka", "Japan"), ("Kyoto", "Japan"), ("Nairobi", "Kenya"),
    ("Mombasa", "Kenya"), ("Accra", "Ghana"), ("Kumasi", "Ghana"), ("Toronto", "Canada"), ("Montreal", "Canada"),
    ("Denver", "United States"), ("Austin", "United States"),
]
ORG_A = """Orbis Helix Nimbus Vertex Quanta Lumen Sable Cobalt Aster Zephyr Kestrel Tandem Beacon Summit Harbor
Meridian Juniper Falcon Granite Willow Copper Atlas Solstice Ember""".split()
ORG_B = "Labs Systems Logistics Foods Media Robotics Health Energy Studios Analytics Textiles Motors".split()
JOBS = """nurse engineer designer accountant teacher chemist architect pilot journalist lawyer chef
analyst""".split()
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
QTYPES = ("current", "temporal", "bridge", "partner", "country")


def _month(d: dt.date) -> str:
    return f"{MONTHS[d.month - 1]} {d.year}"


@dataclass
class _Stmt:
    text: str
    date: dt.date
    about: str  # the person or organisation the statement is about
    role: str = "context"
    key: str = ""  # local key used to attach relations and evidence before ids exist
    relations: list[tuple[str, str]] = field(default_factory=list)  # (old key, label), self = new
    speaker_line: str | None = None  # dialogue rendering


class _World:
    def __init__(self, rng: random.Random):
        self.rng = rng
        names = [f"{f} {l}" for f in FIRST for l in LAST]
        rng.shuffle(names)
        self.free_names = names
        self.used: set[str] = set()
        orgs = [f"{a} {b}" for a in ORG_A for b in ORG_B]
        rng.shuffle(orgs)
        self.free_orgs = orgs
        self.org_city: dict[str, tuple[str, str]] = {}

    def person(self) -> str:
        while True:
            if not self.free_names:
                raise ValueError("the synthetic world ran out of names: use fewer documents per task")
            n = self.free_names.pop()
            if n not in self.used:
                self.used.add(n)
                return n

    def similar(self, name: str) -> str | None:
        """An unused name sharing the first or the last name (a confounder's name)."""
        first, last = name.split(" ", 1)
        opts = [f"{first} {l}" for l in LAST if l != last] + [f"{f} {last}" for f in FIRST if f != first]
        self.rng.shuffle(opts)
        for o in opts:
            if o not in self.used:
                self.used.add(o)
                return o
        return None

    def org(self) -> str:
        if not self.free_orgs:  # large worlds (800 documents): three-word names
            more = [f"{a} {c} {b}" for a in ORG_A for c in ORG_A if a != c for b in ORG_B]
            self.free_orgs = [o for o in more if o not in self.org_city]
            self.rng.shuffle(self.free_orgs)
        o = self.free_orgs.pop()
        self.org_city[o] = self.rng.choice(CITIES)
        return o


class _Builder:
    """Collects statements for one task, with local keys for relations and evidence."""

    def __init__(self, rng: random.Random, start: dt.date, span_days: int):
        self.rng = rng
        self.start = start
        self.span = span_days
        self.stmts: list[_Stmt] = []
        self.n = 0

    def date(self, lo: float, hi: float) -> dt.date:
        return self.start + dt.timedelta(days=int(self.rng.uniform(lo, hi) * self.span))

    def add(self, text: str, date: dt.date, about: str, role: str = "context",
            relations: list[tuple[str, str]] | None = None, speaker_line: str | None = None) -> str:
        self.n += 1
        key = f"k{self.n}"
        self.stmts.append(_Stmt(text, date, about, role, key, list(relations or []), speaker_line))
        return key

    def promote(self, keys: list[str]) -> None:
        for s in self.stmts:
            if s.key in keys and s.role != "evidence":
                s.role = "evidence"


def _lives(rng, p, city, country):
    return rng.choice([f"{p} lives in {city}.", f"{p} has a home in {city}, {country}.", f"{p} resides in {city}."])


def _para_lives(p, city):
    return f"{p}'s home is in {city}."


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _works(rng, p, job, org):
    return rng.choice([f"{p} works as {_a(job)} at {org}.", f"{p} is {_a(job)} employed by {org}."])


def _question_for(qtype: str, w: _World, b: _Builder, rng: random.Random, n_conf: int, qid: str):
    """Adds the statements a question needs; returns (question text, answer, evidence keys, confounder subject)."""
    p = w.person()
    (c1, k1), (c2, k2) = rng.sample(CITIES, 2)
    if qtype in ("current", "temporal", "country"):
        t0, t1 = b.date(0.0, 0.35), b.date(0.45, 0.9)
        if qtype == "country":
            general = b.add(f"{p} lives in {k1}.", t0, p)
            later = b.date(0.4, 0.95)
            specific = b.add(f"{p} lives in {c1}, a city in {k1}.", later, p, relations=[(general, "old_subsumed_by_new")])
            if rng.random() < 0.5:  # sometimes the general restatement comes after the specific one
                again = b.add(f"{p} lives somewhere in {k1}.", b.date(0.96, 1.0), p,
                              relations=[(specific, "new_subsumed_by_old")])
                ev = [specific, again]
            else:
                ev = [general, specific]
            return f"In which country does {p} live?", k1, ev, (p, "country")
        old = b.add(_lives(rng, p, c1, k1), t0, p)
        para = None
        if rng.random() < 0.6:
            para = b.add(_para_lives(p, c1), b.date(0.36, 0.44), p, relations=[(old, "equivalent")])
        rel = [(old, "conflict")] + ([(para, "conflict")] if para else [])
        move = b.add(f"In {_month(t1)}, {p} moved to {c2}.", t1, p, relations=rel)
        if qtype == "current":
            return f"In which city does {p} live now?", c2, [move], (p, "city")
        return f"Where did {p} live before moving to {c2}?", c1, [old, move], (p, "city")
    if qtype == "bridge":
        org = w.org()
        city, country = w.org_city[org]
        job = rng.choice(JOBS)
        first_org = w.org()
        t0, t1 = b.date(0.0, 0.3), b.date(0.5, 0.95)
        j0 = b.add(_works(rng, p, rng.choice(JOBS), first_org), t0, p)
        j1 = b.add(f"In {_month(t1)}, {p} left {first_org} and joined {org} as {_a(job)}.", t1, p,
                   relations=[(j0, "conflict")])
        hq = b.add(rng.choice([f"{org} is headquartered in {city}.", f"The headquarters of {org} are in {city}."]),
                   b.date(0.0, 1.0), org)
        # the first employer's headquarters is a natural trap for a policy that ignores the update
        fc, _ = w.org_city[first_org]
        b.add(f"{first_org} is headquartered in {fc}.", b.date(0.0, 1.0), first_org, role="distractor")
        return f"In which city is the current employer of {p} headquartered?", city, [j1, hq], (p, "employer")
    # partner
    q1, q2 = w.person(), w.person()
    t0, t1 = b.date(0.0, 0.4), b.date(0.5, 0.95)
    r0 = b.add(f"{p} is in a relationship with {q1}.", t0, p)
    r1 = b.add(f"In {_month(t1)}, {p} broke up with {q1} and started dating {q2}.", t1, p, relations=[(r0, "conflict")])
    return f"Who is {p}'s current partner?", q2, [r1], (p, "partner")


def _confounders(w: _World, b: _Builder, rng: random.Random, subject: tuple[str, str], n: int) -> None:
    p, attr = subject
    for _ in range(n):
        other = w.similar(p) or w.person()
        city, country = rng.choice(CITIES)
        d = b.date(0.0, 1.0)
        if attr == "city":
            text = rng.choice([f"{other} lives in {city}.", f"In {_month(d)}, {other} moved to {city}."])
        elif attr == "country":
            text = f"{other} lives in {country}."
        elif attr == "employer":
            o = w.org()
            text = f"{other} works as {_a(rng.choice(JOBS))} at {o}."
        else:
            text = f"{other} is in a relationship with {w.person()}."
        b.add(text, d, other, role="confounder")


def _distractor(w: _World, b: _Builder, rng: random.Random) -> None:
    p = w.person()
    city, country = rng.choice(CITIES)
    d = b.date(0.0, 1.0)
    kind = rng.randrange(5)
    if kind == 0:
        b.add(_lives(rng, p, city, country), d, p, role="distractor")
    elif kind == 1:
        b.add(_works(rng, p, rng.choice(JOBS), w.org()), d, p, role="distractor")
    elif kind == 2:
        o = w.org()
        b.add(f"{o} is headquartered in {w.org_city[o][0]}.", d, o, role="distractor")
    elif kind == 3:
        b.add(f"{p} enjoys {rng.choice(['hiking', 'chess', 'cooking', 'painting', 'cycling', 'jazz'])} at weekends.",
              d, p, role="distractor")
    else:
        b.add(f"In {_month(d)}, {p} moved to {city}.", d, p, role="distractor")


_FILLER_A = ["Guess what I heard.", "Oh, by the way.", "Did you know this?", "News from the old crowd."]
_FILLER_B = ["Really? Good to know.", "Interesting, thanks for telling me.", "I had no idea.", "Oh, nice."]


def generate_task(index: int, seed: int = 0, *, kind: str = "documents", docs: int = 20,
                  questions: int | tuple[int, int] = (1, 3), confounders: int = 2,
                  qtypes: tuple[str, ...] = QTYPES) -> Task:
    """One task; see the module docstring. ``questions`` is a count or an inclusive (lo, hi) range."""
    if kind not in ("documents", "dialogue"):
        raise ValueError(f"kind must be documents or dialogue, got {kind!r}")
    if not 0 <= confounders <= 8:
        raise ValueError("confounders must be between 0 and 8")
    rng = random.Random(f"{seed}:{index}")
    nq = questions if isinstance(questions, int) else rng.randint(*questions)
    if not 1 <= nq <= 10:
        raise ValueError("questions must be between 1 and 10")
    if docs < 1:
        raise ValueError("docs must be at least 1")
    w = _World(rng)
    start = dt.date(2015, 1, 1) + dt.timedelta(days=rng.randrange(0, 1500))
    b = _Builder(rng, start, span_days=6 * 365)
    qs = []
    for i in range(nq):
        qtype = qtypes[(index + i) % len(qtypes)] if i < len(qtypes) else rng.choice(qtypes)
        text, answer, ev, subject = _question_for(qtype, w, b, rng, confounders, f"Q{i + 1}")
        b.promote(ev)
        _confounders(w, b, rng, subject, confounders)
        qs.append((f"Q{i + 1}", text, answer, ev, qtype))
    # every statement lands in a document; documents hold 1-4 statements, sorted by date
    needed = list(b.stmts)
    n_docs = max(docs, (len(needed) + 2) // 3)
    while len(b.stmts) < n_docs * 2:
        _distractor(w, b, rng)
    stmts = sorted(b.stmts, key=lambda s: (s.date, s.key))
    # spread statements over documents in date order: contiguous slices keep dates monotone
    groups: list[list[_Stmt]] = [[] for _ in range(n_docs)]
    for i, s in enumerate(stmts):
        groups[i * n_docs // len(stmts)].append(s)
    key_to_id: dict[str, str] = {}
    blocks = []
    for di, group in enumerate(groups):
        did = f"D{di + 1}" if kind == "documents" else f"S{di + 1}"
        date = group[-1].date.isoformat()
        units = []
        if kind == "documents":
            for si, s in enumerate(group):
                uid = f"{did}.s{si}"
                key_to_id[s.key] = uid
                units.append(Unit(id=uid, text=s.text, role=s.role, fact=s.text))
            title = f"Notes on {group[0].about}" if len({s.about for s in group}) == 1 else "Notes"
            blocks.append(Block(id=did, title=title, date=date, units=units))
        else:
            a, c = "Sam", "Robin"
            ti = 0
            for s in group:
                units.append(Unit(id=f"{did}:{ti}", text=rng.choice(_FILLER_A), role="context", speaker=a))
                ti += 1
                uid = f"{did}:{ti}"
                key_to_id[s.key] = uid
                units.append(Unit(id=uid, text=s.text, role=s.role, speaker=c, fact=f"{s.text} (said on {date})"))
                ti += 1
                units.append(Unit(id=f"{did}:{ti}", text=rng.choice(_FILLER_B), role="context", speaker=a))
                ti += 1
            blocks.append(Block(id=did, title=None, date=date, units=units))
    relations = [
        GoldRelation(new=key_to_id[s.key], old=key_to_id[old], label=label)
        for s in b.stmts for old, label in s.relations
    ]
    questions_out = [
        Question(id=qid, question=text, answers=[answer], evidence=[key_to_id[k] for k in ev], category=qtype)
        for qid, text, answer, ev, qtype in qs
    ]
    return Task(id=f"synth-{kind[:3]}-{seed}-{index}", kind=kind, blocks=blocks, questions=questions_out,
                source="synthetic", relations=relations,
                meta={"seed": seed, "index": index, "docs": n_docs, "confounders": confounders,
                      "relations_exhaustive": True})


def generate_tasks(n: int, seed: int = 0, **kw) -> list[Task]:
    return [generate_task(i, seed, **kw) for i in range(n)]
