r"""``atommem rollout``: run a policy on tasks, write trajectories (JSONL), print a JSON summary.

    atommem rollout --tasks tasks/synth.jsonl --policy oracle --out runs/oracle.jsonl
    atommem rollout --tasks tasks/roam.jsonl --policy oracle --policy-kwargs '{"supersede": "update"}' \
        --disable relations --retrieval-k 3 --out runs/update.jsonl
    atommem rollout --tasks tasks/hotpotqa.jsonl --policy model --model checkpoints/base/model \
        --backend hf --out runs/base.jsonl

Printed (DESIGN.md section 4; em and f1 in 0-1): {"episodes", "policy", "mean_reward", "em", "f1",
"crashes", "tool_errors", "ops": {create, read, update, delete, relate, scratchpad, answer},
"tokens": {prompt, completion}} plus evidence_recall, relation_accuracy, confounder_token_share,
truncated, and the store-outage counts store_failures, retried, skipped. Every environment option
of ``envs.core.EnvConfig`` is a flag here; a flag left unset takes the value the --model checkpoint
was trained with (its atommem_env.json), else the environment's default.

With ``--chroma http://127.0.0.1:8000`` the episodes' memories live on a ``chroma run`` server.
If it goes away mid-run, the affected episodes fail with an error naming the server and the
operation, are retried from the start (``--retries``, backoff ``--retry-backoff`` seconds doubling
per attempt) once it answers again, or are skipped; the run continues. Exit status 1 when an
episode crashed or was skipped (trajectories and summary are written either way).
"""

from __future__ import annotations

import argparse
import json
import sys

from . import input_file, nonneg_float, nonneg_int, output_file, positive_int, seed_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rollout", help="run episodes with a policy and summarise them",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", required=True, help="task JSONL (atommem data synth|prepare)")
    p.add_argument("--policy", required=True, choices=["oracle", "heuristic", "random", "fuzz", "model"])
    p.add_argument("--out", required=True, help="trajectory JSONL to write")
    p.add_argument("--limit", type=positive_int, default=None, help="run at most this many tasks")
    p.add_argument("--batch-size", type=positive_int, default=8, help="episodes stepped together (one generation call)")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--no-prompts", action="store_true", help="do not store prompts and memory in trajectories")
    p.add_argument("--policy-kwargs", default=None, metavar="JSON",
                   help='keywords for a scripted policy\'s constructor, e.g. \'{"supersede": "update"}\' for the '
                        'oracle that rewrites with update_memory instead of labelling conflicts')
    c = p.add_argument_group("memory backend and store outages")
    c.add_argument("--chroma", default=None, metavar="URL",
                   help="a chroma run server, http://HOST:PORT (default: in-memory Chroma in this process)")
    c.add_argument("--retries", type=nonneg_int, default=3, help="retries of an episode hit by a store outage, then skip")
    c.add_argument("--retry-backoff", type=nonneg_float, default=2.0, help="seconds before the first retry (doubles, max 30)")
    c.add_argument("--keep-memory", action="store_true",
                   help="keep each episode's namespace in Chroma (named in its trajectory) instead of dropping it")
    add_env_arguments(p.add_argument_group("environment (envs.core.EnvConfig)"))
    m = p.add_argument_group("model policy")
    m.add_argument("--model", default=None, help="model path (default: the quickstart base model)")
    m.add_argument("--backend", choices=["hf", "vllm", "openai"], default="hf")
    m.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint for --backend openai")
    m.add_argument("--max-new-tokens", type=positive_int, default=256)
    m.add_argument("--temperature", type=nonneg_float, default=0.0)
    p.set_defaults(func=main)


# EnvConfig fields that hold objects, not flag values (--chroma makes the client)
_NOT_FLAGS = ("client", "parser")


def _env_fields():
    from dataclasses import fields

    from envs.core import EnvConfig

    return [f for f in fields(EnvConfig) if f.name not in _NOT_FLAGS]


GIVEN = "_env_flags_given"  # the namespace attribute naming the environment flags the user gave


def _note_given(namespace, dest: str) -> None:
    if not hasattr(namespace, GIVEN):
        setattr(namespace, GIVEN, set())
    getattr(namespace, GIVEN).add(dest)


class _Given(argparse.Action):
    """Store the value and note the flag as given: a flag left out takes the checkpoint's recorded
    setting, else its default (which the namespace still holds, as before)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        _note_given(namespace, self.dest)


class _GivenBool(argparse.BooleanOptionalAction):
    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        _note_given(namespace, self.dest)


def add_env_arguments(group) -> None:
    """One flag per EnvConfig field (``max_answer_steps`` -> ``--max-answer-steps``), with its default,
    help and choices, so that a new environment option is a flag here without further code; the flags
    given are noted (``GIVEN``) so that a checkpoint's recorded environment fills the others."""
    for f in _env_fields():
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        helptext = f"{f.metadata['help']} (default: the checkpoint's, else %(default)s)"
        if kind == "bool":
            group.add_argument(flag, action=_GivenBool, default=f.default, help=helptext)
            continue
        typ = float if kind == "float" else int if kind.startswith("int") else str
        default = ",".join(f.default) if isinstance(f.default, tuple) else f.default
        group.add_argument(flag, type=typ, default=default, choices=f.metadata.get("choices"), action=_Given,
                           help=helptext)


def env_config_from_args(args, checkpoint: str | None = None) -> dict:
    """The flags given, over ``checkpoint``'s recorded environment (atommem_env.json), over the defaults."""
    from envs.core import EnvConfig

    from atommem_rl.training.checkpoint_env import policy_env

    cfg = {f.name: getattr(args, f.name) for f in _env_fields()}
    given = getattr(args, GIVEN, set())
    cfg.update({k: v for k, v in policy_env(checkpoint, {}).items() if k not in given})
    EnvConfig.from_kwargs(**cfg)  # validate before loading anything heavy
    return cfg


def main(args) -> int:
    from atommem_rl.rollout import make_policy, run_rollouts, summarize, write_jsonl
    from atommem_rl.tasks.schema import load_tasks

    cfg = env_config_from_args(args, args.model if args.policy == "model" else None)
    input_file(args.tasks, "--tasks")
    output_file(args.out, "--out")
    if args.policy == "model" and args.backend != "openai":
        from atommem_rl.training.checkpoints import check_model_or_default

        # --model, or the default base model: a truncated weights file is named here, not deep inside the loader
        check_model_or_default(args.model)
    tasks = load_tasks(args.tasks, limit=args.limit)
    if not tasks:
        raise ValueError(f"{args.tasks} holds no tasks")
    for t in tasks if args.policy == "oracle" else ():
        t.require_evidence(f"--policy oracle (tasks from {args.tasks})")
    if args.chroma:
        from atommem_rl.memory.chroma_clients import make_client, parse_url

        cfg["client"] = make_client(parse_url(args.chroma))  # unreachable: a clear error before any work
    kw = {}
    if args.policy in ("random", "fuzz"):
        kw["seed"] = args.seed
    if args.policy == "model":
        kw = {"model": args.model, "backend": args.backend, "base_url": args.base_url,
              "max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.policy_kwargs:
        if args.policy == "model":
            raise ValueError("--policy-kwargs: for scripted policies; the model policy takes its own flags")
        try:
            extra = json.loads(args.policy_kwargs)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--policy-kwargs: not JSON ({exc.msg})") from None
        if not isinstance(extra, dict):
            raise ValueError("--policy-kwargs: expected a JSON object, e.g. '{\"supersede\": \"update\"}'")
        kw.update(extra)
    try:
        policy = make_policy(args.policy, **kw)
    except TypeError as exc:  # an unknown keyword: the constructor's message names it
        if not args.policy_kwargs:
            raise
        raise ValueError(f"--policy-kwargs: {exc}") from None
    trajectories = run_rollouts(tasks, policy, cfg, batch_size=args.batch_size, seed=args.seed,
                                record_prompts=not args.no_prompts, retries=args.retries,
                                retry_backoff=args.retry_backoff, keep_memory=args.keep_memory)
    write_jsonl(trajectories, args.out)
    summary = summarize(trajectories, args.policy)
    print(json.dumps(summary))
    return 1 if summary["crashes"] or summary["skipped"] else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(argparse.ArgumentParser().parse_args()))
