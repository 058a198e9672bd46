"""The policy loss's zero-advantage skip (``zero_advantage``), as a mixin of the step-wise trainer.

With beta 0 every loss TRL offers is linear in the advantages, so a micro-batch whose advantages are all 0
has exactly zero gradients: its forward/backward can be skipped. The mixin's ``compute_loss`` takes that
shortcut (keeping DDP's ranks replicas) and otherwise hands the micro-batch to the packed update or TRL's loss.
"""

from __future__ import annotations

import torch

from .grpo_config import zero_advantage_mode


class ZeroAdvantageLoss:
    """``compute_loss`` of :class:`~atommem_rl.training.grpo.StepwiseGRPOTrainer`, first in its MRO: the skip is
    decided once per micro-step, and the packed micro-batches of a micro-step then run TRL's loss directly
    (``PackedUpdate._packed_loss`` calls the next ``compute_loss``, TRL's, not this one)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss, except for a micro-batch that cannot move the policy: with beta 0 every loss type
        is linear in the advantages, so all-zero advantages give exactly zero gradients. On a CPU that
        forward/backward is most of a GRPO step (a group whose episodes all scored 0 is common early on);
        ``0 * sum(params)`` gives the same zero gradients (the optimizer still steps, Adam's moments
        decay as they would) without it. With ``zero_advantage: hold`` the gradients stay unset
        instead, and a step made only of such micro-batches leaves the weights and optimizer state alone:
        stepping Adam on zero gradients keeps moving every weight along its momentum, which with sparse
        rewards is most steps (measured in docs/BENCHMARKS.md, "Learning signal")."""
        if self._all_advantages_zero(inputs):
            self._metrics["train"]["skipped_zero_advantage"].append(1.0)
            self._average_skipped_gradients(model)
            if zero_advantage_mode(self.args)[2]:
                # connected to no parameter: its backward leaves every .grad as it was (None after
                # the Trainer's zero_grad), and the optimizer skips parameters without a gradient
                return torch.zeros((), device=self.accelerator.device, requires_grad=True)
            params = [p for p in model.parameters() if p.requires_grad]
            return torch.stack([p.sum() for p in params]).sum() * 0.0
        if self.model.training:
            self._metrics["train"]["skipped_zero_advantage"].append(0.0)
        if "packed_microbatches" in inputs:
            return self._packed_loss(model, inputs)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _average_skipped_gradients(self, model) -> None:
        """A skipped micro-step that closes an accumulation window under DDP: average the accumulated
        gradients over the ranks by hand. DDP averages in the backward of a forward it ran with
        synchronisation on, which is only ever the window's last micro-step; the earlier ones ran under
        ``no_sync``. Skipping that forward would leave every rank stepping its optimizer on its own local
        gradients, and the replicas would drift apart for the rest of the run. Every rank takes this path
        together (the skip is decided collectively), with the same parameters holding gradients (the same
        micro-steps ran everywhere), so the all-reduces match."""
        acc = self.accelerator
        if acc.num_processes < 2 or not acc.sync_gradients:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:  # hold, and nothing earlier in the window had signal: every rank has no gradient
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:  # one all-reduce per dtype (a flat buffer holds one)
            by_dtype.setdefault(g.dtype, []).append(g)
        for _, group in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):  # the same order on every rank
            flat = _flatten_dense_tensors(group)
            torch.distributed.all_reduce(flat)
            flat /= acc.num_processes
            for g, avg in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
                g.copy_(avg)

    def _all_advantages_zero(self, inputs) -> bool:
        """Whether this micro-batch may skip its forward/backward (``zero_advantage`` skip, hold, drop...).

        With several processes the ranks must agree, since DDP all-reduces gradients in the backward
        of a forward it ran: they skip together only when every rank's micro-batch is all zeros (one
        all-reduce of a flag; every rank runs the same number of micro-batches). A backward that did
        not come from a DDP forward fires no reduction, and every rank's gradients are zero anyway.
        DeepSpeed and FSDP gather parameters inside their own forward and reduce inside their own
        backward, so there the micro-batch always runs."""
        from accelerate.utils import DistributedType

        acc = self.accelerator
        if not (zero_advantage_mode(self.args)[1] and self.beta == 0.0 and self.model.training
                and acc.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)):
            return False
        nonzero = torch.any(inputs["advantages"] != 0).float().reshape(1)
        if acc.num_processes > 1:
            nonzero = acc.reduce(nonzero, reduction="sum")
        return nonzero.item() == 0
