"""The packed policy update (``max_tokens_per_microbatch``) as a mixin of the step-wise trainer.

The generation batch's trained step samples are folded into prefix tries (TRL's ``TreeRow``) of at most
``max_tokens_per_microbatch`` unique tokens (training/packing.py); each micro-step gets a list of packed
micro-batches instead of TRL's slice of padded rows, and TRL's loss runs on each with its per-token
log-probabilities from one forward over the packed row. The no-gradient passes (old-policy and reference
log-probabilities) are packed the same way. Every rank runs the same number of packed forwards (empty
micro-batches pad), which FSDP2's parameter gathers need.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["PackedUpdate", "refuse_unsupported_packing"]


def refuse_unsupported_packing(trainer) -> None:
    """Packed updates need settings only known once the trainer is built: one process, DDP or FSDP2
    (``packing.sharding_refusal`` says why not DeepSpeed or FSDP1)."""
    from .packing import sharding_refusal

    if not getattr(trainer.args, "max_tokens_per_microbatch", 0):
        return
    error = sharding_refusal(trainer.accelerator.distributed_type, fsdp2=trainer.accelerator.is_fsdp2)
    if error:
        raise ValueError(error)
    if trainer.aux_loss_enabled:
        raise ValueError("max_tokens_per_microbatch does not carry the MoE router auxiliary loss; set it to 0")


class PackedUpdate:
    """Methods of :class:`~atommem_rl.training.grpo.StepwiseGRPOTrainer` for the packed update (before TRL's
    in the MRO; each falls back to TRL's when packing is off)."""

    def _prepare_inputs(self, generation_batch):
        """TRL's buffering of one generation batch over ``steps_per_generation`` micro-steps, except that with
        packing each micro-step gets a list of packed micro-batches instead of a slice of rows."""
        if not (getattr(self.args, "max_tokens_per_microbatch", 0) and self.model.training):
            return super()._prepare_inputs(generation_batch)
        spg = self.args.steps_per_generation
        if self._step % (spg * self.num_iterations) == 0 or self._buffered_inputs is None:
            self._buffered_inputs = self._pack_generation_batch(self._generate_and_score_completions(generation_batch))
        return self._buffered_inputs[self._step % spg]

    def _pack_generation_batch(self, output: dict[str, Any]) -> list[dict[str, Any]]:
        """The rows of a generation batch packed under the token budget (padding rows and rows without
        trained tokens left out), the packed micro-batches padded with empty ones to the largest count of
        any rank (and at least steps_per_generation), then dealt in order to the micro-steps: micro-step j
        gets the same number of them on every rank. Each carries the row tensors of its samples for
        TRL's loss (``rows``) and its packed layout (``packed``)."""
        from .packing import microbatch_inputs, pad_microbatches, term_positions

        spg = self.args.steps_per_generation
        pad_id = self._tokenizer.pad_token_id
        lengths = output["completion_mask"].size(1)
        plan = self._plan_trained_rows(output)
        count = max(len(plan), spg)
        if self.accelerator.num_processes > 1:
            count = int(self.accelerator.gather(torch.tensor([count], device=self.accelerator.device)).max())
        plan = pad_microbatches(plan, count)
        device = self.accelerator.device
        per_row = {k: v for k, v in output.items() if torch.is_tensor(v) and v.dim() > 0}
        # TRL's loss gathers per-row metrics: the k-th micro-batch holds the same number of rows on every rank
        # (the largest; extra rows are copies of row 0 with their mask cleared, as the row path pads)
        sizes = torch.tensor([max(len(r.samples), 1) for r in plan], device=device)
        if self.accelerator.num_processes > 1:
            sizes = self.accelerator.gather(sizes).view(self.accelerator.num_processes, -1).max(dim=0).values
        micro = []
        for row, size in zip(plan, sizes.tolist(), strict=True):
            idx = [s["index"] for s in row.samples]
            real = torch.tensor([True] * len(idx) + [False] * (size - len(idx)), device=device)
            idx = idx + [0] * (size - len(idx))
            rows = {k: v[idx] for k, v in per_row.items()}
            rows.update({k: v for k, v in output.items() if k not in per_row})
            rows["completion_mask"] = rows["completion_mask"] * real[:, None]
            rows["advantages"] = torch.where(real, rows["advantages"], torch.zeros_like(rows["advantages"]))
            packed = microbatch_inputs(row, pad_id, device)
            # each loss term's (row in ``rows``, completion position): a sample's terms are consecutive
            packed["term_at"] = (packed["segment_id"], term_positions(packed, len(row.samples)))
            packed["shape"] = (len(idx), lengths)
            micro.append({"rows": rows, "packed": packed})
        per_step = [micro[j * count // spg:(j + 1) * count // spg] for j in range(spg)]
        self._metrics["train"]["packing/forwarded_tokens"].append(float(sum(m["packed"]["forwarded_tokens"]
                                                                            for m in micro)))
        self._metrics["train"]["packing/microbatches"].append(float(count))
        return [{"packed_microbatches": ms, "advantages": torch.cat([m["rows"]["advantages"] for m in ms])}
                for ms in per_step]

    def _plan_trained_rows(self, output: dict[str, Any]) -> list:
        """The rows of a generation batch that carry trained tokens, folded into TRL ``TreeRow``s of at most
        ``max_tokens_per_microbatch`` unique tokens, each sample dict's ``index`` its row in ``output``."""
        from .packing import plan_microbatches, tree_samples

        pick = [i for i, t in enumerate((output["completion_mask"].sum(dim=1) > 0).tolist()) if t]
        samples = []
        for i in pick:
            prompt = output["prompt_ids"][i][output["prompt_mask"][i].bool()].tolist()
            n = int(output["completion_mask"][i].sum())
            samples.append((prompt, output["completion_ids"][i][:n].tolist(), None, 1.0))
        tree = tree_samples(samples, [self._sample_meta[i][1] for i in pick])
        for s, i in zip(tree, pick, strict=True):
            s["index"] = i
        return plan_microbatches(tree, self.args.max_tokens_per_microbatch)

    def _packed_scores(self, output: dict[str, Any], model, adapter_context=None) -> torch.Tensor:
        """Per-token log-probabilities (rows x completion positions; 0 where no token is trained) of the
        generation batch's trained tokens under ``model`` without gradients, from packed forwards under the
        token budget: what TRL's padded-row pass computes for the old-policy (importance-sampling correction)
        and reference (KL) log-probabilities, at the packed update's cost and numerics (the same autocast).
        One process or DDP: no collective runs (the unwrapped model, no gradients), so ranks may run different
        numbers of them. FSDP2: every forward all-gathers the parameters, so every rank runs as many as the
        busiest one (empty micro-batches pad, as for the update); a mismatch would hang."""
        from .packing import is_sharded, microbatch_inputs, packed_logprobs, pad_microbatches, term_positions

        mask = output["completion_mask"]
        logps = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        inner = self.accelerator.unwrap_model(model)
        pad_id = self._tokenizer.pad_token_id
        plan = self._plan_trained_rows(output)
        if self.accelerator.num_processes > 1 and is_sharded(inner):
            count = torch.tensor([len(plan)], device=mask.device)
            plan = pad_microbatches(plan, int(self.accelerator.gather(count).max()))
        with torch.no_grad(), self.accelerator.autocast(), (adapter_context or contextlib.nullcontext()):
            for row in plan:
                packed = microbatch_inputs(row, pad_id, mask.device)
                lp = packed_logprobs(inner, packed, temperature=self.temperature)
                real = packed["sample_index"] >= 0  # an empty micro-batch's phantom term belongs to no row
                at = (packed["sample_index"][real], term_positions(packed, len(row.samples))[real])
                logps.index_put_(at, lp.float()[real])
        return logps

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **kwargs):
        """TRL's, except while a packed micro-batch is scored (``self._packed``): its log-probabilities (and
        entropies) from one forward over the packed row, laid out as TRL's (rows x completion positions)."""
        if self._packed is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **kwargs)
        from .packing import packed_logprobs

        packed = self._packed
        inner = self.accelerator.unwrap_model(model)
        wrapped = model if model is not inner else None
        with self.accelerator.autocast():
            lp, ent = packed_logprobs(inner, packed, temperature=self.temperature, forward_model=wrapped,
                                      with_entropy=True)
        b, t = packed["term_at"]
        # float32 rows, as TRL's: under FSDP2's bf16 mixed precision the fused head returns bf16 values
        logps = torch.zeros(packed["shape"], dtype=torch.float32, device=lp.device).index_put((b, t), lp.float())
        entropies = torch.zeros(packed["shape"], dtype=torch.float32, device=lp.device).index_put(
            (b, t), ent.detach().float()) if compute_entropy else None
        return logps, entropies, None

    def _packed_loss(self, model, inputs) -> torch.Tensor:
        """TRL's loss over each packed micro-batch of this micro-step: all but the last are backpropagated
        here (without gradient synchronisation), the last is returned for the Trainer's backward, which
        synchronises on the accumulation boundary as usual. Under FSDP2 accelerate's ``no_sync`` is FSDP2's own
        ``set_requires_gradient_sync(False)``: the gradients accumulate unsharded and are reduce-scattered once
        per optimizer step, in the last backward (tests/test_fsdp2_packing.py counts one reduce-scatter per
        parameter group); parameters reshard after every backward (FSDP2's default), so each packed forward
        gathers them again, the same number of times on every rank (the counts are padded). With accelerate's
        ``sync_each_batch`` (``accelerator_config: {gradient_accumulation_kwargs: {sync_each_batch: true}}``)
        every backward reduce-scatters instead: more communication, no unsharded gradients held between
        backwards (``atommem bench memory-plan`` traces both)."""
        total = None
        parts = inputs["packed_microbatches"]
        for k, part in enumerate(parts):
            self._packed = part["packed"]
            try:
                loss = super().compute_loss(model, part["rows"])
            finally:
                self._packed = None
            if k == len(parts) - 1:
                return loss if total is None else loss + total
            # with accelerate's sync_each_batch every backward reduces (the Trainer runs no micro-step under
            # no_sync then): the packed parts do the same, so no unsharded gradients are held at any point
            each_batch = self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
            hold = self.accelerator.sync_gradients and not each_batch
            sync_off = self.accelerator.no_sync(model) if hold else contextlib.nullcontext()
            with sync_off:
                self.accelerator.backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
        raise RuntimeError("a micro-step without packed micro-batches")

    def _packed_ref_logps(self, output: dict[str, Any]) -> torch.Tensor:
        """:meth:`_ref_logps` from packed forwards (:meth:`_packed_scores`)."""
        if self.ref_model is not None:
            return self._packed_scores(output, self.ref_model)
        from trl.trainer.utils import use_adapter

        model = self.accelerator.unwrap_model(self.model)
        return self._packed_scores(output, self.model, adapter_context=use_adapter(
            model, adapter_name="ref" if "ref" in model.peft_config else None))

