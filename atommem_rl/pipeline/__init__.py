"""Multi-phase pipelines built from the library's entry points.

``phases.py``      resumable phases (done markers keyed on settings; training folders tagged for resume)
``quickstart.py``  ``atommem quickstart``: data, SFT, GRPO, evaluation with baselines, LoCoMo retrieval
``report.py``      the quickstart's report.md, metrics.json and training curves
"""
