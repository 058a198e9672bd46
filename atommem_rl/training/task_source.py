"""Where a training stage gets its tasks, and how they become TRL dataset rows.

A recipe names a tasks JSONL (``atommem data synth|prepare``) or asks for synthetic tasks made on
the fly with a seed; ``env_config`` holds the environment's keyword arguments (``envs.core.EnvConfig``
fields, e.g. ``chunk_tokens``). Shared by the SFT, GRPO and PPO configs as a dataclass mixin.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..tasks.schema import Task, load_tasks
from ..tasks.synth import generate_tasks

REPO = Path(__file__).resolve().parents[2]


def parse_mapping(name: str, text: str):
    """A mapping given on the command line: JSON or YAML flow (``{chunk_tokens: 256}``), as a recipe file
    writes it. Anything else is left to the caller's type check."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{name} must be a mapping (JSON or YAML flow, e.g. '{{chunk_tokens: 256}}'): "
                         f"{str(exc).splitlines()[0]}") from None


@dataclass
class TaskSource:
    tasks: str | None = field(default=None, metadata={"help": "Tasks JSONL; when unset, synthetic tasks are made."})
    synth_tasks: int = field(default=8, metadata={"help": "Synthetic tasks to generate when tasks is unset."})
    synth_kind: str = field(default="documents", metadata={"help": "documents or dialogue."})
    synth_setting: str = field(default="standard", metadata={
        "help": "standard (tasks/synth.py) or roam: observations about the same people accumulate (dated changes, "
                "paraphrased duplicates, partial facts; tasks/synth_roam.py, docs/benchmarks/roam_setting.md)."})
    synth_changes: int = field(default=3, metadata={"help": "roam setting: dated changes per attribute, 1-5."})
    synth_docs: int = field(default=6, metadata={"help": "Documents (or sessions) per synthetic task."})
    synth_questions: str = field(default="2", metadata={"help": "Questions per synthetic task: N or LO-HI (1-10)."})
    synth_confounders: int = field(default=2, metadata={"help": "Confounders per question."})
    synth_seed: int = field(default=0, metadata={"help": "Seed of the synthetic tasks."})
    env_config: dict | str | None = field(
        default=None, metadata={"help": "Environment keyword arguments (a mapping: JSON or YAML flow, as in a "
                                        "recipe: '{chunk_tokens: 256}'), e.g. chunk_tokens."})

    def __post_init__(self):
        if isinstance(self.env_config, str):
            self.env_config = parse_mapping("env_config", self.env_config)
        if self.env_config is not None and not isinstance(self.env_config, dict):
            raise ValueError("env_config must be a mapping")
        if self.synth_kind not in ("documents", "dialogue"):
            raise ValueError(f"synth_kind must be documents or dialogue, got {self.synth_kind!r}")
        if self.synth_setting not in ("standard", "roam"):
            raise ValueError(f"synth_setting must be standard or roam, got {self.synth_setting!r}")
        if not 1 <= self.synth_changes <= 5:
            raise ValueError(f"synth_changes must be between 1 and 5, got {self.synth_changes}")
        if self.synth_tasks < 1:
            raise ValueError("synth_tasks must be >= 1")
        try:
            lo, _, hi = str(self.synth_questions).partition("-")
            self.synth_question_range = (int(lo), int(hi)) if hi else int(lo)
        except ValueError:
            raise ValueError(f"synth_questions must be N or LO-HI, got {self.synth_questions!r}") from None


def resolve_path(path: str | None) -> str | None:
    """Relative paths are taken from the working directory, else from the repository root."""
    if path is None or Path(path).is_absolute() or Path(path).exists() or not (REPO / path).exists():
        return path
    return str(REPO / path)


def synthetic_tasks(source: TaskSource, n: int, seed: int) -> list[Task]:
    """``n`` synthetic tasks of ``source``'s settings made with ``seed`` (training sets and held-out sets alike)."""
    kw = dict(kind=source.synth_kind, docs=source.synth_docs, questions=source.synth_question_range,
              confounders=source.synth_confounders)
    if source.synth_setting == "roam":
        from ..tasks.synth_roam import generate_tasks as roam_tasks

        return roam_tasks(n, seed=seed, changes=source.synth_changes, **kw)
    return generate_tasks(n, seed=seed, **kw)


def load_train_tasks(source: TaskSource) -> list[Task]:
    if source.tasks:
        return load_tasks(resolve_path(source.tasks))
    return synthetic_tasks(source, source.synth_tasks, source.synth_seed)


def task_rows(tasks: list[Task]):
    """A ``datasets.Dataset`` with TRL's required ``prompt`` column (a placeholder: the environment
    writes every real prompt) and the task itself as JSON."""
    from datasets import Dataset

    return Dataset.from_list([
        {"prompt": [{"role": "user", "content": t.id}], "task": json.dumps(t.to_dict())} for t in tasks
    ])
