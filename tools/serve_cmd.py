"""foldline serve BUNDLE: an OpenAI-compatible server (needs the `serve` extra: starlette, uvicorn, pydantic)."""

from __future__ import annotations

import sys

from .cli import CliError, require_extra

DEFAULT_MAX_STOP = 4  # server/protocol.py's, without importing the serve extra to build the parser
DEFAULT_CHECKPOINTS = 4  # server/served.py's


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a bundle over an OpenAI-compatible HTTP API")
    p.add_argument("bundle", help="bundle directory (compile with --batch N to serve N requests at once)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="cpu", choices=["cpu", "vulkan", "cuda", "onnxruntime"])
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: one per physical core)")
    p.add_argument("--model-id", default=None, help="the name clients use (default: the bundle's model name)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a row; more get HTTP 503 (default 64)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body; larger ones get HTTP 413 (default 1048576, 1 MiB)")
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="time a request may take, queueing included; then it ends with finish_reason "
                        "'length' (default: no limit)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="after SIGTERM, time running requests get to finish before they are cut (default 10)")
    p.add_argument("--stall-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="/health answers 503 when generation makes no step this long with work queued (default 60)")
    p.add_argument("--cors", action="append", default=[], metavar="ORIGIN",
                   help="allow browser requests from ORIGIN (repeatable; '*' for any); other cross-origin "
                        "requests get HTTP 403 (default: none)")
    p.add_argument("--allowed-hosts", action="append", default=[], metavar="HOST",
                   help="also answer requests whose Host header names HOST (repeatable; '*' for any; default: "
                        "the --host address and localhost); others get HTTP 400")
    p.add_argument("--max-stop", type=int, default=DEFAULT_MAX_STOP, metavar="N",
                   help=f"stop strings one request may give (default {DEFAULT_MAX_STOP}, as OpenAI)")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="open connections at once; more get HTTP 503 (default 1024, or half the open-file limit)")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="time a client has to send a request's headers, then HTTP 408 (default 10)")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="time a client has to send a request's whole body, then HTTP 408 (default 30)")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="time an idle connection is kept open between requests (default 5)")
    p.add_argument("--no-prompt-cache", action="store_true",
                   help="prefill every prompt in full, instead of reusing the tokens a released row holds")
    p.add_argument("--checkpoints", type=int, default=DEFAULT_CHECKPOINTS, metavar="N",
                   help="per row, copies of a hybrid model's ring and recurrent state kept along its prompt, so "
                        "that a prompt edited after one resumes there (default "
                        f"{DEFAULT_CHECKPOINTS}; 0: none; models with full caches only need none)")
    p.add_argument("--slots-dir", default=None, metavar="DIR",
                   help="save the conversation a row must give up to DIR (an existing writable directory) and "
                        "restore it when its next turn arrives (default: rows only)")
    p.add_argument("--slots-max", type=int, default=None, metavar="N",
                   help="files kept in --slots-dir; the least recently used go first (default 32)")
    p.add_argument("--no-verify", action="store_true", help="skip the bundle hash check at load")
    p.set_defaults(func=run)


def run(args) -> int:
    require_extra("serve")  # before any import of it: one line naming the extra, not a traceback
    from ..runtime import Model
    from ..runtime.slots import DEFAULT_MAX_FILES, check_slots_dir
    from ..server.run import serve
    from ..server.served import ServedModel, ServeOptions

    for name in ("max_queue", "max_stop", "checkpoints"):
        if getattr(args, name) < 0:
            raise CliError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("max_body_bytes", "request_timeout", "shutdown_timeout", "stall_timeout", "slots_max",
                 "max_connections", "header_timeout", "body_timeout", "keep_alive_timeout"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise CliError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.slots_dir is None and args.slots_max is not None:
        raise CliError("--slots-max bounds --slots-dir, which is not given")
    if args.slots_dir is not None:
        if args.no_prompt_cache:
            raise CliError("--slots-dir keeps what the prompt cache gives up: it needs the cache "
                           "(drop --no-prompt-cache)")
        check_slots_dir(args.slots_dir)  # before the model loads: a typo fails at once
    options = ServeOptions(max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                           request_timeout=args.request_timeout, shutdown_timeout=args.shutdown_timeout,
                           stall_timeout=args.stall_timeout, cors_origins=list(args.cors),
                           allowed_hosts=list(args.allowed_hosts), host=args.host, max_stop=args.max_stop,
                           header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                           keep_alive_timeout=args.keep_alive_timeout,
                           prompt_cache=not args.no_prompt_cache, slots_dir=args.slots_dir,
                           slots_max=args.slots_max or DEFAULT_MAX_FILES, checkpoints=args.checkpoints)
    if args.max_connections is not None:
        options.max_connections = args.max_connections
    model = Model.load(args.bundle, device=args.device, verify=not args.no_verify, threads=args.threads)
    model_id = args.model_id or str(model.manifest.model_name or "foldline")
    served = ServedModel(model, model_id, options=options)
    print(f"foldline serve: {model_id} ({model.batch_size} rows, context {model.max_context}) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    batch = served.scheduler.batch
    if batch.max_checkpoints:
        each = batch.checkpoint_nbytes()
        print(f"foldline serve: up to {batch.max_checkpoints} checkpoints per row of {each / (1 << 20):.1f} MiB each "
              f"({batch.rows * batch.max_checkpoints * each / (1 << 20):.1f} MiB at most)", file=sys.stderr, flush=True)
    slots = served.scheduler.slots
    if slots is not None:
        print(f"foldline serve: saving rows to {slots.dir} ({len(slots.files)} found, at most {slots.max_files} "
              f"files of {slots.token_nbytes / 1024:.1f} KiB per token held, {slots.file_nbytes / (1 << 20):.1f} MiB "
              "at most)", file=sys.stderr, flush=True)
    serve(served, args.host, args.port)
    print("foldline serve: stopped", file=sys.stderr, flush=True)
    return 0
