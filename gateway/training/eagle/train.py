"""Training an EAGLE head on self-distilled data, with EAGLE's two losses: regression of the next
feature (smooth L1) and cross-entropy of the target's next token through the target's LM head.

The head starts as the identity on the feature (see `init_head`), so that a few minutes of CPU
training start from a sensible predictor rather than from noise. Checkpoints (head, optimizer,
step, random state, the rest of the epoch) make a long run resumable, exactly.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from specgate.engine.model_runner import ModelRunner
from specgate.engine.spec_decode.eagle_head import DecoderLayer, EagleConfig, EagleHead
from specgate.gateway.training.eagle.data import Sample


@dataclass(slots=True)
class TrainConfig:
    steps: int = 600
    lr: float = 1e-3
    batch_tokens: int = 1024  # supervised positions per step, roughly
    ce_weight: float = 0.1  # EAGLE's weight on the token loss
    noise: float = 0.1  # uniform noise on input features, times their std (EAGLE's robustness trick)
    warmup: int = 20
    seed: int = 0
    checkpoint_every: int = 100
    prompt_loss: bool = True  # supervise prompt positions too (more data from the same passes)
    weight_decay: float = 0.01
    # EAGLE-3's training-time test: after the teacher-forced pass, this many more passes feed the
    # head its own predicted features, each position attending as a draft step would (the real pairs
    # before its draft began, then its own earlier draft steps).
    ttt_steps: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_tokens < 8 or self.lr <= 0:
            raise ValueError("steps >= 1, batch_tokens >= 8 and lr > 0 are required")
        if not 0 <= self.ttt_steps <= 4:
            raise ValueError("ttt_steps must be in [0, 4]")


def init_head(runner: ModelRunner, identity: bool = True) -> EagleHead:
    """A head shaped for the target. With `identity`, it starts as the identity on the feature:
    `fc` passes f_i through and the layer's residual branches (o_proj, down_proj) start at zero,
    so training begins from "the next feature is this one" instead of from noise."""
    text_config = runner.model.config.get_text_config()
    head = EagleHead(EagleConfig.for_target(text_config)).float()
    if not identity:
        return head
    ours = cast(DecoderLayer, head.layers[0])
    with torch.no_grad():
        for linear in (head.fc, *ours.self_attn.children(), *ours.mlp.children()):
            if isinstance(linear, torch.nn.Linear):
                linear.weight.normal_(0.0, 0.02)
        ours.self_attn.o_proj.weight.zero_()
        ours.mlp.down_proj.weight.zero_()
        h = head.config.hidden_size
        head.fc.weight[:, h:] += torch.eye(h)  # [embedding | feature] -> feature, at first
        if head.fc.bias is not None:
            head.fc.bias.zero_()
    return head


def batch_loss(
    head: EagleHead,
    embed: torch.Tensor,  # [vocab, hidden] the target's embeddings (fp32, frozen)
    lm_head: torch.Tensor,  # [vocab, hidden] the target's LM head (fp32, frozen)
    samples: list[Sample],
    noise: float,
    ce_weight: float,
    prompt_loss: bool = True,
    ttt_steps: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Teacher-forced over each sample: head position i reads (x_{i+1}, f_i) and predicts f_{i+1},
    and through the LM head the token the target itself picks after position i + 1. Supervised over
    the whole sequence (the prompt's features are the target's too), or with `prompt_loss` off
    from the last prompt position on (where drafting starts). With `ttt_steps`, pass j reads at
    position i the feature pass j - 1 predicted for it and is supervised with the same targets: the
    j + 1-th step of a draft that began after position i - j (`ttt_mask`). Losses average over passes."""
    vlosses, plosses, hits, count = [], [], 0, 0
    for s in samples:
        assert s.features is not None
        ids = torch.tensor(s.token_ids)
        feats = s.features.float()  # [T, hidden]
        t = len(ids)
        inp = feats[:-1]
        if noise > 0:
            inp = inp + (torch.rand_like(inp) - 0.5) * 2 * noise * feats.std()
        embeds = embed[ids[1:]].unsqueeze(0)  # [1, T - 1, hidden]
        positions = torch.arange(t - 1)
        out, kv = head(embeds, inp.unsqueeze(0), positions)
        preds = [out[0]]  # per pass [T - 1, hidden]: predicted f_1 .. f_{T-1}
        for j in range(1, ttt_steps + 1):
            fed = torch.cat([feats[:1], preds[-1][:-1]])  # position i reads the feature predicted for it
            out, kv = head(embeds, fed.unsqueeze(0), positions, kv, ttt_mask(t - 1, j))
            preds.append(out[0])
        first = 0 if prompt_loss else max(0, s.prompt_len - 1)
        target = target_choices(s, lm_head)[1:][first:]  # the target's pick after f_{i+1}
        for j, pred in enumerate(preds):
            vlosses.append(
                F.smooth_l1_loss(pred[first:], feats[1:][first:], reduction="sum") / feats.shape[1]
            )
            logits = pred[first:] @ lm_head.T  # [n, vocab]
            plosses.append(F.cross_entropy(logits, target, reduction="sum"))
            if j == 0:
                hits += int((logits.argmax(-1) == target).sum())
        count += len(target)
    n = max(1, count) * (1 + ttt_steps)
    vloss = torch.stack(vlosses).sum() / n
    ploss = torch.stack(plosses).sum() / n if plosses else torch.zeros(())
    metrics = {"vloss": float(vloss.detach()), "ploss": float(ploss.detach()), "acc": hits / max(1, count)}
    return vloss + ce_weight * ploss, metrics


def ttt_mask(n: int, j: int) -> torch.Tensor:
    """[n, (j + 1) * n] bool for pass j over n positions, its keys after those of passes 0 .. j - 1:
    position i sees pass 0's (real pairs') keys up to i - j and pass m's key at i - j + m."""
    i = torch.arange(n).view(n, 1)
    blocks = [torch.arange(n).view(1, n) <= i - j]
    blocks += [torch.arange(n).view(1, n) == i - j + m for m in range(1, j + 1)]
    return torch.cat(blocks, dim=1)


@torch.no_grad()
def target_choices(s: Sample, lm_head: torch.Tensor) -> torch.Tensor:
    """[T] the target's greedy token after each position of the sample (cached on it). In the
    answers this is the next token itself; in the prompt, what the target would have said."""
    if s.next_ids is None:
        assert s.features is not None
        s.next_ids = (s.features.float() @ lm_head.T).argmax(-1)
    return s.next_ids


def _batches(
    samples: list[Sample], batch_tokens: int, rng: random.Random, prompt_loss: bool
) -> list[list[int]]:
    """One epoch of batches, as sample indices (so a checkpoint can hold the rest of the epoch)."""
    order = list(range(len(samples)))
    rng.shuffle(order)
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i in order:
        cur.append(i)
        size += len(samples[i].token_ids) - (0 if prompt_loss else samples[i].prompt_len)
        if size >= batch_tokens:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def train(
    head: EagleHead,
    runner: ModelRunner,
    samples: list[Sample],
    cfg: TrainConfig,
    checkpoint: Path | None = None,
    resume: bool = False,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, float]:
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    embed = runner.weight_of(runner.embed_tokens()).detach().float()
    lm_head = runner.weight_of(runner.lm_head()).detach().float()
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    start = 0
    queue: list[list[int]] = []
    if resume and checkpoint is not None and checkpoint.exists():
        state: dict[str, Any] = torch.load(checkpoint, map_location="cpu", weights_only=False)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        queue = state["queue"]
    schedule = lambda s: min(1.0, (s + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * s / cfg.steps))  # noqa: E731
    metrics: dict[str, float] = {}
    head.train()
    for step in range(start, cfg.steps):
        if not queue:
            queue = _batches(samples, cfg.batch_tokens, rng, cfg.prompt_loss)
        batch = [samples[i] for i in queue.pop()]
        for group in opt.param_groups:
            group["lr"] = cfg.lr * schedule(step)
        loss, metrics = batch_loss(
            head, embed, lm_head, batch, cfg.noise, cfg.ce_weight, cfg.prompt_loss, cfg.ttt_steps
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        if on_step is not None:
            on_step(step, metrics)
        done = step + 1
        if checkpoint is not None and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
            tmp = checkpoint.with_suffix(".tmp")
            torch.save(
                {
                    "head": head.state_dict(),
                    "optimizer": opt.state_dict(),
                    "step": done,
                    "rng": rng.getstate(),
                    "torch_rng": torch.get_rng_state(),
                    "queue": queue,
                    "config": asdict(cfg),
                },
                tmp,
            )
            tmp.replace(checkpoint)  # a crash mid-write never leaves a broken checkpoint
    head.eval()
    return metrics


def draft_vocabulary(samples: list[Sample], size: int) -> tuple[torch.Tensor, float]:
    """The `size` tokens most frequent in the training prompts and answers (answers weigh double:
    they are what drafts predict), and the share of answer tokens they cover."""
    counts: dict[int, int] = {}
    for s in samples:
        for i, t in enumerate(s.token_ids):
            counts[t] = counts.get(t, 0) + (2 if i >= s.prompt_len else 1)
    ids = sorted(sorted(counts, key=lambda t: -counts[t])[:size])
    kept = set(ids)
    answers = [t for s in samples for t in s.token_ids[s.prompt_len :]]
    coverage = sum(t in kept for t in answers) / max(1, len(answers))
    return torch.tensor(ids, dtype=torch.int64), coverage
