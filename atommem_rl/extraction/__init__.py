"""Atomic fact extraction and the graph-memory pipeline (DESIGN.md section 1, the second AtomMem).

    schema.py     the extractor's strict JSON schema, bounded parse/repair, validation, date anchoring
    extractor.py  windows of turns -> facts through any chat backend (atommem_rl/inference), with bounded retries
    verify.py     candidates by shared metadata, hybrid similarity, model-labelled relations
    pipeline.py   extract -> verify -> events/profiles -> graph retrieval -> answer, as the eval
                  methods atommem_graph, atommem_flat, no_graph, no_profile
    gold.py       gold atoms of the synthetic world, SFT pairs (gold and teacher-filtered), fact-level
                  precision/recall

Commands::

    python -m atommem_rl.extraction.gold --out checkpoints/extractor/pairs.jsonl   # SFT pairs
    atommem sft --config recipes/extractor/sft.yaml
    atommem bench extractor --model checkpoints/extractor/sft                      # P/R held out
    atommem eval --tasks locomo.jsonl --methods atommem_graph,atommem_flat,no_graph,no_profile,mem0 ...
"""
