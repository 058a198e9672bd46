r"""``atommem data synth|prepare``: build memory tasks (JSONL, one task per line).

    atommem data synth --out tasks/synth.jsonl --tasks 100 --seed 0 --kind documents --docs 20 \
        --questions 1-3 --confounders 2
    atommem data synth --setting roam --out tasks/roam.jsonl --tasks 256 --seed 4000 --questions 2-3 --changes 3
    atommem data prepare --source hotpotqa --out tasks/hotpotqa.jsonl --docs 20 --questions 2
        (--path defaults to the shipped file of the source: atommem_rl/data/benchmarks/README.md)
    atommem data prepare --source jsonl --path my.jsonl --out tasks/mine.jsonl \
        --context-field passages --question-field q --answer-field a
        (your own file: one task per line, field names as given; atommem_rl/tasks/own.py, docs/OWN_DATA.md)

Task format: ``atommem_rl/tasks/schema.py``; generator: ``atommem_rl/tasks/synth.py``; loaders:
``atommem_rl/tasks/{hotpotqa,locomo,longmemeval}.py``. Output is deterministic for a seed.
"""

from __future__ import annotations

import argparse
import json

from . import at_most, input_file, output_file, positive_int, seed_int


def _range(text: str) -> int | tuple[int, int]:
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-", 1))
            if not 1 <= lo <= hi <= 10:
                raise ValueError
            return lo, hi
        n = int(text)
        if not 1 <= n <= 10:
            raise ValueError
        return n
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count 1-10 or a range like 1-3, got {text!r}") from None


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("data", help="generate synthetic tasks or prepare real benchmark tasks",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = parser.add_subparsers(dest="data_command", required=True, metavar="ACTION")

    s = kinds.add_parser("synth", help="generate synthetic memory tasks (deterministic for a seed)")
    s.add_argument("--out", required=True, help="output JSONL file")
    s.add_argument("--tasks", type=at_most(10**6), default=100, help="number of tasks (default 100)")
    s.add_argument("--seed", type=seed_int, default=0, help="random seed (default 0)")
    s.add_argument("--kind", choices=["documents", "dialogue"], default="documents", help="documents or dialogue sessions")
    s.add_argument("--docs", type=at_most(10**5), default=20, help="documents (or sessions) per task, e.g. 200 or 800 (default 20)")
    s.add_argument("--questions", type=_range, default=(1, 3), help="questions per task: N or LO-HI within 1-10 (default 1-3)")
    s.add_argument("--confounders", type=int, default=2, choices=range(0, 9), metavar="C",
                   help="confounder statements per question, 0-8 (default 2)")
    s.add_argument("--setting", choices=["standard", "roam"], default="standard",
                   help="standard (synth.py) or roam: accumulating, duplicated, partial and changing facts per "
                        "person (synth_roam.py, docs/benchmarks/roam_setting.md)")
    s.add_argument("--changes", type=int, default=3, choices=range(1, 6), metavar="N",
                   help="dated changes per attribute with --setting roam, 1-5 (default 3)")
    s.set_defaults(func=run_synth)

    p = kinds.add_parser("prepare", help="turn a real benchmark file into tasks")
    p.add_argument("--source", required=True, choices=["hotpotqa", "musique", "locomo", "longmemeval", "jsonl"])
    p.add_argument("--path", default=None, help="the benchmark file (default for hotpotqa, musique, locomo: the "
                   "subset shipped in atommem_rl/data/benchmarks; longmemeval needs one)")
    p.add_argument("--out", required=True, help="output JSONL file")
    p.add_argument("--corpus", default=None, help="passage pool for distractors (hotpotqa/musique; default: the "
                   "*_corpus.json next to --path when present)")
    p.add_argument("--docs", type=at_most(10**5), default=20, help="documents per task for hotpotqa/musique (default 20)")
    p.add_argument("--questions", type=_range, default=1, help="questions packed per task, N or LO-HI (default 1)")
    p.add_argument("--limit", type=positive_int, default=None, help="use at most this many source questions/conversations")
    p.add_argument("--keep-adversarial", action="store_true", help="locomo: keep category-5 questions")
    p.add_argument("--questions-per-task", type=positive_int, default=None,
                   help="locomo: questions per task; a conversation gives several tasks (default 10)")
    p.add_argument("--seed", type=seed_int, default=0, help="random seed (default 0)")
    own = p.add_argument_group("--source jsonl: your own file, one task per line (docs/OWN_DATA.md)")
    own.add_argument("--context-field", default="context", help="documents (a string or a list) or chat turns "
                     "(a list of {role, content}, or a list of sessions) (default: context)")
    own.add_argument("--question-field", default="question", help="a question or a list (default: question)")
    own.add_argument("--answer-field", default="answer", help="the answer(s), one entry per question (default: answer)")
    own.add_argument("--id-field", default=None, help="the task id (default: own-<line number>)")
    p.set_defaults(func=run_prepare)


def run_synth(args) -> int:
    from atommem_rl.tasks.schema import save_tasks
    from atommem_rl.tasks.synth import generate_tasks

    output_file(args.out, "--out")
    if args.setting == "roam":
        from atommem_rl.tasks.synth_roam import generate_tasks as generate_tasks  # noqa: F811
    kw = {"changes": args.changes} if args.setting == "roam" else {}
    tasks = generate_tasks(args.tasks, args.seed, kind=args.kind, docs=args.docs, questions=args.questions,
                           confounders=args.confounders, **kw)
    n = save_tasks(tasks, args.out)
    print(json.dumps({"tasks": n, "questions": sum(len(t.questions) for t in tasks), "out": args.out}))
    return 0


def run_prepare(args) -> int:
    from atommem_rl.tasks import prepare
    from atommem_rl.tasks.schema import save_tasks

    if args.path is None:
        if args.source in ("longmemeval", "jsonl"):
            raise ValueError(f"--path: {args.source} ships no file here; give the file to prepare")
        from atommem_rl.data import benchmark_file

        args.path = str(benchmark_file(args.source))
    input_file(args.path, "--path")
    if args.corpus:
        input_file(args.corpus, "--corpus")
    output_file(args.out, "--out")
    if args.source == "jsonl":
        from atommem_rl.tasks.own import prepare_jsonl

        tasks = prepare_jsonl(args.path, context_field=args.context_field, question_field=args.question_field,
                              answer_field=args.answer_field, id_field=args.id_field, limit=args.limit)
    else:
        tasks = prepare.prepare(args.source, args.path, corpus=args.corpus, docs=args.docs, questions=args.questions,
                                limit=args.limit, seed=args.seed, keep_adversarial=args.keep_adversarial,
                                questions_per_task=args.questions_per_task)
    n = save_tasks(tasks, args.out)
    print(json.dumps({"tasks": n, "questions": sum(len(t.questions) for t in tasks), "source": args.source,
                      "out": args.out}))
    return 0
