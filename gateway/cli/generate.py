"""`specgate generate`: stream one completion from the embedded engine, with its speed and, when it
speculates, how many drafted tokens were accepted."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from specgate.engine.vocab import CONTROLLERS
from specgate.gateway.cli.common import add_chat_template_args, add_weight_args, quiet_transformers
from specgate.gateway.settings import default_cache_dir


def add_generate_parser(sub: Any) -> None:
    gen = sub.add_parser("generate", help="stream a completion from the embedded engine")
    add_engine_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--system", default=None, help="system message for the chat template")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_chat_template_args(gen)
    gen.add_argument("--spec", default="off", help="speculation method: off, ngram, suffix (default off)")
    gen.add_argument("--spec-controller", default="goodput", choices=list(CONTROLLERS))
    gen.add_argument("--k-max", type=int, default=8, help="longest draft (a tree's depth)")
    gen.add_argument(
        "--max-tree-nodes", type=int, default=16, help="draft tree node budget per step (0: chains only)"
    )
    gen.set_defaults(func=cmd_generate)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2)"
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_weight_args(p, "auto")


def engine_config(args: argparse.Namespace):  # -> EngineConfig, imported lazily (torch is slow to import)
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


def chat_template_arg(args: argparse.Namespace) -> str | None:
    """The configured chat template (--chat-template, or the text of --chat-template-file), checked:
    a bad one is an error before the model loads."""
    from specgate.gateway.backends.embedded.chat_template import check_template
    from specgate.gateway.settings import read_chat_template_file

    template: str | None = args.chat_template
    if args.chat_template_file is not None:
        template = read_chat_template_file(args.chat_template_file)
    check_template(template)
    return template


def cmd_generate(args: argparse.Namespace) -> int:
    quiet_transformers()
    from specgate.engine.engine import Engine
    from specgate.engine.sampling_params import SamplingParams
    from specgate.gateway.backends.embedded.chat_template import chat_template_for, render_chat

    template = chat_template_arg(args)
    engine = Engine(engine_config(args))
    tokenizer = engine.tokenizer
    if args.raw or chat_template_for(tokenizer, template) is None:
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        prompt_ids = render_chat(tokenizer, messages, template=template)
    max_tokens = min(args.max_tokens, engine.max_model_len - len(prompt_ids))
    params = SamplingParams(
        max_tokens=max(1, max_tokens), temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    spec = None
    if args.spec != "off":
        from specgate.engine.vocab import SpecParams

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
    if final is not None and final.stats is not None:
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
