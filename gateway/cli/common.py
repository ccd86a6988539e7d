"""What the commands share: quiet, offline transformers, the CPU weight options and the chat template."""

from __future__ import annotations

import argparse
import os


def quiet_transformers() -> None:
    # Weights come from local files only; never let a missing file turn into a hub download.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def add_weight_args(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument(
        "--quantization",
        default=default,
        choices=["auto", "none", "int8", "int4"],
        help="CPU linear weights: auto = the GGUF source's own precision (4-bit layers as int4)",
    )
    p.add_argument("--model-impl", default=default, choices=["auto", "compact", "hf"])


def add_chat_template_args(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--chat-template",
        default=None,
        metavar="NAME|JINJA",
        help="chat template overriding the model's own: a built-in (chatml, llama2, llama3, mistral, "
        "mistral-v7, gemma, phi3, phi4, zephyr, vicuna, deepseek, ...) or a Jinja template",
    )
    group.add_argument(
        "--chat-template-file", default=None, metavar="PATH", help="the chat template from a Jinja file"
    )
