"""What the sbatch scripts need to know about a GRPO/PPO recipe before they start anything.

    python -m atommem_rl.training.launch stage RECIPE [--key value ...]          # -> grpo|ppo (why: stderr)
    python -m atommem_rl.training.launch max-model-len RECIPE [--key value ...]  # -> vLLM's --max-model-len
    python -m atommem_rl.training.launch plan RECIPE [--key value ...]           # -> shell assignments

The stage rule: ``ATOMMEM_STAGE=grpo|ppo`` when set; otherwise a recipe is PPO when it (or an override)
sets any field that :class:`~atommem_rl.training.ppo.PPORecipeConfig` has and
:class:`~atommem_rl.training.grpo.GRPORecipeConfig` lacks (computed from the dataclasses, see
:func:`ppo_only_fields`), else GRPO. A GRPO recipe with such a key would be refused by the GRPO parser
anyway ("unknown key"), so the rule cannot send a valid GRPO recipe to PPO.

vLLM's window: ``vllm_max_model_length`` when the recipe or an override sets it; otherwise the env's
``max_prompt_tokens`` (``env_config``, default :class:`envs.core.EnvConfig`'s) plus
``max_completion_length``. The env counts ``max_prompt_tokens`` on the rendered chat template *with*
the generation prompt, which is exactly the prompt the trainer sends to vLLM
(``apply_chat_template(..., add_generation_prompt=True)`` in ``TrainerPolicy.act``), and one step's
completion is at most ``max_completion_length`` tokens, so their sum is the longest sequence a step
can need; no slack is added.

``plan`` prints ``STAGE``, ``STAGE_REASON``, ``MAX_MODEL_LEN``, ``MAX_MODEL_LEN_REASON`` and the array
``VLLM_SERVE_ARGS`` (shell-quoted, for ``eval``): one Python start (the config classes import TRL) per
job. ``VLLM_SERVE_ARGS`` are the arguments after ``vllm serve MODEL`` exactly as TRL 1.16's own
``trl vllm-serve`` builds them (``trl.scripts.vllm_serve.build_command``: ``--weight-transfer-config
'{"backend": "nccl"}' --logprobs-mode processed_logprobs --max-logprobs -1``, ``--enable-scale-out`` when
the installed vLLM is 0.30 or later, and TRL's defaults for dtype, memory use and so on); that command
also needs ``VLLM_SERVER_DEV_MODE=1`` in the server's environment, which the sbatch script sets.
Only the YAML and the ``--key value`` overrides are read: the model and the tasks file need not exist.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from typing import Any

from .recipes import RecipeError, raw_value, read_yaml

STAGES = ("grpo", "ppo")


def ppo_only_fields() -> set[str]:
    """Fields of PPORecipeConfig that GRPORecipeConfig does not have (imports TRL)."""
    from .grpo import GRPORecipeConfig
    from .ppo import PPORecipeConfig

    return ({f.name for f in dataclasses.fields(PPORecipeConfig)}
            - {f.name for f in dataclasses.fields(GRPORecipeConfig)})


def _override_keys(overrides: list[str]) -> list[str]:
    return [a[2:].split("=", 1)[0] for a in overrides if a.startswith("--") and len(a) > 2]


def stage(recipe: str, overrides: list[str] = (), env: dict | None = None) -> tuple[str, str]:
    """(grpo|ppo, why) for a recipe plus overrides; ``ATOMMEM_STAGE`` in ``env`` (default os.environ) wins."""
    env = os.environ if env is None else env
    forced = env.get("ATOMMEM_STAGE", "")
    if forced:
        if forced not in STAGES:
            raise RecipeError(f"ATOMMEM_STAGE={forced!r}: expected one of {', '.join(STAGES)}")
        return forced, f"ATOMMEM_STAGE={forced}"
    only = ppo_only_fields()
    keys = list(read_yaml(recipe)) + _override_keys(list(overrides))
    hits = sorted({k for k in keys if k in only})
    if hits:
        return "ppo", f"{recipe} sets {', '.join(hits)}, which only PPORecipeConfig has"
    return "grpo", (f"{recipe} sets none of PPORecipeConfig's own fields ({', '.join(sorted(only))}); "
                    "ATOMMEM_STAGE=ppo forces PPO")


def _field_default(cls: type, name: str) -> Any:
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                return f.default_factory()  # type: ignore[misc]
    raise KeyError(name)


def max_model_len(recipe: str, overrides: list[str] = (), stage_name: str = "grpo") -> tuple[int, str]:
    """(vLLM's --max-model-len, why): see the module docstring."""
    from envs.core import EnvConfig

    from .grpo import GRPORecipeConfig
    from .ppo import PPORecipeConfig

    cls = PPORecipeConfig if stage_name == "ppo" else GRPORecipeConfig
    overrides = list(overrides)
    set_len = raw_value(recipe, "vllm_max_model_length", overrides)
    if set_len not in (None, "", "None", "null"):
        return int(set_len), "vllm_max_model_length"
    env = raw_value(recipe, "env_config", overrides)
    if isinstance(env, str):  # an override: JSON, as TaskSource reads it
        try:
            env = json.loads(env)
        except json.JSONDecodeError as exc:
            raise RecipeError(f"--env_config: not a JSON object: {exc}") from None
    env = env or {}
    if not isinstance(env, dict):
        raise RecipeError(f"{recipe}: env_config must be a mapping")
    prompt = int(env.get("max_prompt_tokens", _field_default(EnvConfig, "max_prompt_tokens")))
    completion = raw_value(recipe, "max_completion_length", overrides)
    completion = int(completion if completion not in (None, "") else _field_default(cls, "max_completion_length"))
    return prompt + completion, f"env max_prompt_tokens {prompt} + max_completion_length {completion}"


def vllm_serve_args(model: str, *, tensor_parallel_size: int, port: int, max_len: int,
                    host: str = "0.0.0.0") -> list[str]:
    """The arguments after ``vllm serve MODEL`` that TRL 1.16's ``trl vllm-serve`` would pass."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    cmd = build_command(ScriptArguments(model=model, host=host, port=port, tensor_parallel_size=tensor_parallel_size,
                                        max_model_len=max_len))
    i = cmd.index("serve")
    assert cmd[i + 1] == model, cmd
    return cmd[i + 2:]


def plan(recipe: str, overrides: list[str], *, tensor_parallel_size: int, port: int, model: str) -> str:
    st, why = stage(recipe, overrides)
    n, n_why = max_model_len(recipe, overrides, st)
    args = vllm_serve_args(model, tensor_parallel_size=tensor_parallel_size, port=port, max_len=n)
    q = shlex.quote
    return "\n".join([f"STAGE={q(st)}", f"STAGE_REASON={q(why)}", f"MAX_MODEL_LEN={n}",
                      f"MAX_MODEL_LEN_REASON={q(n_why)}",
                      "VLLM_SERVE_ARGS=(" + " ".join(q(a) for a in args) + ")"])


class _StdoutToStderr:
    """File descriptor 1 onto 2 while the config classes import: libraries print there (transformers' W&B
    note, for one), and ``plan``'s stdout is read back by the shell."""

    def __enter__(self):
        sys.stdout.flush()
        self.saved = os.dup(1)
        os.dup2(2, 1)

    def __exit__(self, *exc):
        sys.stdout.flush()
        os.dup2(self.saved, 1)
        os.close(self.saved)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    with _StdoutToStderr():
        ppo_only_fields()  # the imports, whose noise goes to stderr
    if len(argv) >= 2 and argv[0] == "stage":
        st, why = stage(argv[1], argv[2:])
        print(st)
        print(f"stage: {st} ({why})", file=sys.stderr)
        return 0
    if len(argv) >= 2 and argv[0] == "max-model-len":
        st, _ = stage(argv[1], argv[2:])
        n, why = max_model_len(argv[1], argv[2:], st)
        print(n)
        print(f"max-model-len: {n} ({why})", file=sys.stderr)
        return 0
    if len(argv) >= 2 and argv[0] == "plan":
        # the layout comes from the environment so that the overrides stay the recipe's own words
        print(plan(argv[1], argv[2:], tensor_parallel_size=int(os.environ.get("ATOMMEM_VLLM_TP", "1")),
                   port=int(os.environ.get("ATOMMEM_VLLM_PORT", "8000")),
                   model=os.environ.get("ATOMMEM_VLLM_MODEL") or str(raw_value(argv[1], "model_name_or_path", argv[2:]))))
        return 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
