"""The command-line options of `specgate bench serve`, kept apart from the harness so that building
the `specgate` parser does not import the openai client and the plotting stack."""

from __future__ import annotations

import argparse

from specgate.bench.serve import llama_server
from specgate.bench.serve.datasets import CATEGORIES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="a running gateway (default: start one here)")
    p.add_argument("--model", default=None, help="gateway started here: its embedded model (default SmolLM2)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--compile",
        default=None,
        metavar="SIZES",
        help="gateway started here: `specgate serve --compile SIZES` (e.g. 1,2,4,8,16)",
    )
    p.add_argument("--model-name", default=None, help="model to request (default: the first /v1/models)")
    p.add_argument("--categories", default=",".join(CATEGORIES))
    p.add_argument("--dataset-path", default=None, help="JSONL of prompts instead of the shipped categories")
    p.add_argument("--per-category", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (default) is greedy; with --peer llama-server, prompt i carries seed SEED+i to every arm",
    )
    p.add_argument("--seed", type=int, default=0, help="with --peer llama-server and --temperature > 0")
    p.add_argument("--arms", default="policy,plain,ngram,suffix", help="policy, plain, or a proposer name")
    p.add_argument(
        "--arrival", default="closed", choices=["closed", "poisson", "gamma", "azure-code", "azure-conv"]
    )
    p.add_argument(
        "--concurrency",
        default="1,4",
        help="closed loop: comma-separated load points; with --peer llama-server, 1 sends each prompt "
        "to every arm in rotating order and N > 1 runs each arm in turn, in palindrome order (A B C C B A)",
    )
    p.add_argument("--rate", default="0.5", help="open loop: requests/s, comma-separated load points")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson, < 1 burstier)")
    p.add_argument("--max-concurrency", type=int, default=None, help="open loop cap on requests in flight")
    p.add_argument("--trace-max-context", type=int, default=1024, help="trace replay: cap on prompt tokens")
    p.add_argument("--slo", default="", help="goodput SLOs in ms, e.g. ttft=1000,tpot=100")
    p.add_argument("--hf-baselines", action="store_true", help="batch-1 Hugging Face generate rows")
    p.add_argument("--hf-draft-model", default=None, help="draft model directory for HF assisted generation")
    p.add_argument(
        "--peer",
        choices=["llama-cpp", "llama-server"],
        default=None,
        help="llama.cpp on the same GGUF. llama-cpp: llama-cpp-python's server as one more arm, after "
        "specgate's. llama-server: llama.cpp's own server, plain and speculating, up at once with "
        "specgate's gateway, every prompt to every arm in turn; paired TPOT ratios per class with 95%% "
        "intervals (bench/README.md)",
    )
    p.add_argument(
        "--peer-n-ctx",
        type=int,
        default=4096,
        help="the peer server's context size (llama-server: at least this, and enough per slot)",
    )
    p.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help=f"--peer llama-server: the binary (default ${llama_server.ENV}, else {llama_server.DEFAULT})",
    )
    p.add_argument(
        "--peer-spec",
        default=llama_server.SPEC_DEFAULT,
        metavar="FLAGS",
        help="--peer llama-server: the flags of its speculating arm, written with '=' "
        "(--peer-spec='--spec-type ngram-simple --draft-max 16'; default %(default)s; empty: no such arm)",
    )
    p.add_argument(
        "--requests-in-flight",
        type=int,
        default=None,
        metavar="N",
        help="--peer llama-server: requests per phase at a load point above 1 (default twice the point)",
    )
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode exactly max_tokens in every answer (default: on with --peer, off without)",
    )
    p.add_argument("--out", default="bench-out")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--quick", action="store_true", help="about a minute: 1 prompt per category, short answers"
    )
