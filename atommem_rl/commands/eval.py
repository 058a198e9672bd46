r"""``atommem eval``: evaluate checkpoints and baselines under one protocol.

    atommem eval --tasks tasks/hotpotqa.jsonl tasks/locomo.jsonl \
        --methods oracle,heuristic,append_all,rag,full_context,mem0,memagent,roam,atommem \
        --model checkpoints/base/smollm2-135m-instruct --backend hf --out checkpoints/run/eval
    atommem eval --tasks synth=tasks/synth.jsonl --methods atommem --checkpoint checkpoints/run/grpo \
        --backend openai --base-url http://127.0.0.1:8000/v1 --model-name policy --out DIR

A task file may be named (``NAME=FILE``); otherwise its file name (without .jsonl) names the dataset.
Methods: oracle (gold evidence, the upper bound), heuristic (no gold, no LLM), append_all, rag,
full_context, mem0, memagent, roam, atommem (the --model prompted with the AtomMem tools), and one
``checkpoint:NAME`` per --checkpoint (a trained policy folder, LoRA adapters included). Every LLM
method uses the same reader model. Outputs in --out: metrics.json (schema in
atommem_rl/eval/metrics.py), report.md, PNG plots, trajectories.jsonl, viewer.html.
Evaluation trains nothing and gives gold fields to the oracle only.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..inference.hf_engine import AUTOCAST_MODES
from . import output_dir, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    from atommem_rl.eval.methods import ALL_METHODS, EvalSettings

    d = EvalSettings()
    p = sub.add_parser("eval", help="evaluate checkpoints and baselines; metrics.json, report, plots, viewer",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", required=True, help="task JSONL files (FILE or NAME=FILE)")
    p.add_argument("--methods", default=",".join(ALL_METHODS), help=f"comma-separated (default: {','.join(ALL_METHODS)})")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--model", default=None, help="reader/policy model folder (default: the quickstart base model)")
    p.add_argument("--checkpoint", action="append", default=[], help="trained checkpoint folder (repeatable): "
                   "method checkpoint:<folder name>")
    p.add_argument("--backend", choices=["hf", "vllm", "openai"], default="hf")
    p.add_argument("--extractor-model", default=None,
                   help="a separate model (same --backend) for the graph-memory pipeline's fact extraction, e.g. "
                        "checkpoints/extractor/sft; verification and answers stay with --model")
    p.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint for --backend openai")
    p.add_argument("--model-name", default=None, help="model name sent to the endpoint (openai)")
    p.add_argument("--limit", type=positive_int, default=None, help="tasks per file (the first N)")
    p.add_argument("--max-blocks", type=positive_int, default=None, help="keep the first N blocks of each task and the "
                   "questions answerable from them (same subset for every method; recorded)")
    p.add_argument("--autocast", choices=AUTOCAST_MODES, default="off",
                   help="--backend hf: generate in bf16 autocast (auto: where the device multiplies bf16 natively; "
                        "the numerics of a bf16 GRPO rollout); off (default): the weights' dtype as loaded")
    p.add_argument("--gen-batch-size", type=positive_int, default=8, help="prompts per Hugging Face generate call")
    p.add_argument("--resume", action="store_true", help="continue a killed run in --out: skip the (method, "
                   "dataset) pairs its records.partial.jsonl holds (same settings, tasks and models only)")
    p.add_argument("--policy-env", type=json.loads, default={}, metavar="JSON",
                   help="environment settings over the ones the checkpoint recorded (atommem_env.json beside "
                        "the weights, read from --model or the --checkpoint; envs.core.EnvConfig), e.g. "
                        "'{\"max_answer_steps\": 1, \"disable\": \"update,delete\"}': a policy is evaluated in the "
                        "environment it was trained in; the reward and the fields above stay the evaluation's")
    p.add_argument("--run-logs", default=None, help="a training run folder (trainer_state.json) for the ops plot")
    for f in ("seed", "retrieval_k", "embedder", "reader_max_new_tokens", "manager_max_new_tokens",
              "policy_max_new_tokens", "context_tokens", "rag_chunk_tokens", "mem0_k", "memagent_chunk_tokens",
              "memagent_memory_tokens", "roam_k", "roam_min_similarity", "chunk_tokens", "max_prompt_tokens",
              "batch_size", "viewer_tasks", "judge_url", "judge_model"):
        v = getattr(d, f)
        typ = type(v) if v is not None else (int if f == "context_tokens" else str)
        if f in FROM_CHECKPOINT:  # unset: the checkpoint's recorded value, else the default
            p.add_argument("--" + f.replace("_", "-"), type=typ, default=None,
                           help=f"(default: the checkpoint's training setting, else {v})")
            continue
        p.add_argument("--" + f.replace("_", "-"), type=typ, default=v, help=f"(default {v})")
    p.set_defaults(func=main)


# evaluation settings that are also environment settings: a checkpoint's recorded value is the default
FROM_CHECKPOINT = ("chunk_tokens", "max_prompt_tokens", "retrieval_k", "embedder")


def checkpoint_policy_env(args) -> tuple[dict, str | None]:
    """The policy environment of the evaluated checkpoint (recorded beside --model, else beside the
    --checkpoint folders, which must then agree) with --policy-env on top, and the file it came from.
    Fills the FROM_CHECKPOINT flags left unset; the reward and tokenizer stay the evaluation's."""
    from atommem_rl.eval.methods import EVAL_ENV_KEYS, EvalSettings
    from atommem_rl.training.checkpoint_env import check_overrides, env_file, read_env

    check_overrides({k: v for k, v in args.policy_env.items() if k not in EVAL_ENV_KEYS}
                    if isinstance(args.policy_env, dict) else args.policy_env)
    sources = [args.model] if args.model and read_env(args.model) else [c for c in args.checkpoint if read_env(c)]
    recorded = [read_env(c)["env"] for c in sources]
    if any(r != recorded[0] for r in recorded[1:]):
        raise ValueError(f"the checkpoints {', '.join(sources)} were trained in different environments: evaluate "
                         "them in separate runs (or give every setting that differs with --policy-env)")
    env = recorded[0] if recorded else {}
    for f in FROM_CHECKPOINT:
        if getattr(args, f) is None:
            setattr(args, f, env.get(f, getattr(EvalSettings(), f)))
    policy = {k: v for k, v in env.items() if k not in EVAL_ENV_KEYS and k not in ("judge_url", "judge_model")}
    return {**policy, **args.policy_env}, (str(env_file(sources[0])) if sources else None)


def checkpoint_names(paths: list[str]) -> dict[str, str]:
    """Each --checkpoint's method name: its folder name, or as many trailing path parts as it takes to
    tell it from the others (runA/grpo and runB/grpo -> runA/grpo, runB/grpo); the same path twice is
    an error, since one of the two would silently not be evaluated."""
    resolved = [Path(c).resolve().parts for c in paths]
    for i, p in enumerate(resolved):
        if p in resolved[:i]:
            raise ValueError(f"--checkpoint {paths[i]} is given twice")
    parts = dict(zip(paths, resolved))
    names = {}
    for c, p in parts.items():
        n = 1
        while n < len(p) and any(o != p and o[-n:] == p[-n:] for o in parts.values()):
            n += 1
        names[c] = "/".join(p[-n:])
    return names


def _datasets(specs: list[str], limit, max_blocks) -> tuple[dict, dict]:
    from atommem_rl.tasks.load import load_dataset

    out, files = {}, {}
    for spec in specs:
        name, _, path = spec.partition("=") if "=" in spec and not os.path.exists(spec) else ("", "", spec)
        name = name or Path(path).name.removesuffix(".jsonl")
        if name in out:
            raise ValueError(f"two task files name the dataset {name!r}: use NAME=FILE")
        out[name] = load_dataset(path, limit=limit, max_blocks=max_blocks)
        files[name] = str(path)
    return out, files


def main(args) -> int:
    from atommem_rl.inference.chat_backends import make_backend
    from atommem_rl.eval.harness import evaluate
    from atommem_rl.eval.methods import ALL_METHODS, LLM_METHODS, EvalSettings
    from atommem_rl.models import check_checkpoint
    from atommem_rl.training.checkpoints import check_model, check_model_or_default

    # every model is checked (weights intact, not only present) before the first method runs
    check = check_checkpoint if args.backend == "openai" else check_model
    output_dir(args.out, "--out")
    args.policy_env, env_source = checkpoint_policy_env(args)  # a misspelt setting fails before any loading
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    ckpts = {}
    names = checkpoint_names(args.checkpoint)
    for c in args.checkpoint:
        check(c)
        name = f"checkpoint:{names[c]}"
        ckpts[name] = (lambda c=c: make_backend(args.backend, c, base_url=args.base_url, model_name=args.model_name,
                                                batch_size=args.gen_batch_size, context_window=args.context_tokens,
                                                autocast=args.autocast))
        if name not in methods:
            methods.append(name)
    bad = [m for m in methods if m not in ALL_METHODS and m not in ckpts]
    if bad:
        raise ValueError(f"unknown method(s) {', '.join(bad)}; expected {', '.join(ALL_METHODS)} or checkpoint:NAME "
                         "(one per --checkpoint)")
    if args.backend != "openai" and (args.model or any(m in LLM_METHODS for m in methods)):
        # --model, or the default base model when a method will read with it (not for oracle/heuristic only)
        check_model_or_default(args.model)
    datasets, files = _datasets(args.tasks, args.limit, args.max_blocks)
    for name, ts in datasets.items() if "oracle" in methods else ():
        for t in ts:
            t.require_evidence(f"the oracle method (tasks from {files[name]}; leave it out of --methods)")
    fields = {f: getattr(args, f) for f in EvalSettings.__dataclass_fields__ if hasattr(args, f)}
    settings = EvalSettings(**fields)
    if args.extractor_model and args.backend != "openai":
        check(args.extractor_model)
    extractor = None if not args.extractor_model else (lambda: make_backend(
        args.backend, args.extractor_model, base_url=args.base_url, model_name=args.extractor_model,
        batch_size=args.gen_batch_size, context_window=args.context_tokens, autocast=args.autocast))
    factory = lambda: make_backend(args.backend, args.model, base_url=args.base_url, model_name=args.model_name,  # noqa: E731
                                   batch_size=args.gen_batch_size, context_window=args.context_tokens,
                                   autocast=args.autocast)
    extra = {"task_files": files, "limit": args.limit, "max_blocks": args.max_blocks, "backend": args.backend,
             "model": args.model or "checkpoints/base/smollm2-135m-instruct", "checkpoints": args.checkpoint,
             "gen_batch_size": args.gen_batch_size, "autocast": args.autocast, "extractor_model": args.extractor_model, "trains": False,
             "policy_env_file": env_source}
    metrics = evaluate(datasets, methods, args.out, settings=settings, backend_factory=factory, checkpoints=ckpts,
                       run_logs=args.run_logs, extra_settings=extra, extractor=extractor, resume=args.resume)
    summary = {m: {d: {"em": r["em"], "f1": r["f1"], "tokens_per_task": r["tokens_per_task"]} for d, r in by.items()}
               for m, by in metrics["results"].items()}
    print(json.dumps({"out": args.out, "results": summary}))
    return 0
