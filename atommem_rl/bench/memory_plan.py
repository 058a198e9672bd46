"""``atommem bench memory-plan``: the peak memory per training GPU of a recipe's update, traced, with what CUDA adds.

What. For a recipe and a cluster shape, the peak memory of one training GPU during a policy update at the
recipe's token budget (``max_tokens_per_microbatch``; ``--tokens`` when the recipe sets none), by component,
whether it fits ``--gpu-memory`` with ``--margin`` kept free, and the largest budget that fits; beside it
the same for TRL's padded rows (``--rows`` x ``--row-tokens``, default the largest micro-batch measured on
real 200-document prompts: 13 rows of 6,580 + 2,048 tokens, docs/BENCHMARKS.md); for a PPO recipe, the
critic's chunk too. Trainers per GPU group as ``slurm/grpo.sbatch`` splits the node: one node serves vLLM
on 2 GPUs and trains on the rest; N nodes serve vLLM on the first and train on N-1 full nodes.

Method (``memory_trace.py``). Each update is *traced*, not computed: the model (transformers' Qwen3 with
Qwen3-8B's configuration) is built on fake CPU tensors, sharded as accelerate's FSDP2 does over a fake
group of that many ranks, and two micro-steps (forward, backward with the recipe's gradient checkpointing,
AdamW step; the gradients kept between them as gradient accumulation keeps them) run through the
project's packed forward or TRL's padded one under torch's ``FSDPMemTracker``; micro-step 2's peak is
reported. Where the recipe accumulates gradients without accelerate's ``sync_each_batch`` (``accumulation:
no_sync``), a third micro-step runs under FSDP2's ``no_sync`` first, so the peak includes the unsharded
gradients it holds (about 15.3 GiB for Qwen3-8B in bf16). Tracing all 36 layers would take minutes per point, so ``--layers`` (1, 2, 4) are traced and
each component is fitted linearly in the layer count; the fit's largest relative error at the traced
points (``linearity_error``) is printed, and the 36-layer figure is the fit's. The largest budget is
searched by tracing 2x and 4x the budget with the first two ``--layers`` (peak is piecewise-linear in
tokens between traced points, extrapolated from the last two beyond them).

What differs on CUDA, added as stated terms (``cuda_terms``): the caching allocator's rounding (512 B
blocks, 2 MiB segments) and fragmentation, ``--allocator-margin`` (10%) of the traced peak; the CUDA
context and NCCL buffers, ``--context-gib`` (1.5 GiB); the attention kernel's workspace, FA3's tree kernel
(or SDPA's memory-efficient kernel for padded rows) backward accumulators, fp32 dq/dk/dv at the query-head
count: 3 x tokens x heads x head_dim x 4 bytes. The trace is on CPU and so keeps two CPU-only costs that a
GPU does not pay (both make the plan conservative): the CPU tree attention's gathered key/value paths
and SDPA temporaries, and TRL's LM-head fold in torch ops (whole fp32 tiles) where CUDA runs it in Triton;
and off Triton TRL's fused head scores every position, on CUDA only the trained ones.

    atommem bench memory-plan --recipe recipes/qwen3_8b/grpo.yaml --json
    atommem bench memory-plan --recipe recipes/qwen3_8b/ppo.yaml --gpus-per-node 8 --gpu-memory 80GiB --json
    atommem bench memory-plan --recipe R --layers 1,2 --no-search --json      # faster, no budget search
    atommem bench memory-plan --validate checkpoints/base/smollm2-135m-instruct --json   # tracker vs RSS
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from ..commands import at_most, nonneg_float

GIB = 2 ** 30
FULL_LAYERS = 36  # Qwen3-8B


def gib_size(text: str) -> int:
    """``80GiB``, ``80GB`` (read as GiB, as GPU vendors mean it), ``141G`` or a number of bytes -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(GiB|GB|G)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 80GiB, got {text!r}")
    value = float(m.group(1)) * (GIB if m.group(2) else 1)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return int(value)


def layer_list(text: str) -> list[int]:
    try:
        layers = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts like 1,2,4, got {text!r}") from None
    if len(layers) < 2 or layers[0] < 1 or layers[-1] > 12:
        raise argparse.ArgumentTypeError(f"expected at least two layer counts in 1..12, got {text!r}")
    return layers


def layer_list_tokens(text: str) -> list[int]:
    try:
        tokens = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not tokens or tokens[0] < 256 or tokens[-1] > 10 ** 6:
        raise argparse.ArgumentTypeError(f"expected token counts in 256..1000000, got {text!r}")
    return tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default="recipes/qwen3_8b/grpo.yaml",
                        help="recipe YAML (default the Qwen3-8B GRPO one)")
    parser.add_argument("--gpus-per-node", type=at_most(64), default=8)
    parser.add_argument("--nodes", type=at_most(1024), default=1, help="nodes of the job (default 1)")
    parser.add_argument("--gpu-memory", type=gib_size, default=80 * GIB, help="memory of one GPU (default 80GiB)")
    parser.add_argument("--tokens", type=at_most(10 ** 7, 2), default=16384,
                        help="token budget when the recipe sets no max_tokens_per_microbatch (default 16384)")
    parser.add_argument("--rows", type=at_most(4096), default=13, help="padded path: rows per forward (default 13)")
    parser.add_argument("--row-tokens", type=at_most(10 ** 6, 2), default=6580 + 2048,
                        help="padded path: tokens per row, prompt + completion (default 8628)")
    parser.add_argument("--layers", type=layer_list, default=[1, 2, 4], help="layer counts traced (default 1,2,4)")
    parser.add_argument("--margin", type=nonneg_float, default=0.10,
                        help="fraction of GPU memory kept free beyond the CUDA terms (default 0.10)")
    parser.add_argument("--allocator-margin", type=nonneg_float, default=0.10,
                        help="caching-allocator rounding and fragmentation, fraction of the traced peak (default 0.10)")
    parser.add_argument("--context-gib", type=nonneg_float, default=1.5,
                        help="CUDA context + NCCL buffers, GiB (default 1.5)")
    parser.add_argument("--accumulation", choices=("recipe", "sync", "no_sync"), default="recipe",
                        help="gradient accumulation traced: no_sync holds unsharded gradients until a window's last "
                             "micro-step (the Trainer's default), sync reduces every backward (accelerate's "
                             "sync_each_batch); default: what the recipe sets")
    parser.add_argument("--no-search", action="store_true", help="skip the largest-budget search")
    parser.add_argument("--no-padded", action="store_true", help="skip the padded-row path")
    parser.add_argument("--validate", metavar="MODEL_DIR", default=None,
                        help="instead: the tracker against the peak RSS of real CPU steps of MODEL_DIR's model")
    parser.add_argument("--validate-tokens", type=layer_list_tokens, default=[4096, 8192, 16384],
                        help="packed tokens per micro-batch with --validate (default 4096,8192,16384)")
    parser.add_argument("--repeats", type=at_most(20), default=3, help="real runs per case with --validate (default 3)")
    parser.add_argument("--json", action="store_true")


def trainer_ranks(gpus_per_node: int, nodes: int) -> int:
    """Training processes of ``slurm/grpo.sbatch``: one node = GPUs - 2 (vLLM on 2), N nodes = (N-1) x GPUs."""
    if nodes <= 1:
        if gpus_per_node < 3:
            raise ValueError(f"one node needs >= 3 GPUs (2 for vLLM, 1+ to train), got {gpus_per_node}")
        return gpus_per_node - 2
    return (nodes - 1) * gpus_per_node


def fit_layers(traces: dict[int, dict], full_layers: int, key: str = "components") -> tuple[dict[str, int], float]:
    """Each component of ``traces[layers][key]`` fitted as a + b x layers (least squares); the components at
    ``full_layers`` and the fit's largest relative error at the traced points (of the total)."""
    xs = sorted(traces)
    names = list(traces[xs[0]][key])
    mean_x = sum(xs) / len(xs)
    var = sum((x - mean_x) ** 2 for x in xs)
    out, worst = {}, 0.0
    for name in names:
        ys = [traces[x][key][name] for x in xs]
        mean_y = sum(ys) / len(ys)
        b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
        a = mean_y - b * mean_x
        out[name] = int(a + b * full_layers)
        if name == "total":
            worst = max(abs(a + b * x - y) / max(y, 1) for x, y in zip(xs, ys, strict=True))
    return out, worst


def cuda_terms(traced_peak: int, tokens: int, config, args) -> dict[str, int]:
    """What a GPU adds to the traced peak (see the module docstring)."""
    return {"allocator_margin": int(args.allocator_margin * traced_peak),
            "cuda_context_nccl": int(args.context_gib * GIB),
            "attention_workspace": 3 * tokens * config.num_attention_heads * config.head_dim * 4}


def plan_side(kind: str, config, world: int, layers: list[int], args, accumulation: str = "sync", **batch) -> dict:
    """Trace ``kind`` at ``layers``, fit to the full depth, add the CUDA terms: one side of the plan."""
    from .memory_trace import qwen3_config, trace_step

    traces = {}
    for n in layers:
        traces[n] = trace_step(qwen3_config(n), kind, world=world, accumulation=accumulation, **batch)
    components, linearity = fit_layers(traces, config.num_hidden_layers)
    resident, _ = fit_layers(traces, config.num_hidden_layers, key="resident")
    tokens = traces[layers[0]]["forwarded_tokens"]
    cuda = cuda_terms(components["total"], tokens, config, args)
    return {"kind": kind, "tokens": tokens, "traced_layers": layers, "linearity_error": round(linearity, 4),
            "components_gib": {k: round(v / GIB, 3) for k, v in components.items()},
            "cuda_terms_gib": {k: round(v / GIB, 3) for k, v in cuda.items()},
            "resident_gib": round(resident["total"] / GIB, 3),
            "peak_gib": round((components["total"] + sum(cuda.values())) / GIB, 3),
            "_peak": components["total"] + sum(cuda.values()), "_resident": resident["total"]}


def largest_budget(config, world: int, budget: int, capacity: int, args, extra: int = 0,
                   accumulation: str = "sync") -> dict:
    """Largest packed token budget whose peak (+ ``extra``: a PPO critic's resident state) fits ``capacity``:
    peaks traced at 1x, 2x, 4x the budget (first two ``--layers``), piecewise-linear between them."""
    points = []
    for mult in (1, 2, 4):
        side = plan_side("packed", config, world, args.layers[:2], args, accumulation, tokens=budget * mult)
        points.append((side["tokens"], side["_peak"] + extra))
    fitting = [t for t, p in points if p <= capacity]
    for (t0, p0), (t1, p1) in zip(points, points[1:], strict=False):
        if p0 <= capacity < p1:  # crosses inside this segment
            return {"tokens": int(t0 + (capacity - p0) * (t1 - t0) / (p1 - p0)), "how": "interpolated",
                    "traced": [{"tokens": t, "peak_gib": round(p / GIB, 2)} for t, p in points]}
    if not fitting:
        return {"tokens": 0, "how": f"not even {points[0][0]} tokens fit",
                "traced": [{"tokens": t, "peak_gib": round(p / GIB, 2)} for t, p in points]}
    (t0, p0), (t1, p1) = points[-2], points[-1]
    slope = (p1 - p0) / (t1 - t0)
    return {"tokens": int(t1 + (capacity - p1) / slope) if slope > 0 else t1, "how": "extrapolated beyond the traced",
            "traced": [{"tokens": t, "peak_gib": round(p / GIB, 2)} for t, p in points]}


def _accumulation(data: dict, asked: str) -> str:
    """``no_sync`` when the recipe accumulates gradients over micro-steps without accelerate's
    ``sync_each_batch`` (the Trainer then runs all but a window's last micro-step under ``no_sync``), else
    ``sync``; ``asked`` (``--accumulation``) wins unless it is ``recipe``."""
    if asked != "recipe":
        return asked
    acc = data.get("accelerator_config") or {}
    if isinstance(acc, str):
        acc = json.loads(acc)
    each_batch = bool((acc.get("gradient_accumulation_kwargs") or {}).get("sync_each_batch", False))
    return "no_sync" if int(data.get("gradient_accumulation_steps", 1)) > 1 and not each_batch else "sync"


def _recipe(args) -> dict:
    from atommem_rl.training.launch import _field_default, stage
    from atommem_rl.training.recipes import read_yaml

    data = read_yaml(args.recipe)
    stage_name, _why = stage(args.recipe, env={})
    out = {"stage": stage_name, "budget": int(data.get("max_tokens_per_microbatch") or args.tokens),
           "budget_from": "recipe" if data.get("max_tokens_per_microbatch") else "--tokens",
           "gradient_checkpointing": bool(data.get("gradient_checkpointing", False)),
           "bf16": bool(data.get("bf16", False)), "completion": int(data.get("max_completion_length", 2048)),
           "accumulation": _accumulation(data, args.accumulation)}
    if stage_name == "ppo":
        from atommem_rl.training.ppo import PPORecipeConfig

        for key in ("critic_max_tokens", "critic_batch_size"):
            out[key] = int(data.get(key) or _field_default(PPORecipeConfig, key))
    return out


def run_plan(args) -> dict:
    from .memory_trace import qwen3_config

    recipe = _recipe(args)
    if not recipe["gradient_checkpointing"] or not recipe["bf16"]:
        raise ValueError(f"{args.recipe}: the plan traces bf16 FSDP2 with gradient checkpointing, as the Qwen3-8B "
                         "recipes set; this recipe sets gradient_checkpointing or bf16 off")
    world = trainer_ranks(args.gpus_per_node, args.nodes)
    config = qwen3_config()
    capacity = int(args.gpu_memory * (1 - args.margin))
    budget = recipe["budget"]
    accumulation = recipe["accumulation"]
    packed = plan_side("packed", config, world, args.layers, args, accumulation, tokens=budget,
                       completion=recipe["completion"])
    out = {"recipe": args.recipe, **recipe, "model": "Qwen3-8B (transformers Qwen3Config, 36 layers)",
           "trainer_gpus": world, "vllm_gpus": 2 if args.nodes <= 1 else args.gpus_per_node,
           "gpu_memory_gib": round(args.gpu_memory / GIB, 1), "margin": args.margin,
           "usable_gib": round(capacity / GIB, 2), "packed": packed}
    critic_resident = 0
    if recipe["stage"] == "ppo":
        rows = recipe["critic_batch_size"]
        critic = plan_side("critic", config, world, args.layers, args, rows=rows,
                           width=recipe["critic_max_tokens"] // rows)
        critic_resident = critic["_resident"]
        # two sharded models on every GPU: each update runs beside the other model's resident state
        packed["peak_with_critic_gib"] = round((packed["_peak"] + critic_resident) / GIB, 3)
        critic["peak_with_policy_gib"] = round((critic["_peak"] + packed["_resident"]) / GIB, 3)
        out["critic"] = critic
        out["peak_gib"] = max(packed["peak_with_critic_gib"], critic["peak_with_policy_gib"])
    else:
        out["peak_gib"] = packed["peak_gib"]
    out["fits"] = out["peak_gib"] * GIB <= capacity
    if not args.no_search:
        out["largest_budget"] = largest_budget(config, world, budget, capacity, args, extra=critic_resident,
                                               accumulation=accumulation)
    if not args.no_padded:
        padded = plan_side("padded", config, world, args.layers, args, accumulation, rows=args.rows,
                           width=args.row_tokens, completion=recipe["completion"])
        padded["peak_total_gib"] = round((padded["_peak"] + critic_resident) / GIB, 3)
        padded["fits"] = padded["_peak"] + critic_resident <= capacity
        out["padded"] = padded
    for side in ("packed", "critic", "padded"):
        for key in ("_peak", "_resident"):
            out.get(side, {}).pop(key, None)
    return out


def validation_cases(tokens: list[int]) -> list[tuple[str, int, dict]]:
    """--validate: (kind, ranks, batch) at sizes where the model's tensors dominate the process (SmolLM2-135M):
    packed on 1 rank at each of ``tokens``, padded rows (2048 wide) at the two smallest, packed on 2 ranks at
    the smallest."""
    cases = [("packed", 1, {"tokens": t, "completion": 1024}) for t in tokens]
    cases += [("padded", 1, {"rows": max(1, t // 2048), "width": 2048, "completion": 1024}) for t in tokens[:2]]
    return cases + [("packed", 2, {"tokens": tokens[0], "completion": 1024})]


def run_validation(model_dir: str, cases, repeats: int = 3) -> dict:
    """Predicted (tracker) against measured (peak RSS over baseline) for each case; prints each as it ends."""
    from pathlib import Path

    from .memory_trace import validate_case

    if not (Path(model_dir) / "config.json").is_file():
        raise ValueError(f"{model_dir}: no model folder (create the base model: .venv/bin/python "
                         "scripts/prepare_base_model.py)")
    rows = []
    for kind, ranks, batch in cases:
        row = validate_case(model_dir, kind, ranks, repeats, **batch)
        row["batch"] = batch
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    worst = max(abs(r["error"]) for r in rows)
    return {"model": model_dir, "repeats": repeats, "cases": rows, "max_abs_error": worst}


def main(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    start = time.time()
    try:
        if args.validate:
            out = run_validation(args.validate, validation_cases(args.validate_tokens), repeats=args.repeats)
        else:
            out = run_plan(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out["seconds"] = round(time.time() - start, 1)
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=2))
    return 0
