"""The `specgate` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from specgate.engine.spec_decode.params import CONTROLLERS
from specgate.gateway.cli.eagle import add_eagle_parser
from specgate.gateway.cli.policy import add_policy_parser
from specgate.gateway.settings import default_cache_dir

if TYPE_CHECKING:
    from specgate.gateway.settings import Settings

logger = logging.getLogger("specgate")


def _quiet_transformers() -> None:
    # Weights come from local files only; never let a missing file turn into a hub download.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _add_weight_args(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument(
        "--quantization",
        default=default,
        choices=["auto", "none", "int8", "int4"],
        help="CPU linear weights: auto = the GGUF source's own precision (4-bit layers as int4)",
    )
    p.add_argument("--model-impl", default=default, choices=["auto", "compact", "hf"])


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2)"
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    _add_weight_args(p, "auto")


def _engine_config(args: argparse.Namespace):  # -> EngineConfig, imported lazily (torch is slow to import)
    from specgate.engine.config import EngineConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        num_threads=args.threads,
        quantization=args.quantization,
        model_impl=args.model_impl,
        convert_cache_dir=default_cache_dir(),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    _quiet_transformers()
    from specgate.engine.engine import Engine
    from specgate.engine.sampling_params import SamplingParams
    from specgate.gateway.backends.embedded.chat_template import render_chat

    engine = Engine(_engine_config(args))
    tokenizer = engine.tokenizer
    if args.raw or getattr(tokenizer, "chat_template", None) is None:
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        prompt_ids = render_chat(tokenizer, messages)
    max_tokens = min(args.max_tokens, engine.max_model_len - len(prompt_ids))
    params = SamplingParams(
        max_tokens=max(1, max_tokens), temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    spec = None
    if args.spec != "off":
        from specgate.engine.spec_decode.params import SpecParams

        spec = SpecParams(
            method=args.spec,
            controller=args.spec_controller,
            k_max=args.k_max,
            max_tree_nodes=args.max_tree_nodes,
        )
    engine.add_request("cli", prompt_ids, params, spec)
    start = time.perf_counter()
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            if out.finished:
                final = out
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    if final is not None:
        n = final.stats.num_output_tokens
        line = f"{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s, finish_reason={final.finish_reason}"
        if final.stats.spec is not None:
            st = final.stats.spec
            line += (
                f", {st.method}: {st.num_accepted_tokens}/{st.num_draft_tokens} drafts accepted,"
                f" {st.mean_acceptance_length:.2f} tokens per verification"
            )
        sys.stderr.write(f"[{line}]\n")
    return 0


def _compile_arg(value: str) -> list[int]:
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
    if args.engine_thread:
        embedded["engine_process"] = False
    elif settings.embedded.engine_process is None:
        embedded["engine_process"] = True  # serving: the engine in its own process unless configured
    if embedded:
        settings.embedded = settings.embedded.model_copy(update=embedded)
    if args.api_key:
        from pydantic import SecretStr

        settings.api_keys = [SecretStr(k) for k in args.api_key]
    return settings


def cmd_serve(args: argparse.Namespace) -> int:
    _quiet_transformers()
    import uvicorn

    from specgate.gateway.http.app import create_app

    settings = serve_settings(args)
    # Served by a supervisor and its workers (one by default): the telemetry writer then runs in
    # the supervisor, off the GIL of the process that serves requests (its batch inserts held that
    # GIL for ~10 ms every 0.2 s: the p99 of a proxied request). --engine-thread keeps one process.
    supervised = settings.workers > 1 or settings.embedded.engine_process is not False
    if settings.telemetry.enabled:
        _preflight_schema(settings, upgrade=supervised)
    if supervised:
        from specgate.gateway.cli.worker_process import WorkerOptions
        from specgate.gateway.cli.workers import serve_workers

        return serve_workers(settings, WorkerOptions(default_cache_dir(), verbose=args.verbose))
    app = create_app(settings, cache_dir=default_cache_dir())
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info" if args.verbose else "warning",
        access_log=args.verbose,
        timeout_graceful_shutdown=10,
        timeout_keep_alive=settings.keep_alive_timeout,
        # X-Forwarded-For is the gateway's to judge (settings.trusted_proxies): uvicorn would trust
        # it from any loopback peer, letting a local client pose as any address.
        proxy_headers=False,
    )
    return 0


def _preflight_schema(settings: Settings, *, upgrade: bool = False) -> None:
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


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from specgate.bench.serve.harness import run

    return run(args)


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from specgate.bench.soak import run

    return run(args)


def cmd_db(args: argparse.Namespace) -> int:
    from specgate.gateway.telemetry import schema

    url = args.url or os.environ.get("SPECGATE_TELEMETRY__URL") or schema.default_url()
    if args.action == "upgrade":
        schema.upgrade(url, args.revision or "head")
    elif args.action == "downgrade":
        if not args.revision:
            raise ValueError("downgrade needs a revision: a revision id, -1, or base")
        schema.downgrade(url, args.revision)
    engine = schema.make_engine(url)
    try:
        current = schema.current_revision(engine)
    finally:
        engine.dispose()
    head = schema.head_revision(url)
    sys.stdout.write(f"current: {current or 'none (empty)'}  head: {head}\n")
    return 0


def _bytes_arg(text: str) -> int:
    """A byte count: digits, optionally with a binary suffix (K, M, G: KiB, MiB, GiB)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = units.get(raw[-1:], 1)
    digits = raw[:-1] if raw[-1:] in units else raw
    if not (digits.isascii() and digits.isdigit()):
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 268435456, 256M, 1G)")
    return int(digits) * scale


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specgate", description="Adaptive speculative-decoding gateway")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a completion from the embedded engine")
    _add_engine_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--system", default=None, help="system message for the chat template")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--spec", default="off", help="speculation method: off, ngram, suffix (default off)")
    gen.add_argument("--spec-controller", default="goodput", choices=list(CONTROLLERS))
    gen.add_argument("--k-max", type=int, default=8, help="longest draft (a tree's depth)")
    gen.add_argument(
        "--max-tree-nodes", type=int, default=16, help="draft tree node budget per step (0: chains only)"
    )
    gen.set_defaults(func=cmd_generate)

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
    _add_weight_args(serve, None)
    serve.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        default=None,
        help="embedded engine: prefill every prompt in full (no reuse of cached prompt blocks)",
    )
    serve.add_argument(
        "--prefix-cache-bytes",
        type=_bytes_arg,
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
        type=_compile_arg,
        help="embedded engine: compile decode / verify steps with torch.compile at start-up (CPU; "
        "~45 s per size on two cores); SIZES: comma-separated token counts (default 1,2,4,8,16), or "
        "'off'",
    )
    serve.add_argument(
        "--engine-thread",
        action="store_true",
        help="run the embedded engine in a thread of the server, not its own process",
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=None,
        help="gateway processes sharing the port and one engine core (default 1, or SPECGATE_WORKERS)",
    )
    serve.add_argument("--api-key", action="append", default=[], help="accepted API key (repeatable)")
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    bench_serve = bench.add_parser("serve", help="replay workloads through a live gateway and report")
    from specgate.bench.serve.options import add_arguments

    add_arguments(bench_serve)
    bench_serve.set_defaults(func=cmd_bench_serve)
    soak = bench.add_parser("soak", help="sustained hostile load with failures; reports what was lost")
    from specgate.bench.soak import add_arguments as add_soak_arguments

    add_soak_arguments(soak)
    soak.set_defaults(func=cmd_bench_soak)

    db = sub.add_parser("db", help="telemetry database schema (Alembic)")
    db.add_argument("action", choices=["upgrade", "downgrade", "current"])
    db.add_argument("revision", nargs="?", default=None, help="target revision (upgrade: default head)")
    db.add_argument(
        "--url", default=None, help="database URL (default $SPECGATE_TELEMETRY__URL or the SQLite file)"
    )
    db.set_defaults(func=cmd_db)
    add_policy_parser(sub)
    add_eagle_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s %(message)s"
    )
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:
        sys.stderr.write(f"specgate: error: {exc}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
