"""The one-GPU check behind ``scripts/gpu_check.sh``: rollout and policy-update throughput of a
Qwen3-shaped random-weight model in bf16, with model FLOP utilisation (MFU), in under 10 minutes.

It needs only torch and transformers (the GPU image has both; TRL, Chroma and vLLM are absent there
unless carried as wheels), so it measures the *compute shapes* of the training loop rather than the
full trainer (which needs Chroma for the memory environment and TRL for its loss):

1. ``rollout_hf``: Hugging Face ``generate`` on ``--rollout-batch`` random prompts of
   ``--prompt-len`` tokens, ``--new-tokens`` new tokens each (end-of-sequence ignored, so every row
   generates the same number of tokens); completion tokens/s.
2. ``rollout_vllm`` (only where ``import vllm`` works): the same prompts through vLLM's offline
   engine colocated in this process (``gpu_memory_utilization=--vllm-mem``, weights loaded as
   ``dummy`` and then copied from the training model, as TRL's colocate mode syncs them);
   completion tokens/s and the speedup over HF.
3. ``sft``: ``--steps`` optimizer steps (AdamW) of next-token cross-entropy on ``--batch`` rows of
   ``--seq-len`` tokens (full rows: a packed batch without padding), gradient checkpointing,
   liger-kernel's fused Qwen3 kernels where ``liger_kernel`` imports; tokens/s and MFU.
4. ``grpo``: ``--steps`` GRPO steps: a rollout (vLLM when it ran, else HF generate) of G =
   ``--group`` completions for each of ``rollout_batch / G`` prompts, rewards, group-relative
   advantages (Dr. GRPO: no std division), then the clipped-ratio policy loss on completion tokens
   only (prompt tokens masked), in micro-batches of ``--micro-batch`` rows; rollout tokens/s, update
   tokens/s (prompt + completion tokens through forward and backward) and MFU.

MFU = model FLOPs per second / peak, model FLOPs per token = 6 N (N: parameters of the matrix
multiplies, the output projection included, the embedding lookup not) + 6 L S d_attn for causal
attention over S tokens (forward + backward; recomputation by gradient checkpointing not counted).
Peak: ``--peak-tflops`` (default 989.5, the H200's dense bf16 figure; DESIGN.md section 5 measured
about 790-799 TFLOP/s for a plain matmul, also reported as ``mfu_vs_matmul``). On CPU no peak is
assumed unless given.

    bash scripts/gpu_check.sh                         # one GPU, Qwen3-8B shape
    bash scripts/gpu_check.sh --shape qwen3-1.7b      # smaller
    bash scripts/gpu_check.sh --device cpu --tiny     # the logic on CPU in seconds (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from ..commands import at_most, fraction, positive_float
from .gpu_check_flops import (H200_BF16_PEAK_TFLOPS, H200_MATMUL_TFLOPS, SHAPES, _mfu, matmul_params,  # noqa: F401
                              train_flops_per_token)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--tiny", action="store_true", help="tiny shape and small sizes (the CPU logic check)")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on cuda) or float32 (default on cpu)")
    p.add_argument("--seq-len", type=at_most(10**6), default=4096, help="SFT tokens per row (default 4096)")
    p.add_argument("--batch", type=at_most(10**4), default=4, help="SFT rows per step (default 4)")
    p.add_argument("--steps", type=at_most(10**4), default=3, help="measured SFT and GRPO steps each (default 3)")
    p.add_argument("--warmup", type=at_most(10**4, 0), default=1, help="unmeasured SFT steps first (default 1)")
    p.add_argument("--prompt-len", type=at_most(10**6), default=1024)
    p.add_argument("--new-tokens", type=at_most(10**6), default=256)
    p.add_argument("--rollout-batch", type=at_most(10**5), default=64, help="completions per rollout (default 64)")
    p.add_argument("--group", type=at_most(10**4), default=16, help="GRPO group size G (default 16)")
    p.add_argument("--micro-batch", type=at_most(10**4), default=4, help="GRPO update rows per forward/backward (default 4)")
    p.add_argument("--no-liger", action="store_true", help="do not use liger-kernel even where it imports")
    p.add_argument("--no-vllm", action="store_true", help="do not use vLLM even where it imports")
    p.add_argument("--vllm-mem", type=fraction, default=0.3, help="vLLM gpu_memory_utilization (default 0.3)")
    p.add_argument("--peak-tflops", type=positive_float, default=None, help="peak for MFU (default: H200 bf16 on cuda)")
    p.add_argument("--json-out", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.tiny:
        args.shape = "tiny"
        args.seq_len, args.batch, args.prompt_len, args.new_tokens = 64, 2, 16, 8
        args.rollout_batch, args.group, args.micro_batch, args.steps = 4, 2, 2, 2
    for k in ("seq_len", "batch", "steps", "prompt_len", "new_tokens", "rollout_batch", "group", "micro_batch"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be at least 1")
    if args.rollout_batch % args.group:
        p.error("--rollout-batch must be a multiple of --group")
    if args.device.startswith("cuda"):
        args.dtype = args.dtype or "bfloat16"
        args.peak_tflops = args.peak_tflops or H200_BF16_PEAK_TFLOPS
    else:
        args.dtype = args.dtype or "float32"
    return args


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_model(args):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    liger = False
    if not args.no_liger and args.device.startswith("cuda"):
        try:  # fused RMSNorm, SwiGLU, RoPE and linear+cross-entropy (no full logits in memory)
            from liger_kernel.transformers import apply_liger_kernel_to_qwen3

            apply_liger_kernel_to_qwen3()
            liger = True
        except ImportError:
            pass
    cfg = Qwen3Config(**SHAPES[args.shape], max_position_embeddings=max(args.seq_len, args.prompt_len + args.new_tokens) * 2,
                      use_cache=True)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model, cfg, liger


def _opt(model, device):
    import torch

    fused = device.startswith("cuda")
    return torch.optim.AdamW(model.parameters(), lr=1e-6, fused=fused)


def rollout_hf(model, prompts, new_tokens: int, device: str) -> tuple[list, float]:
    """Generate ``new_tokens`` for every prompt (rows: token id lists of equal length)."""
    import torch

    model.eval()
    ids = torch.tensor(prompts, device=device)
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             pad_token_id=0, eos_token_id=None)
    _sync(device)
    dt = time.perf_counter() - t0
    return out[:, ids.shape[1]:].tolist(), dt


def make_vllm(args, model, cfg):
    """vLLM colocated in this process with dummy weights, then the training model's weights copied in."""
    import tempfile

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process (TRL colocate)
    from vllm import LLM

    folder = tempfile.mkdtemp(prefix="gpu_check_cfg_")
    cfg.architectures = ["Qwen3ForCausalLM"]  # without it vLLM guesses a pooling model
    cfg.save_pretrained(folder)
    placeholder_tokenizer(cfg.vocab_size).save_pretrained(folder)
    t0 = time.perf_counter()
    llm = LLM(model=folder, load_format="dummy", dtype=args.dtype,
              gpu_memory_utilization=args.vllm_mem, max_model_len=args.prompt_len + args.new_tokens + 16,
              seed=0, enable_prefix_caching=False)
    start_s = time.perf_counter() - t0
    sync_s = sync_vllm_weights(llm, model)
    return llm, start_s, sync_s


def placeholder_tokenizer(vocab_size: int):
    """A word-level tokenizer over token names t0..tN: vLLM's LLM wants a tokenizer in the model
    folder (its pooling front-ends ask for one even with skip_tokenizer_init), and no network is
    there to fetch Qwen3's; prompts go in as token ids anyway."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t1")


def sync_vllm_weights(llm, model) -> float | None:
    """Copy the training weights into the colocated engine (as TRL does); None where this vLLM has no
    in-process model to reload (then vLLM samples from its dummy weights: the same shapes and cost)."""
    t0 = time.perf_counter()
    driver = getattr(getattr(llm.llm_engine, "model_executor", None), "driver_worker", None)
    # TRL reaches driver_worker.model_runner; the uni-process executor wraps the worker once more
    runner = getattr(driver, "model_runner", None) or getattr(getattr(driver, "worker", None), "model_runner", None)
    if runner is None:
        return None
    try:
        for name, param in model.named_parameters():  # one tensor at a time, as TRL's colocate sync
            runner.model.load_weights([(name, param.data)])
    except AttributeError:  # the CPU build repacks its weights after loading: no in-place reload
        return None
    _sync("cuda" if next(model.parameters()).is_cuda else "cpu")
    return time.perf_counter() - t0


def rollout_vllm(llm, prompts, new_tokens: int) -> tuple[list, float]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, temperature=1.0, seed=0)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return [list(o.outputs[0].token_ids) for o in outs], dt


def sft_steps(args, model, cfg) -> dict:
    import torch

    model.train()
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    opt = _opt(model, args.device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    times = []
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=gen).to(args.device)
        _sync(args.device)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(args.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    del opt
    step_s = statistics.median(times)
    tokens = args.batch * args.seq_len
    return {"step_s": step_s, "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
            "flops_per_token": train_flops_per_token(cfg, args.seq_len), "loss": float(loss.detach())}


def grpo_update(args, model, opt, prompts, completions, rewards) -> tuple[float, int]:
    """One GRPO update: group-relative advantages, clipped-ratio loss on completion tokens only."""
    import torch

    g = args.group
    r = torch.tensor(rewards, dtype=torch.float32).view(-1, g)
    adv = (r - r.mean(dim=1, keepdim=True)).view(-1)  # Dr. GRPO: no division by the group std
    seqs = torch.tensor([p + c for p, c in zip(prompts, completions)])
    plen = len(prompts[0])
    model.train()
    _sync(args.device)
    t0 = time.perf_counter()
    n_tok = sum(len(c) for c in completions)
    for i in range(0, len(seqs), args.micro_batch):
        ids = seqs[i:i + args.micro_batch].to(args.device)
        a = adv[i:i + args.micro_batch].to(args.device)
        logits = model(input_ids=ids).logits[:, plen - 1:-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, plen:, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())  # one iteration per rollout: old policy = current
        per_tok = -torch.min(ratio * a[:, None], torch.clamp(ratio, 0.8, 1.28) * a[:, None])
        (per_tok.sum() / n_tok).backward()  # "dapo" normalisation: every completion token weighs the same
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(args.device)
    return time.perf_counter() - t0, seqs.numel()


def grpo_steps(args, model, cfg, llm=None) -> dict:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(2)
    opt = _opt(model, args.device)
    model.gradient_checkpointing_enable()
    roll, upd, upd_tokens, comp_tokens = [], [], 0, 0
    for _ in range(args.steps):
        base = torch.randint(0, cfg.vocab_size, (args.rollout_batch // args.group, args.prompt_len), generator=gen)
        prompts = base.repeat_interleave(args.group, dim=0).tolist()  # G completions per prompt
        model.config.use_cache = True
        if llm is not None:
            completions, dt = rollout_vllm(llm, prompts, args.new_tokens)
        else:
            completions, dt = rollout_hf(model, prompts, args.new_tokens, args.device)
        roll.append(dt)
        model.config.use_cache = False
        # a stand-in reward with spread inside each group: the share of even token ids
        rewards = [sum(1 for t in c if t % 2 == 0) / max(1, len(c)) for c in completions]
        dt, n = grpo_update(args, model, opt, prompts, completions, rewards)
        upd.append(dt)
        upd_tokens = n
        comp_tokens = sum(len(c) for c in completions)
        if llm is not None:
            sync_vllm_weights(llm, model)
    del opt
    roll_s, upd_s = statistics.median(roll), statistics.median(upd)
    return {"rollout_backend": "vllm" if llm is not None else "hf", "rollout_s": roll_s,
            "rollout_tokens_per_s": comp_tokens / roll_s, "update_s": upd_s, "update_tokens_per_step": upd_tokens,
            "update_tokens_per_s": upd_tokens / upd_s, "completion_tokens_per_step": comp_tokens,
            "flops_per_token": train_flops_per_token(cfg, args.prompt_len + args.new_tokens)}


def run(args) -> dict:
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda but torch sees no GPU (use --device cpu --tiny for the CPU check)")
    t_all = time.perf_counter()
    model, cfg, liger = build_model(args)
    res: dict = {"device": args.device, "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                 "shape": args.shape, "dtype": args.dtype, "params": sum(p.numel() for p in model.parameters()),
                 "liger_kernel": liger, "torch": torch.__version__, "peak_tflops": args.peak_tflops}
    import transformers

    res["transformers"] = transformers.__version__
    gen = torch.Generator(device="cpu").manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (args.rollout_batch, args.prompt_len), generator=gen).tolist()

    rollout_hf(model, prompts[:1], 2, args.device)  # warm-up
    comp, dt = rollout_hf(model, prompts, args.new_tokens, args.device)
    res["rollout_hf"] = {"seconds": dt, "completion_tokens": sum(map(len, comp)),
                         "tokens_per_s": sum(map(len, comp)) / dt}

    llm = None
    vllm_ok = False
    if not args.no_vllm:
        try:
            import vllm  # noqa: F401

            vllm_ok = True
        except Exception as exc:  # not installed, or a build that does not load here
            res["vllm"] = f"not used: {type(exc).__name__}: {exc}"[:200]
    if vllm_ok:
        llm, start_s, sync_s = make_vllm(args, model, cfg)
        rollout_vllm(llm, prompts[:1], 2)  # warm-up
        comp, dt = rollout_vllm(llm, prompts, args.new_tokens)
        res["rollout_vllm"] = {"seconds": dt, "completion_tokens": sum(map(len, comp)),
                               "tokens_per_s": sum(map(len, comp)) / dt, "engine_start_s": start_s,
                               "weight_sync_s": sync_s}
        res["vllm_speedup"] = res["rollout_vllm"]["tokens_per_s"] / res["rollout_hf"]["tokens_per_s"]

    res["sft"] = sft_steps(args, model, cfg)
    res["sft"]["mfu"] = _mfu(res["sft"]["tokens_per_s"], res["sft"]["flops_per_token"], args.peak_tflops)
    res["grpo"] = grpo_steps(args, model, cfg, llm)
    res["grpo"]["mfu"] = _mfu(res["grpo"]["update_tokens_per_s"], res["grpo"]["flops_per_token"], args.peak_tflops)
    if args.device.startswith("cuda"):
        res["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
        for k in ("sft", "grpo"):
            m = res[k]["mfu"]
            res[k]["mfu_vs_matmul"] = None if m is None else m * args.peak_tflops / H200_MATMUL_TFLOPS
    res["total_s"] = time.perf_counter() - t_all
    return res


def table(res: dict) -> str:
    def f(x, nd=1):
        return "-" if x is None else (f"{x:,.{nd}f}" if isinstance(x, float) else str(x))

    rows = [("rollout HF generate", f(res["rollout_hf"]["tokens_per_s"]), "completion tokens/s", "")]
    if "rollout_vllm" in res:
        rows.append(("rollout vLLM colocated", f(res["rollout_vllm"]["tokens_per_s"]), "completion tokens/s",
                     f"{res['vllm_speedup']:.2f}x HF"))
    rows.append(("SFT update", f(res["sft"]["tokens_per_s"]), "tokens/s", f"MFU {f(res['sft']['mfu'], 3)}"))
    g = res["grpo"]
    rows.append((f"GRPO rollout ({g['rollout_backend']})", f(g["rollout_tokens_per_s"]), "completion tokens/s", ""))
    rows.append(("GRPO update", f(g["update_tokens_per_s"]), "tokens/s", f"MFU {f(g['mfu'], 3)}"))
    head = (f"gpu_check: {res['shape']} ({res['params'] / 1e9:.2f} B params, {res['dtype']}) on "
            f"{res['gpu'] or res['device']}; liger-kernel {'on' if res['liger_kernel'] else 'off'}; "
            f"total {res['total_s']:.0f} s")
    w = max(len(r[0]) for r in rows)
    lines = [head, f"{'phase':<{w}}  {'rate':>12}  {'unit':<20}  note"]
    lines += [f"{a:<{w}}  {b:>12}  {c:<20}  {d}" for a, b, c, d in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    res = run(args)
    text = json.dumps(res, indent=2, default=str)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            fh.write(text)
    print(text)
    print(table(res))
    return 0


if __name__ == "__main__":  # vLLM may spawn workers: keep the work under this guard
    sys.exit(main())
