"""`specgate bench`: the real parser lists every registered benchmark, each parses its own arguments
and runs its module's `run`, and no bench module is imported until one is chosen."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

from specgate.gateway.cli.bench import BENCHMARKS, Benchmark
from specgate.gateway.cli.main import build_parser, main


def test_bench_help_lists_every_registered_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    listed = re.findall(r"^    (\S+)", out.split("positional arguments:")[1], re.M)
    assert listed == [b.name for b in BENCHMARKS]
    assert len({b.name for b in BENCHMARKS}) == len(BENCHMARKS)


@pytest.mark.parametrize("bench", BENCHMARKS, ids=[b.name for b in BENCHMARKS])
def test_every_benchmark_parses_its_own_arguments(
    bench: Benchmark, capsys: pytest.CaptureFixture[str]
) -> None:
    module = importlib.import_module(f"specgate.bench.{bench.module}")
    with pytest.raises(SystemExit) as done:
        main(["bench", bench.name, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: specgate bench {bench.name}")
    args = build_parser().parse_args(["bench", bench.name, *_required(bench.name)])
    assert args.func is getattr(module, bench.entry) and args.bench_command == bench.name


def _required(name: str) -> list[str]:
    """The positional arguments of the benchmarks that take some."""
    return {"families": ["serve"], "models": ["path", "qwen2.5-coder-0.5b"]}.get(name, [])


def test_building_the_parser_imports_no_bench_code_and_no_torch() -> None:
    code = (
        "import sys; from specgate.gateway.cli.main import build_parser; build_parser();"
        "print(sorted(m for m in sys.modules if m.startswith('specgate.bench') or m == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_registry_entry_names_a_module_and_its_entry() -> None:
    with pytest.raises(ValueError):
        Benchmark("x", "no-such-module", "help")
    with pytest.raises(ValueError):
        Benchmark("x", "soak", "help", entry="not-a-name")
    assert Benchmark("x", "soak", "help").arguments == "add_arguments"
    assert Benchmark("x", "soak", "help", entry="exhaustion").arguments == "add_exhaustion_arguments"
