"""`specgate bench ...`: every benchmark of specgate.bench, one subcommand each.

A benchmark is a module of specgate.bench with `add_arguments(parser)` and `run(args) -> int` (or,
where a module holds two, `add_<entry>_arguments` and `<entry>`). The registry below names them;
a benchmark's module is imported only when its subcommand is parsed
(`_LazyParser`), so that building the `specgate` parser (for `specgate serve` too) imports no bench
code and no torch, and `specgate bench --help` lists them all from the registry alone.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Benchmark:
    name: str  # the subcommand
    module: str  # under specgate.bench
    help: str
    entry: str = "run"  # the module's function that runs it (its options: add_<entry>_arguments)

    @property
    def arguments(self) -> str:
        """The module's function that adds the benchmark's options to its parser."""
        return "add_arguments" if self.entry == "run" else f"add_{self.entry}_arguments"

    def __post_init__(self) -> None:
        if not self.name or not self.module.isidentifier() or not self.entry.isidentifier():
            raise ValueError(f"a benchmark needs a name and a module name: {self}")


BENCHMARKS = (
    Benchmark("serve", "serve", "replay workloads through a live gateway (or beside llama.cpp, --peer)"),
    Benchmark("engine", "engine", "the engine's decode speed beside llama.cpp and the served path"),
    Benchmark("spec", "spec", "speculation arms per class: chains, trees, fixed K, EAGLE, a draft model"),
    Benchmark("steps", "steps", "what a forward pass costs by its new tokens, and the machine's int8 roof"),
    Benchmark("regime", "regime", "where speculation stops paying by batch, measured and as the policy says"),
    Benchmark("quality", "quality", "each weight mode's quality and speed against a float32 reference"),
    Benchmark(
        "determinism",
        "engine_checks",
        "what deterministic mode costs and what it buys",
        entry="determinism",
    ),
    Benchmark(
        "prefix-cache",
        "engine_checks",
        "TTFT of turns that resend a prefix, prefix caching on and off",
        entry="prefix_cache",
    ),
    Benchmark("families", "families", "each model family's GGUF file: llama-server against specgate serve"),
    Benchmark(
        "structured", "structured", "structured outputs served: validity and speed, beside llama-server"
    ),
    Benchmark("policy", "policy", "the routing policy under the Azure traces against every static arm"),
    Benchmark("pools", "pools", "external pools as routing arms, and prefix-aware replica choice"),
    Benchmark("gateway", "gateway", "what the gateway adds over its backend, beside LiteLLM"),
    Benchmark("telemetry", "telemetry", "the telemetry writer's insert rate on SQLite and PostgreSQL"),
    Benchmark("soak", "soak", "sustained hostile load with failures; reports what was lost"),
    Benchmark(
        "exhaustion",
        "soak",
        "a victim tenant streams while other clients try to exhaust the gateway",
        entry="exhaustion",
    ),
    Benchmark(
        "request-path",
        "in_app",
        "the project files one chat request passes through, in order",
        entry="request_path",
    ),
    Benchmark(
        "screenshots",
        "in_app",
        "the operator dashboard's pages as PNG files for the docs",
        entry="screenshots",
    ),
    Benchmark("stub", "stub", "run the stub OpenAI-compatible server the benchmarks put behind gateways"),
    Benchmark("models", "models", "fetch the real GGUF models the benchmarks name"),
)


class _LazyParser(argparse.ArgumentParser):
    """A benchmark's parser: its arguments and its `run` come from its module on first use."""

    benchmark: Benchmark | None = None

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self.benchmark is not None:
            b, self.benchmark = self.benchmark, None
            module: Any = importlib.import_module(f"specgate.bench.{b.module}")
            getattr(module, b.arguments)(self)
            self.set_defaults(func=getattr(module, b.entry))
        return super().parse_known_args(args, namespace)


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks (specgate bench --help lists them)")
    commands = bench.add_subparsers(
        dest="bench_command", required=True, metavar="BENCHMARK", parser_class=_LazyParser
    )
    for b in BENCHMARKS:
        commands.add_parser(b.name, help=b.help, description=b.help).benchmark = b
