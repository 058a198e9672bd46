"""Which floating-point type a device computes in: bf16 where it runs bf16 matrix multiplies natively, fp32
elsewhere. Shared by training (a recipe's ``auto_bf16``) and inference (``HFEngine``'s ``autocast``), so
both pick the same way.

Why bf16 on CPUs at all: a CPU with AMX-BF16 (or AVX512-BF16) multiplies bf16 matrices several times
faster than fp32 (a 2048 x 2048 matmul about 5x on the development machine); one without it emulates bf16
and is slower than fp32, hence the probe instead of a blanket choice.
"""

from __future__ import annotations

import torch


def cpu_bf16_supported() -> bool:
    """Whether this CPU runs bf16 matrix multiplies natively (AVX512-BF16 or AMX). oneDNN's own flag is
    the fallback on a torch without these probes; it is also true on AVX512 cores that only emulate bf16."""
    probes = [getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(p is not None for p in probes):
        return any(p() for p in probes if p is not None)
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def autocast_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bf16 where the device has it (CUDA with bf16, a CPU with native bf16), else fp32."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_bf16_supported() else torch.float32
