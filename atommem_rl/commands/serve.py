r"""``atommem serve CHECKPOINT``: the trained memory agent as an HTTP API with sessions.

    atommem serve checkpoints/run/grpo --store memories/ --port 8080
    atommem serve checkpoints/run/merged --backend openai --base-url http://127.0.0.1:8000/v1 \
        --model-name policy --store http://127.0.0.1:8001      (vllm serve + chroma run)

Each session is a namespace of the store (a persistent folder, created if missing, or a ``chroma run``
server); sessions, their atoms and scratchpads survive restarts. Concurrent sessions are batched
through the one policy. Endpoints, errors and limits: ``atommem_rl/serve/app.py``; the OpenAPI schema
is served at /openapi.json, a memory page per session at /sessions/ID/page. The checkpoint's
environment (atommem_env.json) is used; ``--env JSON`` overrides settings.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import nonneg_float, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a trained memory agent over HTTP (sessions, observe, ask, memories)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="trained policy folder (atommem_env.json beside it is read)")
    p.add_argument("--store", default="atommem-store", help="persistent folder or http://HOST:PORT of a chroma "
                   "run server (default: ./atommem-store)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=positive_int, default=8080)
    p.add_argument("--policy", choices=["model", "heuristic"], default="model",
                   help="model: the checkpoint (default); heuristic: the no-LLM baseline (policies/heuristic.py) in "
                        "the checkpoint's environment, e.g. to try the API without a model")
    p.add_argument("--backend", choices=["hf", "vllm", "openai"], default="hf")
    p.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint for --backend openai")
    p.add_argument("--model-name", default=None, help="model name sent to the endpoint (openai)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--env", type=json.loads, default={}, metavar="JSON", help="environment settings over the "
                   "checkpoint's recorded ones, e.g. '{\"read_budget\": 1}'")
    p.add_argument("--max-body", type=positive_int, default=1 << 20, help="largest request body in bytes (default 1 MiB)")
    p.add_argument("--batch-wait", type=nonneg_float, default=0.01,
                   help="seconds the worker waits for more requests to batch with the first (default 0.01)")
    p.set_defaults(func=main)


def build(args):
    """(app, sessions): everything checked and loaded, nothing listening yet."""
    import os

    from atommem_rl.agent import MemoryAgent
    from atommem_rl.agent.agent import agent_env, load_policy, open_client
    from atommem_rl.serve.app import create_app
    from atommem_rl.serve.sessions import Sessions

    if not args.store.startswith(("http://", "https://")):
        os.makedirs(args.store, exist_ok=True)
    if args.backend != "openai" and args.policy == "model":
        from atommem_rl.training.checkpoints import check_model

        check_model(args.checkpoint)
    settings = agent_env(args.checkpoint, args.env)
    client = open_client(args.store)
    if args.policy == "heuristic":
        from atommem_rl.rollout import make_policy

        policy = make_policy("heuristic")
    else:
        policy = load_policy(args.checkpoint, args.backend, args.base_url, args.model_name, args.max_new_tokens)
    tok = getattr(policy, "tok", None) or (args.checkpoint if os.path.isdir(args.checkpoint) else None)

    def make_agent(sid: str) -> MemoryAgent:
        return MemoryAgent(policy, sid, client=client, env=settings, tokenizer=tok)

    sessions = Sessions(make_agent, client, batch_wait=args.batch_wait)
    return create_app(sessions, max_body=args.max_body), sessions


def main(args) -> int:
    import uvicorn

    app, sessions = build(args)
    print(json.dumps({"serving": f"http://{args.host}:{args.port}", "checkpoint": args.checkpoint,
                      "store": args.store, "sessions": len(sessions.known())}), flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        sessions.stop()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(argparse.ArgumentParser().parse_args()))
