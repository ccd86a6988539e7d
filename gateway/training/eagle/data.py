"""Training data for an EAGLE head by self-distillation: the target answers the shipped prompts
(greedy, batched in the engine), then one more pass reads its final hidden states over each
prompt + answer. Prompts come from the workload classifier's labeled set, split by source item so
that no evaluation prompt (or a rephrasing of one) is ever trained on.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specgate.engine.batch_layout import ForwardItem
from specgate.engine.block_manager import BlockManager
from specgate.engine.engine import Engine
from specgate.engine.model_runner import ModelRunner
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.vocab import SpecParams
from specgate.gateway.backends.embedded.chat_template import render_chat
from specgate.policies.training import dataset
from specgate.policies.training.classifier import split_by_group

Progress = Callable[[int], None]


@dataclass(slots=True)
class Sample:
    category: str
    prompt_len: int
    token_ids: list[int]  # prompt + the target's answer
    features: torch.Tensor | None = None  # [len(token_ids), hidden], the target's final hidden states
    next_ids: torch.Tensor | None = None  # [len(token_ids)] the target's greedy pick after each position


def prompts(
    per_class_train: int, per_class_eval: int, seed: int = 0
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(class, text) for training and for evaluation, disjoint by source item, balanced by class."""
    train_rows, test_rows = split_by_group(dataset.load(), 0.2, seed)
    rng = random.Random(seed)

    def pick(rows: list[dict], n: int) -> list[tuple[str, str]]:
        by_class: dict[str, list[dict]] = defaultdict(list)
        for r in rows:
            by_class[r["label"]].append(r)
        out = []
        for label in sorted(by_class):
            group = by_class[label]
            rng.shuffle(group)
            out += [(label, r["text"]) for r in group[:n]]
        return out

    return pick(train_rows, per_class_train), pick(test_rows, per_class_eval)


def chat_ids(tokenizer: object, text: str, max_prompt_tokens: int) -> list[int] | None:
    ids = render_chat(tokenizer, [{"role": "user", "content": text}])
    return ids if len(ids) <= max_prompt_tokens else None


def submit(
    engine: Engine,
    items: list[tuple[str, str]],
    tag: str,
    max_tokens: int,
    max_prompt_tokens: int,
    progress: Progress,
    spec: SpecParams | None = None,
) -> dict[str, tuple[str, list[int]]]:
    """Add every prompt that fits as a greedy request; request id -> (class, prompt ids). Prompts
    too long are skipped (and counted as done)."""
    out = {}
    for i, (category, text) in enumerate(items):
        ids = chat_ids(engine.tokenizer, text, max_prompt_tokens)
        if ids is None:
            progress(1)
            continue
        rid = f"{tag}-{i}"
        out[rid] = (category, ids)
        engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), spec)
    return out


def self_distill(
    engine: Engine, items: list[tuple[str, str]], max_tokens: int, max_prompt_tokens: int, progress: Progress
) -> list[Sample]:
    """The target's greedy answers to every prompt that fits, generated in the engine's batches."""
    added = submit(engine, items, "distill", max_tokens, max_prompt_tokens, progress)
    samples = {rid: Sample(category, len(ids), list(ids)) for rid, (category, ids) in added.items()}
    while engine.has_unfinished():
        for out in engine.step():
            samples[out.request_id].token_ids.extend(out.new_token_ids)
            if out.finished:
                progress(1)
    return [s for s in samples.values() if len(s.token_ids) > s.prompt_len + 1]


@dataclass(slots=True)
class _Blocks:
    block_table: list[int] = field(default_factory=list)


@torch.inference_mode()
def collect_features(runner: ModelRunner, samples: list[Sample], progress: Progress) -> None:
    """Each sample's final hidden states, from one prefill of prompt + answer through the runner."""
    blocks = BlockManager(runner.kv_cache.num_blocks, runner.kv_cache.block_size)
    for s in samples:
        seq = _Blocks()
        blocks.allocate(seq, len(s.token_ids))
        _, hidden = runner.execute_with_hidden([ForwardItem(s.token_ids, 0, seq.block_table, 0)], True)
        assert hidden is not None
        s.features = hidden[0].detach().to(torch.bfloat16).clone()
        blocks.free(seq)
        progress(1)
