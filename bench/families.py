"""`specgate bench families`: every common model family served by specgate beside llama.cpp's own
`llama-server`, on the same random-weight GGUF files at the real models' shapes.
(bench/README.md, "What each benchmark does", has the method.)
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specgate.bench import interleaved, launch, serve, workload
from specgate.bench.stats import number, table, times
from specgate.bench.workload import DATA

FILES_DIR = launch.LLAMA_BIN.parents[2] / "bench-families"
QUANT = "Q4_K_M"
# Token types as gguf writes them (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
Typed = Sequence[tuple[str, int]]  # tokens, each with its type
# The start-up lines that say how specgate serves the model (engine/models/build.py).
PATH_LINE = re.compile(
    r"(served on the native GGUF kernels.*|served by the Hugging Face modules.*"
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
    write_head_dim: bool = True  # attention.key_length / value_length (when config.json has head_dim)
    qk_norm: bool = False
    sandwich: bool = False  # Gemma 3: norms after attention and after the MLP too
    fused: bool = False  # Phi-3: attn_qkv and a gate/up ffn_up
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific keys, without the arch prefix
    chat_template: str | None = None  # None: the source vocabulary's (Qwen's)
    notes: str = ""


FAMILIES = {
    name: Family(name, **spec) for name, spec in json.loads((DATA / "families.json").read_text()).items()
}


def gguf_path(directory: Path, family: str) -> Path:
    return directory / f"{family}-{QUANT}.gguf"


# ---- vocabularies ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Vocab:
    tokens: list[str]
    types: list[int]
    bos: int
    eos: int
    scores: list[float] | None = None
    merges: list[str] | None = None
    model: str = "llama"  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str = "default"
    add_bos: bool = True
    add_space_prefix: bool | None = None
    unk: int | None = None
    pad: int | None = None
    chat_template: str = ""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to the printable characters byte-level vocabularies are spelled in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in bs]
    return {b: chr(c) for b, c in zip(bs + rest, bs + [256 + n for n in range(len(rest))], strict=True)}


@dataclass(slots=True)
class SourceVocab:
    """The Qwen2.5 GGUF's byte-level BPE vocabulary: token i >= 256 is made by merge i - 256."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    chat_template: str

    @classmethod
    def load(cls) -> SourceVocab:
        from gguf import GGUFReader

        from specgate.bench.models import fetch

        fields = GGUFReader(fetch("qwen2.5-coder-0.5b")).fields
        return cls(
            list(fields["tokenizer.ggml.tokens"].contents()),
            [int(t) for t in fields["tokenizer.ggml.token_type"].contents()],
            list(fields["tokenizer.ggml.merges"].contents()),
            str(fields["tokenizer.chat_template"].contents()),
        )

    def pieces(self) -> Iterator[str]:
        """The BPE tokens that are whole UTF-8 text as SentencePiece pieces (spaces as U+2581)."""
        decode = {c: b for b, c in bytes_to_unicode().items()}
        for token in self.tokens[: len(self.merges) + 256]:
            try:
                text = bytes(decode[c] for c in token).decode("utf-8")
            except (KeyError, UnicodeDecodeError):
                continue
            if text.isprintable() or not text.strip(" \n\t"):
                yield text.replace(" ", "\u2581")


def qwen3_vocab(src: SourceVocab, size: int) -> Vocab:
    """Qwen2.5's vocabulary, which Qwen3 shares, with Qwen3's four added tokens, padded as its GGUFs are."""
    tokens, types = list(src.tokens), list(src.types)
    first = tokens.index("[PAD151665]")
    for i, t in enumerate(["<tool_response>", "</tool_response>", "<think>", "</think>"]):
        tokens[first + i], types[first + i] = t, USER_DEFINED
    v = Vocab(tokens[:size], types[:size], 151643, 151645, merges=list(src.merges), model="gpt2", pre="qwen2")
    v.add_bos, v.pad, v.chat_template = False, 151643, src.chat_template
    return v


def llama3_vocab(src: SourceVocab, size: int) -> Vocab:
    """A byte-level BPE of 128,000 tokens (the source's first, with the merges that make them) and
    Llama 3's 256 special tokens at their ids."""
    bpe = size - 256
    named = ["begin_of_text", "end_of_text", "", "", "finetune_right_pad_id", "", "start_header_id"]
    named += ["end_header_id", "eom_id", "eot_id", "python_tag"]
    reserved = iter(range(256))
    specials = [
        f"<|{named[i]}|>" if i < len(named) and named[i] else f"<|reserved_special_token_{next(reserved)}|>"
        for i in range(256)
    ]
    types = [NORMAL] * bpe + [CONTROL] * 256
    merges = src.merges[: bpe - 256]
    return Vocab(
        src.tokens[:bpe] + specials, types, bpe, bpe + 9, merges=merges, model="gpt2", pre="llama-bpe"
    )


def spm_vocab(
    src: SourceVocab, size: int, head: Typed, tail: Typed = (), pad_to: int | None = None
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
    padding = max(0, (pad_to or 0) - len(tokens))
    tokens += [f"[PAD{n}]" for n in range(len(tokens), len(tokens) + padding)]
    return tokens, types + [UNUSED] * padding, scores + [-10000.0] * padding


def mistral_vocab(src: SourceVocab, size: int) -> Vocab:
    """Mistral v0.3's layout: <unk> <s> </s>, 768 control tokens, 256 bytes, then pieces."""
    controls = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]
    controls += ["[TOOL_RESULTS]", "[/TOOL_RESULTS]"] + [f"[control_{i}]" for i in range(8, 769)]
    head = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)] + [(c, CONTROL) for c in controls]
    tokens, types, scores = spm_vocab(src, size, head)
    return Vocab(tokens, types, 1, 2, scores, unk=0, add_space_prefix=True)


def phi3_vocab(src: SourceVocab, size: int) -> Vocab:
    """Llama 2's 32,000 (<unk> <s> </s>, bytes, pieces), Phi-3's 11 added tokens, padded to 32,064."""
    added = ["<|endoftext|>", "<|assistant|>"] + [f"<|placeholder{i}|>" for i in range(1, 5)]
    added += ["<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"]
    head = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)]
    tokens, types, scores = spm_vocab(src, 32000 + len(added), head, [(t, CONTROL) for t in added], size)
    return Vocab(tokens, types, 1, 32000, scores, add_bos=False, add_space_prefix=False, unk=0, pad=32000)


def gemma3_vocab(src: SourceVocab, size: int) -> Vocab:
    """Gemma 3's layout: <pad> <eos> <bos> <unk> <mask>, unused tokens, turn markers, bytes, pieces."""
    head = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN)]
    head += [("<mask>", USER_DEFINED), ("[multimodal]", USER_DEFINED)]
    head += [(f"<unused{i}>", USER_DEFINED) for i in range(99)]
    head += [("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL)]
    tokens, types, scores = spm_vocab(src, size, head)
    return Vocab(tokens, types, 2, 1, scores, add_space_prefix=False, unk=3, pad=0)


VOCABS: dict[str, Callable[[SourceVocab, int], Vocab]] = {"qwen3": qwen3_vocab, "gemma3": gemma3_vocab}
VOCABS |= {"phi3": phi3_vocab, "mistral": mistral_vocab, "llama3": llama3_vocab}


# ---- weights and the file ----------------------------------------------------------------------------


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
    q, kv, h = f.heads * f.head_dim, f.kv_heads * f.head_dim, f.hidden
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (f.vocab, h))]
    if f.name == "llama3":
        out.append(("rope_freqs.weight", (f.head_dim // 2,)))
    for i in range(f.layers):
        layer: list[tuple[str, tuple[int, ...]]] = [("attn_norm", (h,))]
        if f.fused:
            layer.append(("attn_qkv", (q + 2 * kv, h)))
        else:
            layer += [("attn_q", (q, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h))]
        if f.qk_norm:
            layer += [("attn_q_norm", (f.head_dim,)), ("attn_k_norm", (f.head_dim,))]
        layer += [("attn_output", (h, q)), *([("post_attention_norm", (h,))] if f.sandwich else [])]
        layer.append(("ffn_norm", (h,)))
        if f.fused:
            layer.append(("ffn_up", (2 * f.ff, h)))
        else:
            layer += [("ffn_gate", (f.ff, h)), ("ffn_up", (f.ff, h))]
        layer += [("ffn_down", (h, f.ff)), *([("post_ffw_norm", (h,))] if f.sandwich else [])]
        out += [(f"blk.{i}.{name}.weight", shape) for name, shape in layer]
    out.append(("output_norm.weight", (h,)))
    return out if f.tied else [*out, ("output.weight", (f.vocab, h))]


def write_f16(f: Family, vocab: Vocab, path: Path, seed: int = 0, std: float = 0.02) -> None:
    """The family's GGUF with random F16 matrices (F32 norms, as convert_hf_to_gguf writes them)."""
    import numpy as np
    from gguf import GGUFWriter, LlamaFileType

    if len(vocab.tokens) != f.vocab:
        raise AssertionError(f"{f.name}: vocabulary of {len(vocab.tokens)}, expected {f.vocab}")
    w = GGUFWriter(str(path), f.arch)
    w.add_type("model")
    w.add_name(f.model_name)
    keys: dict[str, Any] = {"context_length": f.context, "embedding_length": f.hidden}
    keys |= {"block_count": f.layers, "feed_forward_length": f.ff, "attention.head_count": f.heads}
    keys |= {"attention.head_count_kv": f.kv_heads, "attention.layer_norm_rms_epsilon": f.eps}
    keys["rope.freq_base"] = f.rope_theta
    if f.write_head_dim:
        keys |= {"attention.key_length": f.head_dim, "attention.value_length": f.head_dim}
    for key, value in {**keys, **f.extra}.items():  # the family's keys, without the arch prefix
        if isinstance(value, float):
            w.add_float32(f"{f.arch}.{key}", value)
        else:
            w.add_uint32(f"{f.arch}.{key}", int(value))
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
    from gguf import GGUFReader

    out = Path(args.dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    if not (quantize := Path(args.llama_bin).expanduser() / "llama-quantize").is_file():
        raise FileNotFoundError(f"{quantize}: build llama.cpp's tools first\n{launch.RECIPE}")
    src = SourceVocab.load()
    for name in _families(args.families):
        fam, target, f16 = FAMILIES[name], gguf_path(out, name), out / f"{name}-F16.gguf"
        if target.is_file() and not args.force:
            print(f"{name}: {target} exists")
            continue
        t0 = time.monotonic()
        vocab = VOCABS[name](src, fam.vocab)
        vocab.chat_template = fam.chat_template or vocab.chat_template
        write_f16(fam, vocab, f16, seed=args.seed)
        t1 = time.monotonic()
        with (out / f"{name}-quantize.log").open("wb") as fh:
            cmd = [str(quantize), str(f16), str(target), QUANT, str(args.threads)]
            subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=True, timeout=args.timeout)
        if not args.keep_f16:
            f16.unlink()
        counts = Counter(t.tensor_type.name for t in GGUFReader(target).tensors)
        types = ", ".join(f"{n} {k}" for k, n in counts.most_common())
        print(
            f"{name}: {target} ({target.stat().st_size / 1e6:.0f} MB; F16 written in {t1 - t0:.0f} s, "
            f"quantized in {time.monotonic() - t1:.0f} s; {types})"
        )
    return 0


def _families(spec: str) -> list[str]:
    names = [n for n in spec.split(",") if n]
    if unknown := set(names) - set(FAMILIES):
        raise ValueError(f"unknown families {sorted(unknown)}; known: {', '.join(FAMILIES)}")
    return names


# ---- serving -----------------------------------------------------------------------------------------


def serve_families(args: argparse.Namespace) -> int:
    """Each family's file as `bench serve --peer llama-server` measures it, one after the other."""
    directory = Path(args.dir).expanduser()
    out = Path(args.out).expanduser() / time.strftime("%Y%m%d-%H%M%S")
    cats = [c for c in workload.CATEGORIES if c != "tool_call"]  # the simple templates render no tools
    reqs = workload.shipped(8, args.max_tokens, cats, args.max_prompt_tokens)[: args.requests]
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    rows = []
    for name in _families(args.families):
        if not (path := gguf_path(directory, name)).is_file():
            raise FileNotFoundError(f"{path}: run `specgate bench families make` first")
        run = parser.parse_args(["--model", str(path), "--arms", "plain", "--peer", "llama-server"])
        run.peer_spec, run.ignore_eos, run.threads, run.max_tokens = "", True, args.threads, args.max_tokens
        run.llama_server = str(Path(args.llama_bin).expanduser() / "llama-server")
        run.concurrency, run.requests_in_flight, run.out = args.in_flight, args.requests_in_flight, out / name
        code = interleaved.run_peers(run, reqs)
        report = json.loads((out / name / "report.json").read_text())
        log = (out / name / "specgate.gateway.log").read_text(errors="replace")
        rows.append({"family": name, "code": code, "path": PATH_LINE.findall(log), **report})
    (out / "families.json").write_text(json.dumps(rows, indent=2, default=str))
    print("\n".join(markdown(rows)) + f"\nreport: {out / 'families.json'}")
    return 1 if any(r["code"] for r in rows) else 0


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """One row per family: TPOT at 1 in flight and their paired ratio, aggregate tok/s at the first
    load above 1 (each of its two phases) and its ratio."""
    out = []
    for r in rows:
        points = {p["in_flight"]: p for p in r["points"] if "error" not in p}
        one = points.get(1, {})
        pairs = [p for p in one.get("pairs", []) if p["reference"] == interleaved.LLAMA]
        ratio = pairs[0]["all"] if pairs else {}
        many: dict[str, Any] = next((p for n, p in sorted(points.items()) if n > 1), {})
        tpot = {arm: s.get("tpot_p50_ms") for arm, s in one.get("arms", {}).items()}
        rates = {arm: ", ".join(map(number, s.get("tok_s", []))) for arm, s in many.get("arms", {}).items()}
        path = "; ".join(r["path"]) or "?"
        path = (
            "native" if "served on the native" in path else "HF modules" if "Hugging Face" in path else path
        )
        row = [r["family"], path, number(r.get("specgate_ready_s"))]
        row += [number(tpot.get(interleaved.LLAMA)), number(tpot.get("plain"))]
        row.append(times(ratio.get("ratio"), ratio.get("low"), ratio.get("high")))
        row += [rates.get(interleaved.LLAMA) or "-", rates.get("plain") or "-"]
        out.append([*row, times(many.get("ratios", {}).get(interleaved.LLAMA, {}).get("plain"))])
    head = ["family", "specgate path", "specgate ready s", "TPOT llama-server ms", "TPOT specgate ms"]
    head += ["llama-server / specgate, paired", "N in flight tok/s llama-server", "specgate"]
    return table([*head, "specgate / llama-server"], out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="families_action", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", default=str(FILES_DIR), help="the family files (default %(default)s)")
    common.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all)")
    common.add_argument("--llama-bin", default=str(launch.LLAMA_BIN), help="llama.cpp's built tools")
    common.add_argument("--threads", type=int, default=2, help="for llama-server, llama-quantize, specgate")
    m = sub.add_parser("make", parents=[common], help="write the random-weight GGUF files, as Q4_K_M")
    m.add_argument("--force", action="store_true", help="rewrite files that exist")
    m.add_argument("--keep-f16", action="store_true")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--timeout", type=float, default=1800, help="seconds for one llama-quantize")
    s = sub.add_parser("serve", parents=[common], help="llama-server against specgate serve, per family")
    s.add_argument("--in-flight", default="1,16", help="load points: 1 (interleaved) and N (A-B-B-A)")
    s.add_argument("--requests", type=int, default=8, help="prompts (at 1 in flight, each to both)")
    s.add_argument("--requests-in-flight", type=int, help="requests per phase at N (default 2N)")
    s.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (exactly: ignore_eos)")
    s.add_argument("--max-prompt-tokens", type=int, default=400, help="longest prompt, in ~4-char tokens")
    s.add_argument("--out", default=str(FILES_DIR / "runs"), help="per run: logs and families.json")


def run(args: argparse.Namespace) -> int:
    return make(args) if args.families_action == "make" else serve_families(args)
