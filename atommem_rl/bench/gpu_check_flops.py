"""The model shapes and FLOP accounting of the one-GPU check (``bench/gpu_check.py``).

``SHAPES`` are Qwen3 configurations (and a tiny one for the CPU check); :func:`train_flops_per_token` is
6 N + 6 L S d_attn with N from :func:`matmul_params` (the matrix multiplies, the output projection
included, the embedding lookup not); :func:`_mfu` divides the achieved FLOP/s by a peak (the H200's dense
bf16 figure by default on cuda). Pure arithmetic: no torch import.
"""

from __future__ import annotations

# Qwen3 shapes (config.json of the released models); vocab 151,936
SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    # head size 64: one that vLLM's CPU attention supports
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64, vocab_size=512, tie_word_embeddings=True),
}
H200_BF16_PEAK_TFLOPS = 989.5
H200_MATMUL_TFLOPS = 799.0  # DESIGN.md section 5, measured 8192^3 bf16 matmul


def matmul_params(cfg) -> int:
    """Parameters that take part in matrix multiplies per token (embedding lookup excluded)."""
    d, L = cfg.hidden_size, cfg.num_hidden_layers
    hd = cfg.head_dim
    attn = d * hd * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)  # q, o, k, v
    mlp = 3 * d * cfg.intermediate_size
    return L * (attn + mlp) + d * cfg.vocab_size  # + output projection


def train_flops_per_token(cfg, seq_len: int) -> float:
    """6 N + 6 L S d_attn (causal attention, forward + backward)."""
    return 6 * matmul_params(cfg) + 6 * cfg.num_hidden_layers * seq_len * cfg.num_attention_heads * cfg.head_dim


def _mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float | None) -> float | None:
    return None if not peak_tflops else tokens_per_s * flops_per_token / (peak_tflops * 1e12)
