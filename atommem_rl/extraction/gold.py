"""Gold atoms of the synthetic world, extractor training pairs, and fact-level precision/recall.

Gold atoms. In a synthetic dialogue task (``tasks/synth.py``, ``kind="dialogue"``) every statement
turn (a unit with a ``fact``) is one gold atom: its text is the statement (already self-contained:
full names, absolute months), participants are the world's person names in it, keywords its
capitalised entities (people, organisations, cities) plus job/hobby words, time the explicit month
("In March 2021") or else the session day, source the turn id, and profile candidates follow from the
generator's templates (home city/country, employer, job, partner, hobby). Filler turns give none.

Relative times. :func:`relativise` rewrites a statement's leading "In <Month> <Year>," as "This month,"
or "Last month," when that month is the session's month or the one before (for a share ``p`` of
them, seeded); the gold keeps the absolute month, so pairs and the held-out measurement both require
anchoring relative times to the session date.

Training pairs (one per window; ``{"messages": [system, user, assistant], "tools": []}``, the format
``atommem sft`` reads with ``demonstrations: FILE``): the extractor prompt of the window and, as the
target, the canonical JSON of the window's gold atoms (:func:`gold_rows`); or a teacher model's
validated output on the window, kept only when it covers every gold atom of the window (recall 1.0 by
the matching below) and adds at most ``max_extra`` unmatched facts (:func:`teacher_rows`).

Matching (:func:`match`): a predicted fact matches a gold atom when the token F1 of their texts
(HotpotQA normalisation) is at least ``min_f1`` (0.6); pairs are taken greedily by F1, one-to-one.
precision = matched predictions / predictions; recall = matched gold / gold (micro over all windows);
``time_acc`` = share of matched facts whose time span equals the gold one; ``source_acc`` = share of
matched facts whose source turns include the gold turn.

    python -m atommem_rl.extraction.gold --out checkpoints/extractor/pairs.jsonl [--tasks 60 --seed 0]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import re
import sys
from pathlib import Path

from atommem_rl import scoring
from atommem_rl.tasks.schema import Task
from atommem_rl.tasks.synth import CITIES, FIRST, JOBS, LAST

from .extractor import ExtractSettings, Window, WindowResult, block_date, messages, target_json, windows
from .schema import MONTHS, Fact, ProfileItem, anchor_relative

_PERSON = re.compile(r"\b(" + "|".join(FIRST) + r") (" + "|".join(LAST) + r")\b")
_ENTITY = re.compile(r"\b[A-Z][a-z]+(?: [A-Z][a-z]+)*\b")
_NOT_ENTITY = {m.capitalize() for m in MONTHS} | {"In", "The"}
_COUNTRIES = {k for _, k in CITIES}
_HOBBIES = ("hiking", "chess", "cooking", "painting", "cycling", "jazz")
_P = r"([A-Z][a-z]+ [A-Z][a-z]+)"
_PLACE = r"([A-Z][A-Za-z ]+?)"
_PROFILE_RULES = [
    (re.compile(rf"{_P} (?:lives in|resides in|has a home in|lives somewhere in) {_PLACE}[.,]"), "home"),
    (re.compile(rf"{_P}'s home is in {_PLACE}\."), "home"),
    (re.compile(rf"{_P} moved to {_PLACE}\."), "home"),
    (re.compile(rf"{_P} works as an? (\w+) at {_PLACE}\."), "job_at"),
    (re.compile(rf"{_P} is an? (\w+) employed by {_PLACE}\."), "job_at"),
    (re.compile(rf"{_P} left {_PLACE} and joined {_PLACE} as an? (\w+)\."), "switch"),
    (re.compile(rf"{_P} is in a relationship with {_P}\."), "partner"),
    (re.compile(rf"{_P} broke up with {_P} and started dating {_P}\."), "newpartner"),
    (re.compile(rf"{_P} enjoys (\w+) at weekends\."), "hobby"),
]


def profile_of(text: str) -> list[ProfileItem]:
    """Profile candidates a synthetic statement states (see the module docstring)."""
    out = []
    for pat, kind in _PROFILE_RULES:
        m = pat.search(text)
        if not m:
            continue
        g = m.groups()
        if kind == "home":
            place = g[1].strip()
            out.append(ProfileItem(g[0], "home country" if place in _COUNTRIES else "home city", place, "trait"))
        elif kind == "job_at":
            out += [ProfileItem(g[0], "job", g[1], "trait"), ProfileItem(g[0], "employer", g[2].strip(), "trait")]
        elif kind == "switch":
            out += [ProfileItem(g[0], "employer", g[2].strip(), "trait"), ProfileItem(g[0], "job", g[3], "trait")]
        elif kind == "partner":
            out.append(ProfileItem(g[0], "partner", g[1], "trait"))
        elif kind == "newpartner":
            out.append(ProfileItem(g[0], "partner", g[2], "trait"))
        else:
            out.append(ProfileItem(g[0], "hobby", g[1], "preference"))
        break
    return out


def gold_fact(text: str, unit_id: str, day) -> Fact:
    people = list(dict.fromkeys(" ".join(m) for m in _PERSON.findall(text)))
    ents = [" ".join(w for w in e.split() if w not in _NOT_ENTITY) for e in _ENTITY.findall(text)]
    ents = [e for e in ents if e]
    extra = [w for w in re.findall(r"[a-z]+", text) if w in JOBS or w in _HOBBIES]
    return Fact(text=text, participants=people, keywords=list(dict.fromkeys(ents + extra))[:8],
                time=anchor_relative(text, day) or ((day, day) if day else None), source_turns=[unit_id],
                profile=profile_of(text))


def gold_facts(task: Task) -> dict[str, Fact]:
    """unit id -> its gold atom, for every statement unit of a synthetic task (original texts)."""
    if task.source != "synthetic":
        raise ValueError(f"task {task.id!r}: gold atoms exist for synthetic tasks only (source {task.source!r})")
    out = {}
    for b in task.blocks:
        day = block_date(b)
        for u in b.units:
            if u.fact is not None:
                out[u.id] = gold_fact(u.text, u.id, day)
    return out


_LEADING_MONTH = re.compile(r"^In (" + "|".join(m.capitalize() for m in MONTHS) + r") (\d{4}), ")


def relativise(task: Task, p: float = 0.5, seed: int = 0) -> tuple[Task, int]:
    """A copy of the task with some leading months made relative (see the module docstring)."""
    rng = random.Random(f"relativise:{seed}:{task.id}")
    t = copy.deepcopy(task)
    n = 0
    for b in t.blocks:
        day = block_date(b)
        for u in b.units:
            m = _LEADING_MONTH.match(u.text)
            if not m or day is None or rng.random() >= p:
                continue
            month, year = MONTHS[m[1].lower()], int(m[2])
            back = (day.year - year) * 12 + day.month - month
            if back in (0, 1):
                u.text = ("This month, " if back == 0 else "Last month, ") + u.text[m.end():]
                n += 1
    return t, n


# ----------------------------------------------------------------------------- matching
def match(pred: list[Fact], gold: list[Fact], min_f1: float = 0.6) -> list[tuple[int, int, float]]:
    """Greedy one-to-one (pred index, gold index, F1) pairs with F1 >= ``min_f1``."""
    scores = sorted(((scoring.f1(p.text, [g.text]), i, j) for i, p in enumerate(pred) for j, g in enumerate(gold)),
                    reverse=True)
    used_p, used_g, out = set(), set(), []
    for f, i, j in scores:
        if f < min_f1:
            break
        if i not in used_p and j not in used_g:
            used_p.add(i)
            used_g.add(j)
            out.append((i, j, f))
    return out


def window_gold(w: Window, gold: dict[str, Fact]) -> list[Fact]:
    return [gold[t] for t in w.turn_ids if t in gold]


def score(results: list[list[WindowResult]], golds: list[dict[str, Fact]], min_f1: float = 0.6) -> dict:
    """Micro precision/recall/F1 and time/source accuracy over windows (see the module docstring)."""
    n_pred = n_gold = n_match = time_ok = src_ok = 0
    for res, gold in zip(results, golds):
        for r in res:
            g = window_gold(r.window, gold)
            pairs = match(r.facts, g, min_f1)
            n_pred += len(r.facts)
            n_gold += len(g)
            n_match += len(pairs)
            time_ok += sum(r.facts[i].time == g[j].time for i, j, _ in pairs)
            src_ok += sum(g[j].source_turns[0] in r.facts[i].source_turns for i, j, _ in pairs)
    p = n_match / n_pred if n_pred else 0.0
    rc = n_match / n_gold if n_gold else 0.0
    return {"precision": p, "recall": rc, "f1": 2 * p * rc / (p + rc) if p + rc else 0.0,
            "predicted": n_pred, "gold": n_gold, "matched": n_match,
            "time_acc": time_ok / n_match if n_match else None, "source_acc": src_ok / n_match if n_match else None}


# ----------------------------------------------------------------------------- pairs
class TokenCounter:
    """The ``count`` of a backend, from a tokenizer (window packing needs nothing else)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if text else 0


def synth_tasks(n: int, seed: int, docs: int = 6, relative: float = 0.5) -> tuple[list[Task], list[dict[str, Fact]]]:
    """``n`` synthetic dialogue tasks (relative months applied) and their gold atoms (from the originals)."""
    from atommem_rl.tasks.synth import generate_tasks

    tasks, golds = [], []
    for t in generate_tasks(n, seed=seed, kind="dialogue", docs=docs, questions=(1, 3), confounders=1):
        golds.append(gold_facts(t))
        tasks.append(relativise(t, relative, seed)[0])
    return tasks, golds


def gold_rows(tasks: list[Task], golds: list[dict[str, Fact]], counter, s: ExtractSettings | None = None) -> list[dict]:
    s = s or ExtractSettings()
    rows = []
    for t, gold in zip(tasks, golds):
        for w in windows(t, counter, s):
            rows.append({"messages": messages(w) + [{"role": "assistant", "content": target_json(window_gold(w, gold))}],
                         "tools": []})
    return rows


def teacher_rows(tasks: list[Task], golds: list[dict[str, Fact]], backend, s: ExtractSettings | None = None,
                 min_f1: float = 0.6, max_extra: int = 1) -> tuple[list[dict], dict]:
    """Rows from a teacher's outputs, filtered by gold coverage (see the module docstring)."""
    from .extractor import extract_tasks

    s = s or ExtractSettings()
    results = extract_tasks(tasks, backend, s)
    rows, seen = [], 0
    for res, gold in zip(results, golds):
        for r in res:
            seen += 1
            g = window_gold(r.window, gold)
            pairs = match(r.facts, g, min_f1)
            if len(pairs) == len(g) and len(r.facts) - len(pairs) <= max_extra and (g or not r.facts):
                rows.append({"messages": messages(r.window) + [{"role": "assistant", "content": target_json(r.facts)}],
                             "tools": []})
    return rows, {"windows": seen, "kept": len(rows), "score": score(results, golds, min_f1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m atommem_rl.extraction.gold", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSONL of SFT rows")
    p.add_argument("--tasks", type=int, default=60)
    p.add_argument("--seed", type=int, default=0, help="training seed (the held-out bench uses 1000)")
    p.add_argument("--docs", type=int, default=6, help="sessions per task")
    p.add_argument("--relative", type=float, default=0.5, help="share of leading months made relative")
    p.add_argument("--tokenizer", default=None, help="tokenizer for window packing (default SmolLM2)")
    p.add_argument("--teacher-url", default=None, help="OpenAI-compatible endpoint: add teacher rows")
    p.add_argument("--teacher-model", default=None)
    p.add_argument("--no-gold", action="store_true", help="teacher rows only")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from atommem_rl.training.demonstrations import write_rows

    if args.tokenizer:
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from envs.tokens import cached_smollm2_tokenizer

        tok = cached_smollm2_tokenizer()
    tasks, golds = synth_tasks(args.tasks, args.seed, args.docs, args.relative)
    rows, info = ([] if args.no_gold else gold_rows(tasks, golds, TokenCounter(tok))), {}
    info["gold_rows"] = len(rows)
    if args.teacher_url:
        from atommem_rl.inference.chat_backends import make_backend

        teacher = make_backend("openai", base_url=args.teacher_url, model_name=args.teacher_model,
                               tokenizer=args.tokenizer)
        trows, tinfo = teacher_rows(tasks, golds, teacher)
        rows += trows
        info["teacher"] = tinfo
    if not rows:
        print("no rows", file=sys.stderr)
        return 1
    write_rows(rows, Path(args.out))
    print(json.dumps({"out": args.out, "rows": len(rows), **info}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
