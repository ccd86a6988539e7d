"""What the commands share: quiet, offline transformers and the CPU weight options."""

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
