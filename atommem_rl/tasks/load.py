"""Task files loaded for evaluation (``atommem eval``, the quickstart, confirm_heldout.py): strict loading
(errors name the file and the record) and subsets.

``load_dataset(path, limit, max_blocks)`` reads a task JSONL; any bad record, or a task id an earlier
record used, raises ``ValueError`` ("task file F, record N (line L, task ID): what is wrong"), also past
``limit`` (every record is validated; the first ``limit`` kept). Evaluation needs gold answers, so a
question without any is an error too. ``max_blocks`` keeps each task's first N blocks and the
questions whose evidence lies entirely inside them -- the same subset for every method, recorded in
metrics.json (a way to run long LoCoMo conversations on a CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

from atommem_rl.tasks.schema import Task, check_new_id


def load_dataset(path: str | Path, limit: int | None = None, max_blocks: int | None = None) -> list[Task]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"task file {path} does not exist")
    if path.is_dir():
        raise ValueError(f"task file {path} is a folder, expected a JSONL file")
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    record = 0
    try:
        fh = path.open(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"task file {path} cannot be read: {exc}") from None
    with fh:
        try:
            lines = list(fh)
        except UnicodeDecodeError as exc:
            raise ValueError(f"task file {path} is not UTF-8 text: {exc}") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record += 1
        where = f"task file {path}, record {record} (line {lineno}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}): not valid JSON: {exc}") from None
        tid = raw.get("id") if isinstance(raw, dict) else None
        where += f", task {tid!r})" if tid is not None else ")"
        try:
            task = Task.from_dict(raw)
            check_new_id(task, seen, lineno)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        for q in task.questions:
            if not q.answers or not all(isinstance(a, str) for a in q.answers):
                raise ValueError(f"{where}: question {q.id} has no gold answers (a list of strings)")
        if limit is not None and len(tasks) >= limit:
            continue  # past the limit: validated, not kept
        if max_blocks is not None:
            task = subset(task, max_blocks)
            if task is None:
                continue
        tasks.append(task)
    if not tasks:
        raise ValueError(f"task file {path} holds no tasks" + (f" with questions inside the first {max_blocks} blocks"
                                                               if max_blocks else ""))
    return tasks


def subset(task: Task, max_blocks: int) -> Task | None:
    """The first ``max_blocks`` blocks and the questions fully answerable from them (None if none)."""
    if len(task.blocks) <= max_blocks:
        return task
    task.require_evidence("--max-blocks (which keeps the questions answerable from the kept blocks)")
    blocks = task.blocks[:max_blocks]
    kept = {u.id for b in blocks for u in b.units}
    qs = [q for q in task.questions if q.evidence and set(q.evidence) <= kept]
    if not qs:
        return None
    rels = [r for r in task.relations if r.new in kept and r.old in kept]
    meta = dict(task.meta, docs=len(blocks), max_blocks=max_blocks, blocks_total=len(task.blocks))
    return Task(id=task.id, kind=task.kind, blocks=blocks, questions=qs, source=task.source, relations=rels, meta=meta)
