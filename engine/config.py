"""Engine configuration: one slotted dataclass, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

QUANTIZATION_MODES = ("none", "int8", "int4", "auto")
# The step sizes `specgate serve --compile` compiles: plain decoding (1), verifications of up to 15
# drafts and small batches; larger steps are dominated by their matmuls and run eagerly.
DEFAULT_COMPILE_SIZES = (1, 2, 4, 8, 16)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    # A Hugging Face model directory, a .gguf file, or None for the embedded default model.
    model: str | None = None
    # Which .gguf file inside `model` when `model` is a directory holding GGUF files.
    gguf_file: str | None = None
    # "auto" serves in bfloat16: on CPU verifying several tokens then costs about one decode step.
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    # Memory budget of the paged KV pool; `num_blocks` overrides it with an exact count.
    kv_cache_bytes: int = 512 * 2**20
    num_blocks: int | None = None
    max_num_seqs: int = 64
    # Token budget of one forward pass: long prompts are prefilled in chunks under it.
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    # Where converted GGUF checkpoints are cached as safetensors (None: convert on every load).
    convert_cache_dir: str | None = None
    seed: int = 0
    num_threads: int | None = None
    # Options of speculative proposers by method name, e.g. {"draft_model": {"model": "/path"}};
    # proposers named here are built at start-up, so a bad draft model fails early.
    proposer_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Prepack linear weights for oneDNN on CPU; None: on for bfloat16 / float16 serving on CPU.
    pack_linears: bool | None = None
    # How linear weights are stored (CPU): none, int8, int4, or auto = each tensor at the precision
    # its GGUF source had (dense for other checkpoints). See engine/models/plan.py.
    quantization: str = "auto"
    # auto: the compact decoder for the Llama family (llama, qwen2, mistral), the Hugging Face
    # modules for anything else; compact or hf to force one.
    model_impl: str = "auto"
    # Automatic prefix caching: full KV blocks are kept, keyed by a hash chained over their tokens (and
    # the request's salt), and a prompt that starts with cached blocks skips their prefill.
    prefix_caching: bool = True
    # Most memory that cached blocks no sequence uses may hold (None: any free part of the KV pool).
    prefix_cache_bytes: int | None = None
    # Batch-invariant kernels: a request's greedy output does not depend on its batch mates, the
    # speculation method or K, or prefix-cache hits (engine/batch_invariant.py).
    deterministic: bool = False
    # Constrained requests draft the tokens their grammar forces (free drafts, verified like any
    # other; engine/structured_output/constraint.py). Off: each forced token takes its own step
    # (for comparison).
    forced_drafts: bool = True
    # Token counts of the steps compiled with torch.compile on CPU (engine/models/compiled.py): a step
    # of n tokens runs the graph of the smallest size >= n, padded; larger steps run eagerly. Empty:
    # nothing is compiled. Compact decoder only; off in deterministic mode.
    compile_sizes: tuple[int, ...] = ()
    # Time forward passes of 1-64 tokens once the model is loaded (Engine.warm_up), so that the
    # draft-length controller's step-cost curve is measured before the first batch drafts on it.
    warm_up: bool = False
    # Whether `dtype` was "auto" (the runner may then pick float32 activations: with every weight
    # matrix on the GGUF kernels, the activations' dtype costs no speed and float32 is exact-er).
    dtype_auto: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be cpu or cuda[:N]; got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device is cuda but torch sees no CUDA device")
        if self.dtype == "auto":
            self.dtype = _auto_dtype(self.device)
            self.dtype_auto = True
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.pack_linears is None:
            self.pack_linears = self.device == "cpu" and self.dtype != "float32"
        if self.pack_linears and self.device != "cpu":
            raise ValueError("pack_linears is a CPU optimisation")
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_MODES)}; got {self.quantization!r}"
            )
        if self.quantization in ("int8", "int4") and self.device != "cpu":
            raise ValueError(
                "int8 / int4 weights use torch's CPU kernels; on a GPU use quantization none or auto"
            )
        if self.quantization in ("int8", "int4") and self.dtype == "float16":
            raise ValueError("int8 / int4 weights run with float32 or bfloat16 activations")
        if self.model_impl not in ("auto", "compact", "hf"):
            raise ValueError(f"model_impl must be auto, compact or hf; got {self.model_impl!r}")
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes < 0:
            raise ValueError("prefix_cache_bytes must be >= 0")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        self.compile_sizes = tuple(sorted(set(self.compile_sizes)))
        if self.compile_sizes and not 1 <= self.compile_sizes[0] <= self.compile_sizes[-1] <= 256:
            raise ValueError(f"compile_sizes must lie in 1..256; got {list(self.compile_sizes)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


def _auto_dtype(device: str) -> str:
    if device == "cpu":
        # Decoding streams the weights once per step, so half the bytes wins: bf16 beat fp32 even on
        # an AVX2-only CPU where torch emulates it (SmolLM2-135M: 18 vs 10 tok/s), and on CPUs with
        # native bf16 verifying k tokens costs about one decode step.
        return "bfloat16"
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
