"""EAGLE heads on disk, in the published EAGLE-1 / EAGLE-2 layout: a directory with `config.json`
(a Llama config with one layer) and `model.safetensors` or `pytorch_model.bin` holding `fc.*` and
`layers.0.*` (plus, in some releases, a copy of the embeddings, which the target's replace).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specgate.engine.spec_decode.eagle_head import EagleConfig, EagleHead

# Copies of the target's own tensors some releases ship; the head uses the target's instead.
SHARED_KEYS = ("embed_tokens.weight", "lm_head.weight")
DRAFT_VOCAB = "draft_vocab"  # specgate's optional addition: int64 [n] token ids drafts come from
DEFAULT_HEADS = Path(__file__).resolve().parents[1] / "data" / "eagle"


def default_head_dir(model_name: str) -> Path | None:
    """The head shipped in the package for a target model, if there is one."""
    path = DEFAULT_HEADS / model_name
    return path if (path / "config.json").exists() else None


def _state_dict(directory: Path) -> dict[str, torch.Tensor]:
    safetensors = directory / "model.safetensors"
    if safetensors.exists():
        return load_file(str(safetensors))
    for name in ("pytorch_model.bin", "model.bin"):
        path = directory / name
        if path.exists():
            state = torch.load(path, map_location="cpu", weights_only=True)
            return {str(k): v for k, v in state.items()}
    raise FileNotFoundError(f"{directory} holds no model.safetensors or pytorch_model.bin")


def load_head(directory: str | Path, hidden_size: int, vocab_size: int) -> tuple[EagleHead, dict[str, Any]]:
    """The head in `directory`, checked against the target's hidden size and vocabulary."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"EAGLE head directory {directory} has no config.json")
    raw = json.loads(config_path.read_text())
    config = EagleConfig.from_dict(raw)
    if config.hidden_size != hidden_size:
        raise ValueError(
            f"EAGLE head {directory} has hidden size {config.hidden_size}; the target's is {hidden_size}"
        )
    if config.vocab_size != vocab_size:
        raise ValueError(
            f"EAGLE head {directory} was trained for a vocabulary of {config.vocab_size} tokens; "
            f"the target's has {vocab_size}"
        )
    state = {k.removeprefix("model."): v for k, v in _state_dict(directory).items()}
    state = {k: v for k, v in state.items() if k not in SHARED_KEYS}
    draft_vocab = state.pop(DRAFT_VOCAB, None)
    head = EagleHead(config)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"EAGLE head {directory} does not match the EAGLE-1/2 layout: "
            f"missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    if draft_vocab is not None:
        ids = draft_vocab.long()
        if ids.ndim != 1 or len(ids) == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"EAGLE head {directory}: draft_vocab must list token ids below {vocab_size}")
        head.draft_vocab = ids
    return head.eval(), raw


def save_head(head: EagleHead, directory: str | Path, extra: dict[str, Any] | None = None) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {**head.config.to_dict(), **(extra or {})}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    if head.draft_vocab is not None:
        state[DRAFT_VOCAB] = head.draft_vocab.to(torch.int64).contiguous()
    save_file(state, str(directory / "model.safetensors"))
