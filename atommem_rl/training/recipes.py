"""Recipes: a YAML file of flat keys (= fields of a config dataclass) plus ``--key value`` overrides.

This is TRL's convention (``trl.TrlParser.parse_args_and_config``: the YAML sets the parser's
defaults, the command line overrides them, an optional ``env:`` mapping sets environment variables).
TrlParser is reused for the parsing; what it does not do, and this module adds, is to check the YAML
*before any work starts*: every key must be a field of the config class and every value must match
the field's type (pydantic, against the dataclass's annotations), and the error names the file and
the key (TrlParser would pass a wrong-typed YAML value through unchecked, and report unknown keys
without the file name).

    from atommem_rl.training.recipes import parse_recipe_args, load_recipe
    config = parse_recipe_args(SFTRecipeConfig, ["--config", "recipes/quickstart/sft.yaml", "--max_steps", "2"])
    config = load_recipe(SFTRecipeConfig, "recipes/qwen3_8b/sft.yaml")     # what tests/test_recipes.py does

``RECIPE_CONFIGS`` maps a recipe's file name (``sft.yaml`` in any folder) to its config class as an
import path; a class whose module does not exist yet is reported as missing (tests skip it).

Shell helper (used by the sbatch scripts; reads only the YAML, imports no torch)::

    python -m atommem_rl.training.recipes run-dir RECIPE [--key value ...]   # -> checkpoints/<run_name>
    python -m atommem_rl.training.recipes get RECIPE KEY [--key value ...]   # -> the value (or empty)
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import functools
import importlib
import math
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Strict, TypeAdapter, ValidationError
from typing_extensions import TypedDict  # (a pydantic dependency) pydantic needs this one before Python 3.12

# recipe file name -> config class ("module:Class"); the GRPO/PPO entries resolve once those land.
RECIPE_CONFIGS: dict[str, str] = {
    "sft.yaml": "atommem_rl.training.sft:SFTRecipeConfig",
    "grpo.yaml": "atommem_rl.training.grpo:GRPORecipeConfig",
    "ppo.yaml": "atommem_rl.training.ppo:PPORecipeConfig",
}
# recipe folders that hold other tools' configs, validated by those tools (tests/test_recipes.py)
FOREIGN_DIRS = {"accelerate"}
CHECKPOINTS = "checkpoints"


# keys that recipes used to take -> what replaced them (the error says so instead of "unknown key")
RENAMED = {
    "skip_zero_advantage": "zero_advantage (true -> skip, false -> train)",
    "hold_on_zero_advantage": "zero_advantage (true -> hold; with drop_zero_advantage -> drop_hold)",
    "drop_zero_advantage": "zero_advantage (true -> drop; with hold_on_zero_advantage -> drop_hold)",
}


def _renamed(key: str) -> str | None:
    return f"{key!r} was replaced by {RENAMED[key]}" if key in RENAMED else None


class RecipeError(ValueError):
    """A recipe or an override is invalid; the message names the file and the key."""


def config_class(recipe: str | os.PathLike) -> type | None:
    """The config class for a recipe file, or None when its module does not exist (yet)."""
    name = Path(recipe).name
    if name not in RECIPE_CONFIGS:
        raise RecipeError(f"{recipe}: no config class for recipe file name {name!r} "
                          f"(known: {', '.join(sorted(RECIPE_CONFIGS))}; extend RECIPE_CONFIGS)")
    module, _, cls = RECIPE_CONFIGS[name].partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            return None
        raise
    return getattr(mod, cls)


def read_yaml(path: str | os.PathLike) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"recipe not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise RecipeError(f"{p}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"{p}: a recipe must be a YAML mapping of flat keys, got {type(data).__name__}")
    return data


# ------------------------------------------------------------------ type checks against field annotations
# pydantic checks a recipe strictly against the config's annotations (no bool for a count, no "5" for
# an int, unions and lists checked member by member), except where YAML writes the value differently:
def _as_str(v: Any) -> Any:  # a YAML number such as `synth_questions: 2` for a str field
    return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v


def _as_float(v: Any) -> Any:  # PyYAML reads 1e-6 (no dot) as a string
    return float(v) if isinstance(v, str) else v


def _as_int(v: Any) -> Any:  # 2.0 is 2
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _as_bool(v: Any) -> Any:  # a quoted "yes"
    return v.lower() in ("true", "yes") if isinstance(v, str) and v.lower() in ("true", "false", "yes", "no") else v


_YAML_SCALARS = {str: Annotated[str, BeforeValidator(_as_str)], float: Annotated[float, BeforeValidator(_as_float)],
                 int: Annotated[int, BeforeValidator(_as_int)], bool: Annotated[bool, BeforeValidator(_as_bool)]}


def _yaml_type(tp: Any) -> Any:
    """Annotation ``tp`` with its scalars as YAML writes them (above) and enums taking their values."""
    if tp in _YAML_SCALARS:
        return _YAML_SCALARS[tp]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return Annotated[tp, Strict(False)]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(map(_yaml_type, args))]
    if origin in (list, tuple, set, dict) and args:
        return origin[tuple(map(_yaml_type, args))]
    return tp


@functools.cache
def _recipe_adapter(config_cls: type) -> TypeAdapter:
    """A TypedDict of the config's init fields, all optional: validates a recipe without building the
    config (a TRL config's __post_init__ would set up devices)."""
    hints = typing.get_type_hints(config_cls)
    keys = {f.name: _yaml_type(hints.get(f.name, Any)) for f in dataclasses.fields(config_cls) if f.init}
    shape = TypedDict(config_cls.__name__, keys, total=False)
    shape.__pydantic_config__ = ConfigDict(strict=True, extra="forbid", arbitrary_types_allowed=True)
    return TypeAdapter(shape)


def _type_name(tp: Any) -> str:
    return str(tp).replace("typing.", "") if not isinstance(tp, type) else tp.__name__


def check_recipe(config_cls: type, data: dict, source: str) -> dict:
    """Validated, type-converted recipe values (``env`` excluded). Raises RecipeError naming ``source``."""
    if "env" in data and not isinstance(data["env"], dict):
        raise RecipeError(f"{source}: key 'env' must be a mapping of environment variables")
    values = {k: v for k, v in data.items() if k != "env"}
    try:
        return _recipe_adapter(config_cls).validate_python(values)
    except ValidationError as exc:
        first = exc.errors()[0]  # loc[0]: the key (then a union member or a list index)
    key = first["loc"][0]
    if first["type"] == "extra_forbidden":
        if _renamed(key):
            raise RecipeError(f"{source}: key {_renamed(key)}")
        fields = [f.name for f in dataclasses.fields(config_cls) if f.init]
        near = difflib.get_close_matches(key, fields, n=3)
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise RecipeError(f"{source}: unknown key {key!r} for {config_cls.__name__}{hint}")
    value = data[key]
    raise RecipeError(f"{source}: key {key!r} must be {_type_name(typing.get_type_hints(config_cls)[key])}, "
                      f"got {value!r} ({type(value).__name__})")


def parse_recipe_args(config_cls: type, argv: list[str] | None = None, apply_env: bool = True):
    """``--config RECIPE`` (optional) plus ``--key value`` overrides -> one ``config_cls`` instance."""
    from trl import TrlParser

    argv = list(sys.argv[1:] if argv is None else argv)
    source, data = "command line", {}
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise RecipeError("--config needs a recipe path")
        source = argv[i + 1]
        del argv[i:i + 2]
        data = read_yaml(source)
    values = check_recipe(config_cls, data, source)
    if apply_env:
        for k, v in (data.get("env") or {}).items():
            os.environ[str(k)] = str(v)
    # exit_on_error=False: a bad command-line value raises (and is reported below, one line naming
    # the option) instead of argparse printing the whole usage and exiting
    # allow_abbrev=False: a misspelt key (--learning_rat) is an unknown option, not a prefix of a real one
    parser = TrlParser([config_cls], exit_on_error=False, allow_abbrev=False)
    parser.set_defaults_with_config(**values)
    try:
        (config,) = parser.parse_args_into_dataclasses(args=argv)
    except argparse.ArgumentError as exc:
        raise RecipeError(f"command line: {exc}") from None
    except (ValueError, ArithmeticError) as exc:  # a config's own checks divide by a count set to 0
        msg = str(exc)
        if "not used by the HfArgumentParser" in msg:
            hints = [_renamed(a.lstrip("-").split("=")[0]) for a in argv if a.startswith("--")]
            if any(hints):
                raise RecipeError(f"command line: {next(h for h in hints if h)}") from None
            raise RecipeError(f"unknown command-line option(s) for {config_cls.__name__}: "
                              f"{msg.split(':', 1)[1].strip()}") from None
        where = f"{source} with overrides {argv}" if argv else source
        raise RecipeError(f"{where}: invalid {config_cls.__name__}: {msg}") from exc
    check_values(config, f"{source} with overrides {argv}" if argv else source)
    return config


# ------------------------------------------------------------------ values that parse but mean nothing
# counts that must be at least 1 where set (0 examples per batch or 0 steps between saves cannot run)
POSITIVE = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
            "num_generations", "max_completion_length", "max_prompt_length",
            "max_length", "steps_per_generation", "synth_tasks", "synth_docs", "num_iterations")
# counts and rates that must not be negative where set
# above 0 where set (Trainer reads save_steps/logging_steps below 1 as a share of the run)
ABOVE_ZERO = ("save_steps", "logging_steps", "eval_steps", "num_train_epochs")
NON_NEGATIVE = ("learning_rate", "weight_decay", "warmup_steps", "warmup_ratio", "max_grad_norm",
                "seed", "synth_seed", "synth_confounders", "save_total_limit", "temperature", "beta", "lora_r",
                "lora_alpha", "lora_dropout", "adam_epsilon")
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_values(config: Any, source: str) -> None:
    """Refuse, naming ``source`` and the key, values that parse but mean nothing: NaN or infinite
    numbers, negative counts, ``max_steps`` other than a positive count or -1 (-3 silently meant "train
    num_train_epochs"), a ``run_name`` that leaves ``checkpoints/`` (``../../x``), and ``env_config``
    keys or values ``envs.core.EnvConfig`` does not take (they failed with a TypeError after the model
    had loaded)."""
    for f in dataclasses.fields(config):
        v = getattr(config, f.name, None)
        if isinstance(v, float) and not math.isfinite(v):
            raise RecipeError(f"{source}: key {f.name!r} must be a finite number, got {v!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if f.name in POSITIVE and v < 1:
            raise RecipeError(f"{source}: key {f.name!r} must be at least 1, got {v!r}")
        if f.name in ABOVE_ZERO and v <= 0:
            raise RecipeError(f"{source}: key {f.name!r} must be above 0, got {v!r}")
        if f.name in NON_NEGATIVE and v < 0:
            raise RecipeError(f"{source}: key {f.name!r} must not be negative, got {v!r}")
    steps = getattr(config, "max_steps", -1)
    if steps != -1 and steps < 1:
        raise RecipeError(f"{source}: key 'max_steps' must be a positive number of steps, or -1 to train "
                          f"num_train_epochs, got {steps!r}")
    name = getattr(config, "run_name", None)
    if name is not None and not _RUN_NAME.fullmatch(str(name)):
        raise RecipeError(f"{source}: key 'run_name' must be a plain folder name ([A-Za-z0-9._-], no '/' or "
                          f"leading '.'), got {name!r}: outputs go to checkpoints/<run_name>")
    if getattr(config, "env_config", None):
        check_env_config(config.env_config, source)


def check_env_config(env: dict, source: str) -> None:
    """``env_config`` checked like a recipe against envs.core.EnvConfig (unknown key with a close match,
    wrong type), then by EnvConfig itself (ranges), before any model is loaded."""
    from envs.core import EnvConfig

    where = f"{source}: env_config"
    values = check_recipe(EnvConfig, {k: v for k, v in env.items() if k != "disable"}, where)
    if "disable" in env:
        values["disable"] = env["disable"]
    try:
        EnvConfig(**values)
    except (TypeError, ValueError) as exc:
        raise RecipeError(f"{where}: {exc}") from None


def load_recipe(config_cls: type, path: str | os.PathLike, overrides: list[str] = ()):
    """Load a recipe into its config without running anything (no env variables are set)."""
    return parse_recipe_args(config_cls, ["--config", str(path), *overrides], apply_env=False)


# ------------------------------------------------------------------ light, YAML-only look-ups for shell scripts
def raw_value(path: str | os.PathLike, key: str, overrides: list[str] = (), default: Any = None) -> Any:
    """``key`` as the recipe plus ``--key value`` overrides set it (last one wins); no dataclass import."""
    value = read_yaml(path).get(key, default)
    args = list(overrides)
    for i, a in enumerate(args):
        if a == f"--{key}" and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(f"--{key}="):
            value = a.split("=", 1)[1]
    return value


def run_dir(path: str | os.PathLike, overrides: list[str] = ()) -> str:
    """The run's folder: the parent of ``output_dir`` when set, else ``checkpoints/<run_name>``."""
    out = raw_value(path, "output_dir", overrides)
    if out:
        return str(Path(out).parent)
    return str(Path(CHECKPOINTS) / str(raw_value(path, "run_name", overrides, default="atommem")))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "run-dir":
        print(run_dir(argv[1], argv[2:]))
        return 0
    if len(argv) >= 3 and argv[0] == "get":
        value = raw_value(argv[1], argv[2], argv[3:])
        print("" if value is None else value)
        return 0
    print(__doc__.split("Shell helper")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
