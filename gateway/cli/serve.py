"""`specgate serve`: the gateway, from its config file and environment, then the flags given."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Any

from specgate.gateway.cli.common import add_chat_template_args, add_weight_args, quiet_transformers
from specgate.gateway.settings import default_cache_dir

if TYPE_CHECKING:
    from specgate.gateway.settings import Settings

logger = logging.getLogger("specgate.serve")


def add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the OpenAI-compatible gateway")
    serve.add_argument("--host", default=None, help="default 127.0.0.1 (or SPECGATE_HOST)")
    serve.add_argument("--port", type=int, default=None, help="default 8000 (or SPECGATE_PORT)")
    serve.add_argument(
        "--config", default=None, help="TOML, YAML or JSON file: backends, models, routes, keys"
    )
    serve.add_argument("--model", default=None, help="embedded model: HF directory or .gguf file")
    serve.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    serve.add_argument("--device", default=None)
    serve.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_weight_args(serve, None)
    add_chat_template_args(serve)
    serve.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        default=None,
        help="embedded engine: prefill every prompt in full (no reuse of cached prompt blocks)",
    )
    serve.add_argument(
        "--prefix-cache-bytes",
        type=bytes_arg,
        default=None,
        help="most memory cached prompt blocks no request uses may keep (default: any free KV memory)",
    )
    serve.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="embedded engine: batch-invariant kernels, so a greedy answer does not depend on its batch "
        "mates, speculation or prefix-cache hits",
    )
    serve.add_argument(
        "--compile",
        nargs="?",
        const="default",
        default=None,
        metavar="SIZES",
        type=compile_arg,
        help="embedded engine: compile decode / verify steps with torch.compile at start-up (CPU; "
        "~45 s per size on two cores); SIZES: comma-separated token counts (default 1,2,4,8,16), or "
        "'off'",
    )
    serve.add_argument(
        "--engine-thread",
        action="store_true",
        help="run the embedded engine in a thread of one gateway process, not in the shared engine core",
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=None,
        help="gateway processes sharing the port and one engine core (default 1, or SPECGATE_WORKERS)",
    )
    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accepted API key (repeatable; visible to anyone who can list processes: prefer "
        "--api-key-file or SPECGATE_API_KEYS)",
    )
    serve.add_argument("--api-key-file", default=None, help="accepted API keys, one per line")
    serve.set_defaults(func=cmd_serve)


def serve_settings(args: argparse.Namespace) -> Settings:
    """The settings `serve` runs with: the config file and environment, then the flags given."""
    from specgate.gateway.settings import Settings

    overrides = {"host": args.host, "port": args.port, "workers": args.workers}
    settings = Settings.load(args.config, **overrides)
    embedded = {
        k: v
        for k, v in {
            "model": args.model,
            "dtype": args.dtype,
            "device": args.device,
            "threads": args.threads,
            "quantization": args.quantization,
            "model_impl": args.model_impl,
            "prefix_caching": args.prefix_caching,
            "prefix_cache_bytes": args.prefix_cache_bytes,
            "deterministic": args.deterministic,
            "compile_sizes": args.compile,
        }.items()
        if v is not None
    }
    if args.engine_thread and settings.workers > 1 and settings.embedded.enabled:
        raise ValueError("--workers shares one engine core between the workers; drop --engine-thread")
    # A template given here replaces the configured one, whichever way that was given.
    if args.chat_template is not None:
        embedded.update(chat_template=args.chat_template, chat_template_file=None)
    elif args.chat_template_file is not None:
        from specgate.gateway.settings import read_chat_template_file

        embedded.update(
            chat_template=read_chat_template_file(args.chat_template_file), chat_template_file=None
        )
    if embedded:
        settings.embedded = settings.embedded.model_copy(update=embedded)
    if settings.embedded.enabled:
        from specgate.gateway.backends.embedded.chat_template import check_template

        check_template(settings.embedded.chat_template)  # here: before any worker starts
    if args.api_key or args.api_key_file:
        from specgate.gateway.settings import ApiKey, read_key_file

        if args.api_key:
            logger.warning(
                "--api-key puts the key on the command line, where `ps` shows it to every local user; "
                "use --api-key-file or SPECGATE_API_KEYS instead"
            )
        keys = [*args.api_key, *(read_key_file(args.api_key_file) if args.api_key_file else [])]
        settings.api_keys = [ApiKey.model_validate({"key": k}) for k in dict.fromkeys(keys)]
    return settings


def cmd_serve(args: argparse.Namespace) -> int:
    quiet_transformers()
    import uvicorn

    from specgate.gateway.http.app import create_app

    settings = serve_settings(args)
    # Served by a supervisor and its workers (one by default): the telemetry writer then runs in
    # the supervisor, off the GIL of the process that serves requests (its batch inserts held that
    # GIL for ~10 ms every 0.2 s: the p99 of a proxied request). --engine-thread keeps one process.
    supervised = settings.workers > 1 or not args.engine_thread
    if settings.telemetry.enabled:
        preflight_schema(settings, upgrade=supervised)
    if supervised:
        from specgate.gateway.serve.supervisor import serve_workers
        from specgate.gateway.serve.worker import WorkerOptions

        return serve_workers(settings, WorkerOptions(default_cache_dir(), verbose=args.verbose))
    from specgate.gateway.http.connections import uvicorn_options
    from specgate.gateway.serve.announce import announce

    app = create_app(settings, cache_dir=default_cache_dir())
    announce(settings.host, settings.port, "one process", lambda: False)
    uvicorn.run(
        app, host=settings.host, port=settings.port, **uvicorn_options(settings, verbose=args.verbose)
    )
    return 0


def preflight_schema(settings: Settings, *, upgrade: bool = False) -> None:
    """Refuse to start on an outdated telemetry schema with a message, not a traceback. `upgrade`
    (serve --workers N): also upgrade it here where the store would (the embedded default), once,
    so that the workers' stores find it at head instead of racing through one upgrade."""
    from specgate.gateway.telemetry.schema import SchemaOutdatedError, ensure_schema
    from specgate.gateway.telemetry.store import TelemetryStore

    store = TelemetryStore(settings.telemetry)
    try:
        if upgrade or not store.auto_upgrade:
            ensure_schema(store.engine, store.url, auto_upgrade=store.auto_upgrade)
    except SchemaOutdatedError as exc:
        raise ValueError(str(exc)) from None
    except Exception:
        pass  # unreachable now: the gateway starts and spools rows until it is back
    finally:
        store.engine.dispose()


def compile_arg(value: str) -> list[int]:
    """--compile SIZES: comma-separated token counts, or 'off' (none); --compile alone: the default sizes."""
    if value == "default":
        from specgate.engine.config import DEFAULT_COMPILE_SIZES

        return list(DEFAULT_COMPILE_SIZES)
    if value == "off":
        return []
    try:
        sizes = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated token counts or 'off'; got {value!r}") from None
    if not sizes or min(sizes) < 1 or max(sizes) > 256:
        raise argparse.ArgumentTypeError(f"token counts in 1..256; got {value!r}")
    return sizes


def bytes_arg(text: str) -> int:
    """A byte count: digits, optionally with a binary suffix (K, M, G: KiB, MiB, GiB)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = units.get(raw[-1:], 1)
    digits = raw[:-1] if raw[-1:] in units else raw
    if not (digits.isascii() and digits.isdigit()):
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 268435456, 256M, 1G)")
    return int(digits) * scale
