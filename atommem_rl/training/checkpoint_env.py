"""The environment a checkpoint was trained in, saved beside its weights (``atommem_env.json``).

SFT, GRPO and PPO write it into their output folder when they save the model; ``scripts/merge_lora.py``
copies it into the merged folder; ``atommem eval``, ``atommem rollout``, ``MemoryAgent`` and
``atommem serve`` read it, so a policy runs in the environment it learned (prompts, tool set, budgets,
whether questions are shown while reading) without ``--policy-env`` by hand. A ``checkpoint-N`` folder
reads its run folder's file. The file::

    {"format": 1, "trained_by": "grpo", "env": {<every EnvConfig setting, resolved>},
     "set": [<the settings the recipe named>], "tools": [<tool names the policy was shown>]}

Only JSON values are kept (the tokenizer is the checkpoint's own, a Chroma client is the user's).
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

ENV_FILE = "atommem_env.json"
FORMAT = 1
# settings that are objects or belong to where the policy runs, never to what it learned
NOT_RECORDED = ("tokenizer", "client", "parser")
# how the training scored episodes: recorded, but never carried into a later run, which scores by its own
# measure (a custom reward module need not be importable where the checkpoint is used)
SCORING = ("reward", "judge_url", "judge_model", "format_penalty", "error_penalty", "evidence_bonus", "relation_bonus")


class CheckpointEnvError(ValueError):
    """A checkpoint's environment file that cannot be read, or an override that names no setting."""


def _jsonable(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def resolved_settings(env_config: dict | None) -> dict:
    """Every EnvConfig setting as the run used it (defaults filled in, ``disable`` as a comma list)."""
    from envs.config import EnvConfig

    cfg = EnvConfig.from_kwargs(**{k: v for k, v in (env_config or {}).items() if k not in ("tokenizer",)})
    out = {}
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if f.name in NOT_RECORDED:
            continue
        if isinstance(v, tuple):
            v = ",".join(v)
        if _jsonable(v):
            out[f.name] = v
    return out


def write_env(folder: str | os.PathLike, env_config: dict | None, trained_by: str) -> Path | None:
    """Write ``folder/atommem_env.json`` (main process only under accelerate launch); returns the path."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_rank() != 0:
        return None
    from envs.tools import tool_schemas

    env = resolved_settings(env_config)
    tools = [t["function"]["name"] for t in tool_schemas(tuple(x for x in env["disable"].split(",") if x))]
    data = {"format": FORMAT, "trained_by": trained_by, "env": env,
            "set": sorted(k for k in (env_config or {}) if k in env), "tools": tools}
    path = Path(folder) / ENV_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def env_file(folder: str | os.PathLike) -> Path | None:
    """The environment file of a model folder: its own, else its run folder's (``checkpoint-N``, ``merged``)."""
    p = Path(folder)
    for cand in (p / ENV_FILE, p.parent / ENV_FILE):
        if cand.is_file():
            return cand
    return None


def read_env(folder: str | os.PathLike | None) -> dict:
    """The recorded file as a dict (``{}`` for a model without one: a base model, an endpoint name)."""
    if folder is None or not Path(folder).is_dir():
        return {}
    path = env_file(folder)
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointEnvError(f"{path}: unreadable environment file ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("env"), dict):
        raise CheckpointEnvError(f"{path}: expected a JSON object with an 'env' mapping")
    if data.get("format", FORMAT) > FORMAT:
        raise CheckpointEnvError(f"{path}: format {data['format']} is newer than this atommem reads ({FORMAT})")
    return data


def check_overrides(overrides: dict, source: str = "--policy-env") -> None:
    """Each key must be an EnvConfig setting (a misspelt one gets "did you mean"), each value valid."""
    from .recipes import RecipeError, check_env_config

    if not isinstance(overrides, dict):
        raise CheckpointEnvError(f"{source} must be a JSON object of environment settings, got {overrides!r}")
    try:
        check_env_config(overrides, source)
    except RecipeError as exc:
        raise CheckpointEnvError(str(exc).replace(f"{source}: env_config", source)) from None


def policy_env(folder: str | os.PathLike | None, overrides: dict | None = None,
               source: str = "--policy-env") -> dict:
    """The checkpoint's recorded settings (less its SCORING) with ``overrides`` on top (checked first)."""
    overrides = dict(overrides or {})
    check_overrides(overrides, source)
    recorded = read_env(folder).get("env", {})
    from envs.config import EnvConfig

    known = {f.name for f in fields(EnvConfig)}
    # a setting a newer atommem recorded and this one lacks is dropped, not an error of the user's
    return {**{k: v for k, v in recorded.items() if k in known and k not in SCORING}, **overrides}


def copy_env(src: str | os.PathLike, dst: str | os.PathLike) -> Path | None:
    """Copy ``src``'s environment file (its own or its run folder's) into ``dst`` (LoRA merges)."""
    path = env_file(src)
    if path is None:
        return None
    out = Path(dst) / ENV_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(path.read_text())
    return out
