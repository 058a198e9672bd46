"""Rehearsal-only switch: accelerate's own FSDP2 preparation on CPU processes over gloo.

Why. accelerate 1.15 turns ``ACCELERATE_USE_FSDP`` into ``DistributedType.FSDP`` only for accelerator
processes (``AcceleratorState.__init__`` tests MULTI_GPU, MULTI_NPU, ...); on CPU ranks it stays MULTI_CPU
and the FSDP plugin it built from the environment is dropped, so a CPU run of an FSDP recipe silently
trains under DDP (measured: ``accelerate launch`` of recipes/accelerate/fsdp2_cpu.yaml prints
``MULTI_CPU``). torch itself runs ``fully_shard`` over gloo on CPU. This module lets a CPU rehearsal take
accelerate's real FSDP2 path (``fsdp2_prepare_model``: ``fully_shard`` per decoder layer, the tail group,
the root; gradient sync through ``set_requires_gradient_sync``) instead of a hand-written one.

What it does. With ``ATOMMEM_REHEARSE_FSDP_ON_CPU=1`` and ``ACCELERATE_USE_FSDP=true`` (an FSDP accelerate
config sets the latter), :func:`install` wraps ``AcceleratorState.__init__``: after accelerate's own
initialisation, a state that came out MULTI_CPU becomes FSDP with the plugin accelerate built (its mixed
precision applied, as accelerate does on GPUs). Nothing else changes; without the variable (every real
run) accelerate is untouched. It is installed when ``atommem_rl.training.packing`` is imported (the
trainers import it), before any ``Accelerator`` is built.

Run:
    ATOMMEM_REHEARSE_FSDP_ON_CPU=1 accelerate launch --config_file recipes/accelerate/fsdp2_cpu.yaml \\
        -m atommem_rl.cli grpo --config ... --use_cpu true
"""

from __future__ import annotations

import functools
import os

ENV = "ATOMMEM_REHEARSE_FSDP_ON_CPU"


def requested() -> bool:
    """Whether this process rehearses FSDP on CPU (the switch and an FSDP accelerate launch)."""
    return (os.environ.get(ENV, "0").lower() in ("1", "true", "yes")
            and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true")


def install() -> bool:
    """Wrap ``AcceleratorState.__init__`` (once) when :func:`requested`; returns whether it is installed."""
    if not requested():
        return False
    from accelerate.state import AcceleratorState, PartialState

    if getattr(AcceleratorState.__init__, "_atommem_fsdp_cpu", False):
        return True
    original = AcceleratorState.__init__

    @functools.wraps(original)
    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        from accelerate.utils import DistributedType

        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            # what accelerate does for MULTI_GPU with ACCELERATE_USE_FSDP (state.py, AcceleratorState.__init__)
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            # as accelerate does at the end of its own: every later AcceleratorState() copies PartialState's
            # shared state over its own, which would turn it back into MULTI_CPU
            PartialState._shared_state["distributed_type"] = self.distributed_type

    __init__._atommem_fsdp_cpu = True
    AcceleratorState.__init__ = __init__
    return True
