"""The ROAM setting's environment check (issue 40, item 1): paired per-task differences between scripted
oracles' rollouts on the same tasks, from their trajectory files.

    python scripts/roam_check.py --tasks tasks/roam.jsonl label=runs/l.jsonl nolabel=runs/n.jsonl \
        update=runs/u.jsonl [--json out.json]

Per run: mean ± standard error over tasks of the episode's EM (mean over its questions), evidence recall,
the environment's confounder-token share (envs/attribution.py: term-overlap attribution, a fused view counts
whole when any atom it folds is attributed to a confounder or distractor unit) and an exact confounder-token
share: answer-phase memory lines whose own atom text is, verbatim, the statement of a confounder or distractor
unit (the oracle stores unit statements verbatim, so no attribution is needed), in the policy's tokens; and the
flood share: the same, for lines whose own atom is outdated (the old side of a gold ``conflict``: its value
changed later) or a duplicate (the covered side of a gold equivalent or subsumption pair whose other side is
shown in the same prompt), i.e. what ROAM's Primary-only retrieval keeps out of the top-k. Then
the first run minus each other one, paired on the same tasks (atommem_rl/pipeline/stats.py: mean_se, verdict).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atommem_rl.pipeline.stats import mean_se, verdict  # noqa: E402
from atommem_rl.tasks.schema import load_tasks  # noqa: E402

_LINE = re.compile(r"^\[M\d+\] (.*)$")
_FOLD = re.compile(r" \[(previously|also): .*$")


def _memory_lines(prompt: list[dict]) -> list[str]:
    """The memory view lines of one prompt (the "# Memory" section of the user message)."""
    user = prompt[-1]["content"]
    out, inside = [], False
    for line in user.split("\n"):
        if line.startswith("# "):
            inside = line.startswith("# Memory")
            continue
        m = _LINE.match(line) if inside else None
        if m:
            out.append(m.group(1))
    return out


def per_task(path: str, tasks: dict, count) -> dict[str, dict[str, float | None]]:
    """{task id: {em, evidence_recall, confounder_share, exact_confounder_share}} of one trajectory file."""
    out = {}
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        t = tasks[r["task_id"]]
        units = t.units()
        noise = {u.statement() for u in units.values() if u.role in ("confounder", "distractor")}
        outdated = {units[g.old].statement() for g in t.relations if g.label == "conflict"}
        dup_of: dict[str, set[str]] = {}  # covered statement -> the statements of the same value covering it
        for g in t.relations:
            if g.label in ("equivalent", "new_subsumed_by_old", "old_subsumed_by_new"):
                a, b = (g.old, g.new) if g.label == "old_subsumed_by_new" else (g.new, g.old)
                dup_of.setdefault(units[a].statement(), set()).add(units[b].statement())
        tot = conf = flood = 0
        for st in r.get("steps") or []:
            if st.get("phase") != "answer" or not st.get("prompt"):
                continue
            lines = _memory_lines(st["prompt"])
            owns = {_FOLD.sub("", text) for text in lines}
            for text in lines:
                n = count(text)
                tot += n
                own = _FOLD.sub("", text)
                conf += n if own in noise else 0
                flood += n if own in outdated or dup_of.get(own, set()) & owns else 0
        qs = r.get("questions") or []
        out[r["task_id"]] = {"em": sum(q["em"] for q in qs) / len(qs) if qs else 0.0,
                             "evidence_recall": r.get("evidence_recall"),
                             "confounder_share": r.get("confounder_token_share"),
                             "exact_confounder_share": conf / tot if tot else None,
                             "flood_share": flood / tot if tot else None,
                             "labels": (r.get("ops") or {}).get("relate", 0)}
    return out


METRICS = ("em", "evidence_recall", "confounder_share", "exact_confounder_share", "flood_share", "labels")


def compare(runs: dict[str, dict], metrics=METRICS) -> dict:
    """Per run and metric ``mean_se``; the first run minus each other one, paired on the tasks both define."""
    names = list(runs)
    res: dict = {"runs": {}, "paired": {}}
    for name in names:
        res["runs"][name] = {m: mean_se([v[m] for v in runs[name].values() if v[m] is not None]) for m in metrics}
    first = names[0]
    for other in names[1:]:
        res["paired"][f"{first} - {other}"] = {}
        for m in metrics:
            common = [k for k in runs[first] if k in runs[other]
                      and runs[first][k][m] is not None and runs[other][k][m] is not None]
            d = mean_se([runs[first][k][m] - runs[other][k][m] for k in common])
            if d["n"]:
                d["verdict"] = verdict(d)
            res["paired"][f"{first} - {other}"][m] = d
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", required=True)
    ap.add_argument("runs", nargs="+", help="NAME=trajectories.jsonl; the first is compared with each other one")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    from envs.tokens import as_tokens

    tasks = {t.id: t for t in load_tasks(args.tasks)}
    count = as_tokens(None).count
    runs = {}
    for spec in args.runs:
        name, _, path = spec.partition("=")
        if not path:
            ap.error(f"expected NAME=PATH, got {spec!r}")
        runs[name] = per_task(path, tasks, count)
    res = compare(runs)
    for name, ms in res["runs"].items():
        print(name, "  ".join(f"{m} {v['mean']:.4f}±{v['se']:.4f}" for m, v in ms.items() if v["n"]))
    for pair, ms in res["paired"].items():
        print(pair, "  ".join(f"{m} {v['mean']:+.4f}±{v['se']:.4f} (n={v['n']}, {v['verdict']})"
                              for m, v in ms.items() if v["n"]))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
