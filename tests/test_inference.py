"""The inference layer (atommem_rl/inference/): the model policy and the evaluation's chat backends generate
through the same engines, so the same chat gives the same prompt tokens, the same greedy completion and the
same counts; a completion is counted up to and including its end token; a prompt cut to the context window
is reported; an endpoint without usage is counted with the tokenizer; vLLM's CPU-build settings come from
one module (a random-weight tiny Llama with the real SmolLM2 tokenizer; a real local HTTP server)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from atommem_rl.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=32, layers=1, heads=2, kv_heads=1,
                      intermediate_size=64)


CHATS = [[{"role": "user", "content": f"Question {i}: where is the {w}? " * (i + 1)}]
         for i, w in enumerate(["key", "lamp", "ship"])]


def test_policy_and_chat_backend_share_the_hf_engine(tiny):
    from atommem_rl.inference.chat_backends import Request, make_backend
    from atommem_rl.inference.generation import encode_chat
    from atommem_rl.policies.model_policy import ModelPolicy

    policy = ModelPolicy(str(tiny), backend="hf", max_new_tokens=6, dtype="float32")
    backend = make_backend("hf", str(tiny), context_window=4096, batch_size=2)
    texts = policy.act([(i, c, None) for i, c in enumerate(CHATS)])
    assert backend.generate([Request(c, 6, key="t") for c in CHATS]) == texts
    usage = backend.take_usage("t")
    assert usage["calls"] == 3 and usage["cut_prompts"] == 0
    assert usage["prompt_tokens"] == policy.tokens["prompt"] == sum(len(encode_chat(policy.tok, c)[0]) for c in CHATS)
    assert usage["completion_tokens"] == policy.tokens["completion"]
    assert policy.calls == 1 and policy.generate_seconds > 0


def test_hf_engine_counts_up_to_the_end_token_and_cuts_long_prompts(tiny):
    from atommem_rl.inference.chat_backends import Request, make_backend
    from atommem_rl.inference.generation import cut_at_stop, encode_chat
    from atommem_rl.inference.hf_engine import HFEngine
    from atommem_rl.models import load_policy

    assert cut_at_stop([5, 7, 2, 0, 0], {2}) == [5, 7, 2] and cut_at_stop([5, 7], {2}) == [5, 7]
    model, tok = load_policy(tiny, dtype="float32")
    engine = HFEngine(model, tok)
    stops = engine.stops
    assert stops == {model.generation_config.eos_token_id}
    ids = [encode_chat(tok, c)[0] for c in CHATS]
    for c, limit, p in zip(engine.generate(ids, [3, 5, 7]), [3, 5, 7], ids):
        assert c.prompt_tokens == len(p) and c.completion_tokens == len(c.token_ids) <= limit
        assert not stops & set(c.token_ids[:-1])  # nothing counted after an end token
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)

    full, cut = encode_chat(tok, CHATS[2], max_prompt_tokens=10)
    assert cut and len(full) == 10 and full == encode_chat(tok, CHATS[2])[0][-10:]
    backend = make_backend("hf", str(tiny), context_window=30)
    backend.generate([Request(CHATS[2], 4, key="k"), Request(CHATS[0], 4, key="k")])
    usage = backend.take_usage("k")
    short = len(encode_chat(tok, CHATS[0])[0])
    assert short <= 26 and usage["cut_prompts"] == 1 and usage["prompt_tokens"] == 26 + short


def test_hf_engine_autocast_runs_generate_in_bf16_and_auto_follows_the_device(tiny):
    """``autocast="bf16"``: every forward of the call runs under bf16 autocast with the fp32 weights kept (the
    numerics of a bf16 GRPO rollout), and the tokens are those of generate called inside the same context;
    ``"off"`` runs none; ``"auto"`` resolves to bf16 exactly where the CPU multiplies bf16 natively; a typo
    is refused."""
    import torch

    from atommem_rl.inference.chat_backends import make_backend
    from atommem_rl.inference.generation import encode_chat
    from atommem_rl.inference.hf_engine import HFEngine
    from atommem_rl.models import load_policy
    from atommem_rl.precision import cpu_bf16_supported

    model, tok = load_policy(tiny, dtype="float32")
    seen = []
    model.register_forward_pre_hook(lambda mod, args: seen.append(torch.is_autocast_enabled("cpu")))
    ids = [encode_chat(tok, c)[0] for c in CHATS]
    cast = HFEngine(model, tok, autocast="bf16").generate(ids, 5)
    assert seen and all(seen) and {p.dtype for p in model.parameters()} == {torch.float32}
    seen.clear()
    plain = HFEngine(model, tok, autocast="off").generate(ids, 5)
    assert seen and not any(seen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = HFEngine(model, tok, autocast="off").generate(ids, 5)
    assert [c.token_ids for c in cast] == [c.token_ids for c in inside]
    assert len(plain) == len(cast)

    assert HFEngine(model, tok, autocast="auto").autocast == ("bf16" if cpu_bf16_supported() else "off")
    assert make_backend("hf", str(tiny), autocast="auto").engine.autocast == ("bf16" if cpu_bf16_supported() else "off")
    with pytest.raises(ValueError, match="autocast must be one of"):
        HFEngine(model, tok, autocast="fp8")


def test_endpoint_engine_counts_with_the_tokenizer_when_usage_is_missing():
    from atommem_rl.inference.endpoint_engine import EndpointEngine
    from atommem_rl.inference.generation import render_chat
    from envs.tokens import cached_smollm2_tokenizer

    from .conftest import JsonEndpoint, chat_reply

    tok = cached_smollm2_tokenizer()
    srv = JsonEndpoint(lambda path, headers, body: chat_reply("in Oslo"))  # usage 0: none reported
    try:
        counted = EndpointEngine(srv.url, "m", tokenizer=tok).generate(CHATS[:2], 4)
        bare = EndpointEngine(srv.url, "m").generate(CHATS[:1], [4])
    finally:
        srv.close()
    assert [c.text for c in counted] == ["in Oslo", "in Oslo"]
    assert counted[1].prompt_tokens == len(tok.encode(render_chat(tok, CHATS[1]), add_special_tokens=False))
    assert counted[0].completion_tokens == len(tok.encode("in Oslo", add_special_tokens=False))
    assert (bare[0].prompt_tokens, bare[0].completion_tokens) == (0, 0)
    assert all(r["max_tokens"] == 4 and r["temperature"] == 0.0 for r in srv.requests)


def test_vllm_cpu_settings_live_in_one_module(monkeypatch):
    """The CPU build's memory default (overridable), our engine defaults on top, and the colocate patch
    that is a no-op where vLLM is not importable (the main environment) or on CUDA."""
    import torch

    from atommem_rl.inference import vllm_cpu
    from atommem_rl.inference.vllm_engine import engine_kwargs, vllm_available

    if torch.cuda.is_available():
        pytest.skip("the CPU build's defaults apply without CUDA only")
    assert engine_kwargs({}) == {"enforce_eager": True, "enable_prefix_caching": True, "gpu_memory_utilization": 0.15}
    monkeypatch.setenv(vllm_cpu.CPU_MEMORY_ENV, "0.3")
    assert engine_kwargs({"enforce_eager": False})["gpu_memory_utilization"] == 0.3
    assert engine_kwargs({"gpu_memory_utilization": 0.5, "enforce_eager": False, "enable_prefix_caching": False}) == {
        "enforce_eager": False, "enable_prefix_caching": False, "gpu_memory_utilization": 0.5}
    if not vllm_available():
        vllm_cpu.keep_vllm_cpu_weights_loadable()  # no vllm: nothing to patch, no error
