"""``atommem serve``: the HTTP API (app.py), its sessions and batching worker (sessions.py) and the
memory page (page.py). Run with ``atommem serve CHECKPOINT`` (atommem_rl/commands/serve.py)."""
