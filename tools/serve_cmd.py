"""foldline serve BUNDLE: an OpenAI-compatible server (needs the `serve` extra: starlette, uvicorn)."""

from __future__ import annotations

import sys

from .cli import CliError


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a bundle over an OpenAI-compatible HTTP API")
    p.add_argument("bundle", help="bundle directory (compile with --batch N to serve N requests at once)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="cpu", choices=["cpu", "vulkan", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: one per physical core)")
    p.add_argument("--model-id", default=None, help="the name clients use (default: the bundle's model name)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a row; more get HTTP 503 (default 64)")
    p.add_argument("--no-verify", action="store_true", help="skip the bundle hash check at load")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        import uvicorn

        from ..server.app import ServedModel, create_app
    except ImportError as e:
        raise CliError(f"foldline serve needs the serve extra ({e.name} is missing): pip install 'foldline[serve]'") \
            from e
    from ..runtime import Model

    if args.max_queue < 0:
        raise CliError(f"--max-queue must be >= 0, got {args.max_queue}")
    model = Model.load(args.bundle, device=args.device, verify=not args.no_verify, threads=args.threads)
    model_id = args.model_id or str(model.config.get("name") or "foldline")
    served = ServedModel(model, model_id, max_queue=args.max_queue)
    print(f"foldline serve: {model_id} ({model.batch_size} rows, context {model.max_context}) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(create_app(served), host=args.host, port=args.port, log_level="warning")
    return 0
