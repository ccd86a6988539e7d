"""The `specgate` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from specgate.gateway.cli.bench import add_bench_parser
from specgate.gateway.cli.eagle import add_eagle_parser
from specgate.gateway.cli.generate import add_generate_parser
from specgate.gateway.cli.policy import add_policy_parser
from specgate.gateway.cli.serve import add_serve_parser

logger = logging.getLogger("specgate")


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specgate", description="Adaptive speculative-decoding gateway")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    add_generate_parser(sub)
    add_serve_parser(sub)

    add_bench_parser(sub)

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
