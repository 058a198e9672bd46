"""Every OpenAI-compatible call goes through one client (atommem_rl/inference/endpoints.py, the openai SDK): against a
real local HTTP server that fails its first requests, the policy, the evaluation backend, the LLM judge and
the embedder all retry and succeed; an endpoint that never answers is one clear error naming it, after the
same number of attempts for each."""

from __future__ import annotations

import pytest

from atommem_rl.inference.endpoints import MAX_RETRIES, EndpointError, chat, embed

from .conftest import JsonEndpoint, chat_reply


class Flaky(JsonEndpoint):
    """Answers 503 to its first ``fail`` requests (every request when fail < 0), then a scripted reply."""

    def __init__(self, fail: int):
        self.fail, self.seen = fail, 0
        super().__init__(self.answer)

    def answer(self, path, headers, body):
        self.seen += 1
        if self.fail < 0 or self.seen <= self.fail:
            return 503, {"error": {"message": "warming up"}}
        if path.endswith("/embeddings"):
            return 200, {"data": [{"index": i, "embedding": [float(len(t)), 1.0, 0.0]} for i, t in enumerate(body["input"])]}
        return chat_reply("Oslo", 11, 2)


def test_chat_retries_then_succeeds_and_counts_tokens():
    with Flaky(fail=2) as ep:
        reply = chat(ep.url, "m", [{"role": "user", "content": "Where?"}], max_tokens=4)
    assert (reply.text, reply.prompt_tokens, reply.completion_tokens) == ("Oslo", 11, 2)
    assert ep.seen == 3


def test_embed_retries_then_keeps_input_order():
    with Flaky(fail=1) as ep:
        rows = embed(ep.url, "e", ["a", "bbb"])
    assert rows == [[1.0, 1.0, 0.0], [3.0, 1.0, 0.0]] and ep.seen == 2


@pytest.mark.parametrize("kind", ["chat", "embed"])
def test_a_dead_endpoint_is_one_error_after_the_retries(kind):
    with Flaky(fail=-1) as ep:
        with pytest.raises(EndpointError) as info:
            if kind == "chat":
                chat(ep.url, "m", [{"role": "user", "content": "x"}], max_tokens=4, what="LLM judge")
            else:
                embed(ep.url, "e", ["x"])
    assert ep.url in str(info.value) and "503" in str(info.value)
    assert ep.seen == MAX_RETRIES + 1
    assert isinstance(info.value, ConnectionError)  # what the callers already handle


def test_every_caller_uses_the_retrying_client(tmp_path):
    """Policy, evaluation backend, judge and embedder each get through a server whose first request fails."""
    from atommem_rl.inference.chat_backends import OpenAIBackend, Request
    from atommem_rl.memory.embeddings import OpenAIEmbedder
    from atommem_rl.policies.model_policy import ModelPolicy
    from atommem_rl.scoring import LLMJudge

    with Flaky(fail=1) as ep:
        policy = ModelPolicy(backend="openai", base_url=ep.url, model_name="m", max_new_tokens=4)
        assert policy.act([("k", [{"role": "user", "content": "q"}], None)]) == ["Oslo"]
        assert policy.tokens == {"prompt": 11, "completion": 2}
    with Flaky(fail=1) as ep:
        backend = OpenAIBackend(ep.url, "m")
        assert backend.generate([Request([{"role": "user", "content": "q"}], 4, "t1")]) == ["Oslo"]
    with Flaky(fail=1) as ep:
        chat_judge = LLMJudge(ep.url, "j")
        assert chat_judge("Where?", "Oslo", ["Oslo"]) == 0.0  # the scripted reply is no CORRECT verdict
        assert ep.seen == 2
    with Flaky(fail=1) as ep:
        vecs = OpenAIEmbedder(ep.url, "e").embed(["ab"])
        assert vecs.shape == (1, 3) and ep.seen == 2
