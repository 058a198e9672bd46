"""Seeded sampling for Hugging Face ``generate``: each row's tokens depend only on its own seed.

``generate(do_sample=True)`` draws every row's next token from one global RNG with one
``torch.multinomial`` over the batch, so a row's tokens depend on which other rows share the batch
and on everything that consumed the RNG before. A step-wise GRPO rollout on 2 processes (2 rows per
call each) then differs from the same global batch on 1 process (4 rows per call), and a resumed run
only agrees with an uninterrupted one if every RNG consumer was restored exactly.

Algorithm (the Gumbel-max trick). For row i at decoding position t the scores are warped exactly as
``generate`` would warp them for sampling (temperature, top-k, top-p, min-p: transformers' own
warpers), then i.i.d. Gumbel noise g = -log(-log(u)), u ~ U(0,1) drawn from a generator seeded with
hash(seed_i, t), is added, and ``generate`` runs greedily: argmax(scores + g) is an exact sample from
softmax(scores). Rows never share random numbers, so a row's completion is a function of its prompt,
the weights and its seed only. Used by ``training/grpo.py`` (``seeded_sampling: true``, the default)
with seed_i = hash(episode seed, step of the episode). A vLLM server gets each row's seed with its request
(``training/rounds.py``). vLLM colocated in the trainer's process gets no per-request seed from TRL: its
sampler then draws the noise of every unseeded request from torch's global generator (the CPU build:
``torch.randint`` for per-token seeds; CUDA: ``exponential_``), the generator the update draws from too
(TRL's row shuffle takes a permutation per generation batch, the packed update does not). So a colocated
round runs inside :func:`seeded_round_rng`: the global generator forked, seeded with a hash of the round's
row seeds, and restored afterwards. The round's tokens then depend on its prompts, the weights and its rows'
seeds only, and training draws the same random numbers whether or not rollouts sampled.

The noise enters through a forward hook on the output embeddings (the LM head), installed only for
the duration of one generation call; ``generate`` is TRL's own call, untouched.
"""

from __future__ import annotations

import contextlib
import copy

import torch

_MASK = (1 << 63) - 1
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p")


def mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix-style), stable across processes and Python runs."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h ^= h >> 31
    return h


@contextlib.contextmanager
def seeded_round_rng(row_seeds: list[int], device: torch.device):
    """Run a generation round on torch's global generator (CPU, and ``device`` when it is an accelerator)
    seeded with a hash of the round's row seeds, and restore the generators afterwards (see the module
    docstring: vLLM colocated samples from them)."""
    devices = [device] if device.type not in ("cpu", "meta") else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        seed = mix(len(row_seeds), *row_seeds)
        torch.random.default_generator.manual_seed(seed)
        if devices:
            getattr(torch, device.type).manual_seed(seed)  # this device only, as fork_rng restores only it
        yield


def warpers(temperature=None, top_k=None, top_p=None, min_p=None):
    """transformers' sampling warpers, in ``generate``'s order."""
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    out = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k:
        out.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        out.append(TopPLogitsWarper(top_p))
    if min_p is not None:
        out.append(MinPLogitsWarper(min_p))
    return out


class GumbelNoise:
    """Forward hook for the LM head: the last position's scores, warped, plus per-row seeded noise."""

    def __init__(self, row_seeds: list[int], warp):
        self.row_seeds, self.warp, self.t = list(row_seeds), warp, 0

    def keep_rows(self, indices: list[int]) -> None:
        """Rows left the batch (inference/compact_decode.py drops ended ones): keep the others' seeds."""
        self.row_seeds = [self.row_seeds[i] for i in indices]

    def __call__(self, module, inputs, logits: torch.Tensor) -> torch.Tensor:
        scores = logits[:, -1, :].float()
        if len(self.row_seeds) != scores.size(0):
            raise RuntimeError(f"seeded sampling: {len(self.row_seeds)} seeds for {scores.size(0)} rows")
        scores = self.warp(None, scores)
        noise = torch.empty_like(scores)
        for i, seed in enumerate(self.row_seeds):
            g = torch.Generator(device=scores.device).manual_seed(mix(seed, self.t))
            noise[i].uniform_(generator=g)
        self.t += 1
        noise = -torch.log(-torch.log(noise.clamp_(1e-20, 1.0 - 1e-7)))
        # generate() reads only the last position; float32 keeps the noise from rounding into ties
        return (scores + noise).unsqueeze(1)


@contextlib.contextmanager
def seeded_generation(trainer, row_seeds: list[int]):
    """Within this block, ``trainer``'s Hugging Face generation samples each row with its own seed:
    the trainer's generation config is switched to greedy over Gumbel-perturbed warped scores."""
    cfg, kwargs = trainer.generation_config, trainer.generation_kwargs
    warp = warpers(**{k: getattr(cfg, k, None) for k in SAMPLING_KEYS})
    greedy = copy.deepcopy(cfg)
    greedy.do_sample = False
    for k in SAMPLING_KEYS:
        setattr(greedy, k, None)
    trainer.generation_config = greedy
    trainer.generation_kwargs = {**kwargs, "do_sample": False, **{k: None for k in SAMPLING_KEYS}}
    head = trainer.accelerator.unwrap_model(trainer.model).get_output_embeddings()
    handle = head.register_forward_hook(GumbelNoise(row_seeds, warp))
    try:
        yield
    finally:
        handle.remove()
        trainer.generation_config, trainer.generation_kwargs = cfg, kwargs
