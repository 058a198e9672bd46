"""Hugging Face ``generate`` (CPU or GPU) over prompts given as token ids.

The prompts are left-padded into batches: all of them in one ``generate`` call, or, with ``batch_size``,
sorted by length (less padding) and ``batch_size`` per call. Greedy at temperature 0, sampled above it.
Each batch generates up to the largest ``max_new_tokens`` of its prompts; every row is then cut to its own
limit and at its first stop token (:func:`~atommem_rl.inference.generation.cut_at_stop`), which is what
is decoded and counted.

Stop tokens: the ends ``generate`` stops on (the generation config's ``eos_token_id``, a list or one id,
else the tokenizer's), or with ``stop_at_special_tokens`` any special token of the tokenizer (the
evaluation's readers: a reply ends where the model starts another turn).

The batch's common prompt prefix (the system prompt at least) is prefilled once
(:mod:`~atommem_rl.inference.shared_prefix`), and a model on ``sdpa`` attention decodes with
``sdpa_grouped`` (:mod:`~atommem_rl.inference.grouped_attention`: no copies of the key/value cache per
step). Greedy calls (temperature 0: evaluation, serving) decode with
:func:`~atommem_rl.inference.compact_decode.greedy_decode`, which stops computing rows that have ended and
each row at its own limit (``drop_finished=False``: ``generate`` instead, every row until the batch's last
ends); sampled calls are ``generate``'s own.

``autocast``: ``"off"`` computes in the weights' dtype; ``"bf16"`` wraps each ``generate`` call in one bf16
autocast context (fp32 weights cast once per call, softmax and norms kept in fp32: the numerics of a GRPO
rollout under ``bf16: true``); ``"auto"`` is ``"bf16"`` where the device multiplies bf16 natively
(:func:`~atommem_rl.precision.autocast_dtype`), else ``"off"``.
"""

from __future__ import annotations

import contextlib

from .compact_decode import greedy_decode
from .generation import Completion, cut_at_stop
from .grouped_attention import use_grouped_attention
from .shared_prefix import generate_shared_prefix

AUTOCAST_MODES = ("off", "auto", "bf16")  # the ``autocast`` values (module docstring); CLIs offer the same


class HFEngine:
    name = "hf"

    def __init__(self, model, tokenizer, *, stop_at_special_tokens: bool = False, autocast: str = "off",
                 drop_finished: bool = True):
        if autocast not in AUTOCAST_MODES:
            raise ValueError(f"autocast must be one of {', '.join(AUTOCAST_MODES)}, got {autocast!r}")
        model.eval()
        use_grouped_attention(model)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.model, self.tokenizer = model, tokenizer
        self.drop_finished = drop_finished
        self.device = next(model.parameters()).device
        if autocast == "auto":
            import torch

            from atommem_rl.precision import autocast_dtype

            autocast = "bf16" if autocast_dtype(self.device) == torch.bfloat16 else "off"
        self.autocast = autocast  # what it resolved to
        eos = model.generation_config.eos_token_id
        self.eos_token_id = eos if eos is not None else tokenizer.eos_token_id  # what generate stops on
        if stop_at_special_tokens:
            special = getattr(tokenizer, "all_special_ids", None)
            self.stops = set(special) if special else {tokenizer.eos_token_id}
        else:
            self.stops = set(self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id])

    def generate(self, prompt_ids: list[list[int]], max_new_tokens: int | list[int], *, temperature: float = 0.0,
                 batch_size: int | None = None) -> list[Completion]:
        import torch

        n = len(prompt_ids)
        limits = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [int(max_new_tokens)] * n
        if batch_size is None:
            order, batch_size = list(range(n)), max(1, n)
        else:
            order = sorted(range(n), key=lambda i: len(prompt_ids[i]))
        tok = self.tokenizer
        pad = tok.pad_token_id
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        out: list[Completion | None] = [None] * n
        for s in range(0, n, batch_size):
            part = order[s:s + batch_size]
            if temperature <= 0 and self.drop_finished:
                with self._autocast():
                    rows = greedy_decode(self.model, [prompt_ids[i] for i in part], [limits[i] for i in part],
                                         self.stops, pad_token_id=pad)
                for i, kept in zip(part, rows):
                    out[i] = Completion(tok.decode(kept, skip_special_tokens=True), len(prompt_ids[i]), len(kept), kept)
                continue
            width = max(len(prompt_ids[i]) for i in part)
            input_ids = torch.tensor([[pad] * (width - len(prompt_ids[i])) + prompt_ids[i] for i in part],
                                     device=self.device)
            mask = torch.tensor([[0] * (width - len(prompt_ids[i])) + [1] * len(prompt_ids[i]) for i in part],
                                device=self.device)
            with torch.no_grad(), self._autocast():
                gen = generate_shared_prefix(self.model, input_ids, mask, pad_token_id=pad,
                                             max_new_tokens=max(limits[i] for i in part),
                                             eos_token_id=self.eos_token_id, **sampling)
            for i, row in zip(part, gen[:, width:].tolist()):
                kept = cut_at_stop(row[: limits[i]], self.stops)
                out[i] = Completion(tok.decode(kept, skip_special_tokens=True), len(prompt_ids[i]), len(kept), kept)
        return out  # type: ignore[return-value]

    def _autocast(self):
        import torch

        if self.autocast == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def close(self) -> None:
        pass
