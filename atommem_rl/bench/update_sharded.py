"""``atommem bench update --ranks N``: the same update as ``bench/update.py``, sharded by FSDP2 over N CPU ranks.

Method. The step samples of ``bench update`` (one GRPO group, rolled out once in this process or read from
``--samples``) are dealt to the ranks by episode (episode e to rank e mod N), so ranks hold different numbers
of samples, as a real step does. Each rank runs accelerate's own FSDP2 preparation (``fully_shard`` per decoder
layer, the tail group, the root; recipes/accelerate/fsdp2_cpu.yaml, fp32) through the rehearsal switch
``ATOMMEM_REHEARSE_FSDP_ON_CPU=1`` (``training/fsdp_cpu.py``: accelerate enables FSDP only over accelerators),
then times, side by side in alternating rounds:

* ``rows``: TRL's padded rows (``--baseline-rows`` per forward, 0: all of a rank's samples in one);
* ``packed``: the trainer's prefix-shared packed micro-batches (``--max-tokens`` unique tokens each), only
  trained positions scored, TRL's fused LM head inside the sharded forward (``packing._sharded_logprobs``).

Every forward all-gathers parameters, so every rank runs as many forwards as the busiest (empty ones pad:
``packing.pad_microbatches``, as the trainer does), and gradients are reduce-scattered once per update (the
Trainer's accumulation: ``set_requires_gradient_sync`` on the last backward only). A round's time is the
slowest rank's (barriers before and after). Exactness: the two paths' reduced gradients (``full_tensor``) and
each rank's completion log-probabilities, fp32. Rank 0 prints one JSON object::

    {"ranks", "samples_per_rank", "microbatches_per_rank", "forwards_per_rank", "rows_s", "packed_s",
     "speedup", "max_logprob_diff", "grad_cosine", "forwarded_tokens", "raw_tokens", ...}

    atommem bench update --ranks 2 --json                 # SmolLM2-135M, 8 episodes, 2 gloo ranks
    atommem bench update --ranks 2 --tiny --repeats 2     # seconds: a random-weight tiny model
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "recipes" / "accelerate" / "fsdp2_cpu.yaml"


def run_sharded(args, model_path: str, samples_path: str) -> dict:
    """Launch ``args.ranks`` FSDP2 ranks over the samples in ``samples_path``; their figures (rank 0's line)."""
    accelerate = Path(sys.executable).with_name("accelerate")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        spec = {"model": model_path, "samples": samples_path, "out": out, "max_tokens": args.max_tokens,
                "baseline_rows": args.baseline_rows, "repeats": args.repeats, "lr": args.lr,
                "gradient_checkpointing": args.gradient_checkpointing == "on", "episodes": args.episodes}
        threads = max(1, (os.cpu_count() or 1) // args.ranks)  # one rank's share of the cores
        env = {**os.environ, "ATOMMEM_REHEARSE_FSDP_ON_CPU": "1", "OMP_NUM_THREADS": str(threads)}
        cmd = [str(accelerate), "launch", "--config_file", str(CONFIG), "--num_processes", str(args.ranks),
               "--main_process_port", str(port), "-m", "atommem_rl.bench.update_sharded", json.dumps(spec)]
        # the ranks' progress and errors go to our stderr line by line as they come (a round takes minutes;
        # stdout stays the JSON's)
        with subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace") as proc:
            for line in proc.stdout:
                sys.stderr.write(line)
                sys.stderr.flush()
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"bench update --ranks {args.ranks}: the ranks failed (exit {proc.returncode}; "
                               "their output is above)")
        with open(out) as f:
            return json.load(f)


def _deal(samples: list, episodes: list, episodes_per_group: int, rank: int, ranks: int) -> tuple[list, list]:
    """This rank's samples (episode e to rank e mod ``ranks``) and their (task, step) group ids."""
    from atommem_rl.training.packing import step_group_ids

    groups = step_group_ids(episodes, episodes_per_group)
    mine, ids, i = [], [], 0
    for e, steps in enumerate(episodes):
        for _ in steps:
            if e % ranks == rank:
                mine.append(samples[i])
                ids.append(groups[i])
            i += 1
    return mine, ids


def _worker(spec: dict) -> None:
    import time

    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.trainer.utils import add_fused_lm_head

    from atommem_rl.training import packing  # installs the rehearsal switch before the Accelerator exists

    from .update_paths import baseline_update, packed_update

    acc = Accelerator(cpu=True)  # gloo ranks (MULTI_CPU), which the switch turns into FSDP
    if not acc.is_fsdp2:
        raise RuntimeError(f"expected FSDP2 ranks, got {acc.distributed_type} (ATOMMEM_REHEARSE_FSDP_ON_CPU=1 and "
                           f"{CONFIG.name} select it)")
    rank, ranks = acc.process_index, acc.num_processes
    with open(spec["samples"]) as f:
        saved = json.load(f)
    samples, groups = _deal([tuple(s) for s in saved["samples"]], saved["episodes"], spec["episodes"], rank, ranks)
    tok = AutoTokenizer.from_pretrained(spec["model"])
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    add_fused_lm_head(model, outputs=("log_probs",))
    if spec["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # these models have no dropout: the same function as eval mode
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"])  # FSDP2 prepares model and optimizer together
    model, optimizer = acc.prepare(model, optimizer)
    forwards = [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))

    def most(n: int) -> int:  # the busiest rank's count: every rank runs that many gathering forwards
        t = torch.tensor([n])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    budget, rows = spec["max_tokens"], spec["baseline_rows"]
    planned = len(packing.plan_microbatches(packing.tree_samples(samples, groups), budget))
    count = most(planned)
    row_forwards = most(-(-len(samples) // rows) if rows else 1)

    def backward(loss, last):  # the Trainer's accumulation: reduce-scatter on the last backward only
        model.set_requires_gradient_sync(last)
        loss.backward()

    def run(variant: str):
        if variant == "rows":
            return baseline_update(model, samples, pad_id, rows, forwards=row_forwards, backward=backward)
        return packed_update(model, samples, groups, budget, pad_id, count=count, backward=backward)

    def reduced_grads() -> torch.Tensor:
        g = torch.cat([(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).flatten()
                       for p in model.parameters() if p.requires_grad]).double()
        model.zero_grad(set_to_none=True)
        return g

    # exactness in fp32 (also the warm-up of both paths), then the forwards each path runs
    forwards[0] = 0
    lp_rows, _ = run("rows")
    rows_forwards, forwards[0] = forwards[0], 0
    g_rows = reduced_grads()
    lp_packed, _, forwarded = run("packed")
    packed_forwards = forwards[0]
    g_packed = reduced_grads()
    diff = torch.tensor([max((abs(a - b) for x, y in zip(lp_rows, lp_packed, strict=True)
                              for a, b in zip(x, y, strict=True)), default=0.0)])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    cosine = (torch.dot(g_rows, g_packed) / (g_rows.norm() * g_packed.norm())).item()
    times: dict[str, list[float]] = {"rows": [], "packed": []}
    for r in range(spec["repeats"]):
        for v in times:  # alternating: each round runs both, in turn
            dist.barrier()
            t = time.perf_counter()
            run(v)
            dist.barrier()  # the round ends when the slowest rank is done
            times[v].append(time.perf_counter() - t)
            model.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"bench update --ranks {ranks}: round {r + 1}/{spec['repeats']}: rows {times['rows'][-1]:.2f} s, "
                  f"packed {times['packed'][-1]:.2f} s", file=sys.stderr, flush=True)
    per_rank = [None] * ranks
    mine = {"samples": len(samples), "planned": planned, "rows_forwards": rows_forwards,
            "packed_forwards": packed_forwards, "forwarded": forwarded,
            "raw": sum(len(s[0]) + len(s[1]) for s in samples)}
    dist.all_gather_object(per_rank, mine)
    if rank == 0:
        med = {v: statistics.median(ts) for v, ts in times.items()}
        out = {"ranks": ranks, "mode": "fsdp2", "samples_per_rank": [p["samples"] for p in per_rank],
               "microbatches_per_rank": [p["planned"] for p in per_rank], "microbatches_run": count,
               "forwards_per_rank": {"rows": [p["rows_forwards"] for p in per_rank],
                                     "packed": [p["packed_forwards"] for p in per_rank]},
               "rows_s": round(med["rows"], 3), "packed_s": round(med["packed"], 3),
               "speedup": round(med["rows"] / med["packed"], 2), "max_logprob_diff": diff.item(),
               "grad_cosine": cosine, "raw_tokens": sum(p["raw"] for p in per_rank),
               "forwarded_tokens": sum(p["forwarded"] for p in per_rank), "max_tokens_per_microbatch": budget,
               "baseline_rows": rows, "repeats": spec["repeats"], "dtype": "float32",
               "gradient_checkpointing": spec["gradient_checkpointing"], "torch_threads": torch.get_num_threads(),
               "runs_s": {v: [round(t, 3) for t in ts] for v, ts in times.items()}}
        with open(spec["out"], "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
