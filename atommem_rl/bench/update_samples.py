"""The step samples ``atommem bench update`` times (``bench/update.py``): one GRPO group of one synthetic task.

:func:`rollout_samples` rolls the policy out in the learning-signal environment (``LEARNING_SIGNAL_ENV``)
with Hugging Face ``generate`` sampling and returns every step as a sample (prompt ids, completion ids)
with its episode's group-relative advantage (a fixed +-1 pattern when all returns are equal);
:func:`cached_samples` keeps them in a ``--samples`` JSON file, so a timing run that is killed does not
redo its rollout.
"""

from __future__ import annotations

import json
import os
import time

LEARNING_SIGNAL_ENV = {"chunk_tokens": 256, "max_prompt_tokens": 2048, "embedder": "hashing", "max_answer_steps": 1,
                       "disable": "update,delete,relations", "reward": "f1"}


class _SampledSteps:
    """Sampling policy that records each step's exact prompt and completion token ids per episode (Hugging Face
    ``generate`` through the inference layer's :class:`~atommem_rl.inference.hf_engine.HFEngine`, so the
    completion ids are cut at the end token as every other policy's)."""

    name = "sampled"

    def __init__(self, model, tok, max_new_tokens: int, temperature: float):
        from atommem_rl.inference.hf_engine import HFEngine

        self.engine, self.tok = HFEngine(model, tok), tok
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.steps: dict[int, list[tuple[list[int], list[int], None]]] = {}

    def start(self, key, task):
        self.steps[key] = []

    def end(self, key):
        pass

    def act(self, batch):
        from atommem_rl.inference.generation import encode_chat

        ids = [encode_chat(self.tok, obs)[0] for _, obs, _ in batch]
        done = self.engine.generate(ids, self.max_new_tokens, temperature=self.temperature)
        for (key, _, _), prompt, c in zip(batch, ids, done, strict=True):
            self.steps[key].append((prompt, c.token_ids, None))
        return [c.text for c in done]


def rollout_samples(model, tok, args) -> tuple[list[tuple], list[list[tuple]], str, list[float]]:
    """(step samples, episodes, advantage source, returns) of one GRPO group of one synthetic task."""
    import torch

    from atommem_rl.rollout import run_rollouts
    from atommem_rl.tasks.synth import generate_tasks
    from atommem_rl.training.grpo import group_advantages, step_samples

    (task,) = generate_tasks(1, seed=args.seed, docs=args.docs, questions=1, confounders=0)
    policy = _SampledSteps(model, tok, args.max_new_tokens, args.temperature)
    torch.manual_seed(args.seed)
    env = {**LEARNING_SIGNAL_ENV, "chunk_tokens": args.chunk_tokens, "tokenizer": tok}
    recs = run_rollouts([task] * args.episodes, policy, env, batch_size=args.episodes, seed=args.seed,
                        record_prompts=False)
    recs = sorted(recs, key=lambda r: r["key"])  # episode k is task copy k, as in the trainer
    episodes = [policy.steps[k][: len(r["steps"])] for k, r in enumerate(recs)]
    returns = [float(r.get("return", 0.0)) for r in recs]
    adv = group_advantages(torch.tensor(returns), args.episodes).tolist()
    source = "returns"
    if not any(adv):
        adv, source = [1.0 if e % 2 == 0 else -1.0 for e in range(args.episodes)], "synthetic"
    return step_samples(episodes, adv), episodes, source, returns


ROLLOUT_FLAGS = ("episodes", "docs", "chunk_tokens", "max_new_tokens", "temperature", "seed", "tiny")


def cached_samples(path: str, model_path: str, args, roll) -> tuple[list[tuple], list[list[tuple]], str, list[float], float]:
    """``roll()``'s result read from ``path`` when the file was written for the same model and rollout flags,
    else rolled out and written there (atomically). Returns it with the rollout's seconds (0 when read)."""
    key = {"model": model_path, **{f: getattr(args, f) for f in ROLLOUT_FLAGS}}
    if os.path.exists(path):
        try:
            with open(path) as f:
                saved = json.load(f)
            ok = saved["key"] == key
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--samples {path}: not a samples file of bench update ({e})") from None
        if not ok:
            raise ValueError(f"--samples {path} was written with other settings {saved['key']}; "
                             f"this run has {key}: give another path")
        samples = [tuple(s) for s in saved["samples"]]
        episodes = [[tuple(step) for step in e] for e in saved["episodes"]]
        return samples, episodes, saved["advantages"], saved["returns"], 0.0
    t0 = time.perf_counter()
    samples, episodes, source, returns = roll()
    seconds = time.perf_counter() - t0
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"key": key, "samples": samples, "episodes": episodes, "advantages": source, "returns": returns,
                   "rollout_s": round(seconds, 1)}, f)
    os.replace(tmp, path)
    return samples, episodes, source, returns, seconds

