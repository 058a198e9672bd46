"""Evaluation: checkpoints against baselines on real benchmarks under one protocol.

    harness.evaluate(datasets, methods, out_dir, ...)   run, score, write every output
    methods      the methods (reader baselines, policy methods) and EvalSettings
    (models)     every LLM call goes through atommem_rl.inference.chat_backends (hf | vllm | openai),
                 calls and tokens counted per task
    metrics      aggregation and the metrics.json schema
    report, plots, viewer   report.md, PNG plots, viewer.html

Launch: ``atommem eval --tasks FILE... --methods a,b,... [--model PATH] [--backend hf|vllm|openai] --out DIR``.
"""
