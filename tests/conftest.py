"""Shared fixtures: a tiny ASCII tokenizer and tiny random-weight Llama / Qwen2 checkpoints."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from specgate.engine.config import EngineConfig
from specgate.engine.engine import Engine

EOS = "<eos>"
VOCAB_SIZE = 96  # 95 printable ASCII characters + <eos>


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer over printable ASCII, one token per character: every output decodes cleanly."""
    to_unicode = pre_tokenizers.ByteLevel.alphabet()
    byte_map = {b: c for b, c in zip(range(256), _bytes_to_unicode(), strict=True)}
    assert set(byte_map.values()) == set(to_unicode)
    vocab = {byte_map[b]: i for i, b in enumerate(range(32, 127))}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


# A short chat template (the tokenizer spends one token per character).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def _bytes_to_unicode() -> list[str]:
    # GPT-2's reversible byte -> printable character table, in byte order.
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


def _save_tiny(path: Path, model: torch.nn.Module) -> Path:
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def tiny_config_kwargs() -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # Larger than the default 0.02 so that greedy choices are clear, not near-ties.
        initializer_range=0.3,
        eos_token_id=VOCAB_SIZE - 1,
        bos_token_id=VOCAB_SIZE - 1,
        pad_token_id=VOCAB_SIZE - 1,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="session", autouse=True)
def _private_data_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Telemetry databases and spools of gateways under test go to a temporary directory."""
    os.environ["SPECGATE_DATA_DIR"] = str(tmp_path_factory.mktemp("specgate-data"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs()))
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), model)


@pytest.fixture(scope="session")
def tiny_draft_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with noise on every weight: a draft model that is often, not always, right."""
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.15 * p.std())
    return _save_tiny(tmp_path_factory.mktemp("tiny-draft"), model)


@pytest.fixture(scope="session")
def tiny_eagle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random EAGLE head for the tiny Llama, saved in the published EAGLE-1 layout."""
    from specgate.engine.spec_decode.eagle_head import EagleConfig, EagleHead
    from specgate.engine.spec_decode.eagle_io import save_head

    torch.manual_seed(3)
    head = EagleHead(EagleConfig.for_target(LlamaConfig(**tiny_config_kwargs())))
    out = tmp_path_factory.mktemp("tiny-eagle")
    save_head(head, out)
    return out


@pytest.fixture(scope="session")
def tiny_fixed_point_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama whose attention output is zeroed: each token determines the next, so greedy output
    soon settles into a repeating pattern, which n-gram and suffix drafts then predict."""
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs()))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return _save_tiny(tmp_path_factory.mktemp("tiny-fixed-point"), model)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(Qwen2Config(**tiny_config_kwargs(), use_sliding_window=False))
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen2"), model)


@pytest.fixture
def make_engine(tiny_llama_dir: Path) -> Callable[..., Engine]:
    """Build an fp32 CPU engine on the tiny Llama (or `model=` another directory)."""

    def make(**overrides: object) -> Engine:
        kwargs: dict = dict(
            model=str(tiny_llama_dir), dtype="float32", device="cpu", block_size=4, num_blocks=256
        )
        kwargs.update(overrides)
        return Engine(EngineConfig(**kwargs))

    return make
