"""Self-distil, train, save and evaluate an EAGLE head: the whole workflow `specgate eagle` runs.

The command line only parses its arguments into a `RunConfig` and prints what comes back.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class RunConfig:
    model: str | None = None  # target (None: the embedded default)
    dtype: str = "auto"
    train_per_class: int = 40
    eval_per_class: int = 4
    max_tokens: int = 160  # answer length
    max_prompt_tokens: int = 384
    batch: int = 48  # engine batch size
    k: int = 4  # draft length for the evaluation
    seed: int = 0
    out: str = "eagle-out"
    steps: int = 600
    lr: float = 1e-3
    batch_tokens: int = 1024
    draft_vocab: int = 8192  # 0: the whole vocabulary
    resume: bool = False
    random_init: bool = False
    ttt_steps: int = 0  # EAGLE-3 training-time test passes
    init_head: str | None = None  # start from this head directory (fine-tuning), not the identity

    def __post_init__(self) -> None:
        for name in ("train_per_class", "eval_per_class", "max_tokens", "max_prompt_tokens", "batch", "k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.steps < 0 or self.lr <= 0 or self.batch_tokens < 1 or self.draft_vocab < 0:
            raise ValueError("steps >= 0, lr > 0, batch_tokens >= 1 and draft_vocab >= 0 are required")


def engine_for(cfg: RunConfig, head: Path | None = None, pack: bool | None = None) -> Any:
    from specgate.engine.config import EngineConfig
    from specgate.engine.engine import Engine
    from specgate.gateway.settings import default_cache_dir

    options = {"eagle": {"head": str(head)}} if head is not None else {}
    config = EngineConfig(
        model=cfg.model,
        dtype=cfg.dtype,
        max_num_seqs=cfg.batch,
        max_num_batched_tokens=max(512, cfg.max_prompt_tokens),
        proposer_options=options,
        pack_linears=pack,
        convert_cache_dir=default_cache_dir(),
    )
    return Engine(config)


def train_and_evaluate(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Train a head into `cfg.out` / head and return its held-out acceptance per class."""
    import torch
    from tqdm import tqdm

    from specgate.engine.spec_decode.eagle_io import save_head
    from specgate.gateway.training.eagle import data
    from specgate.gateway.training.eagle.evaluate import acceptance_by_class
    from specgate.gateway.training.eagle.train import TrainConfig, draft_vocabulary, init_head, train

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    train_items, eval_items = data.prompts(cfg.train_per_class, cfg.eval_per_class, cfg.seed)
    engine = engine_for(cfg, pack=False)  # training reads the target's weights as plain tensors
    samples_path = out / "samples.pt"
    if cfg.resume and samples_path.exists():
        samples = [data.Sample(**s) for s in torch.load(samples_path, weights_only=False)]
        sys.stdout.write(f"resumed {len(samples)} self-distilled samples from {samples_path}\n")
    else:
        with tqdm(total=len(train_items), desc="self-distillation", unit="prompt") as bar:
            samples = data.self_distill(
                engine, train_items, cfg.max_tokens, cfg.max_prompt_tokens, bar.update
            )
        with tqdm(total=len(samples), desc="target features", unit="seq") as bar:
            data.collect_features(engine.runner, samples, bar.update)
        torch.save([{k: getattr(s, k) for k in s.__slots__} for s in samples], samples_path)
    tokens = sum(len(s.token_ids) - s.prompt_len for s in samples)
    sys.stdout.write(f"{len(samples)} samples, {tokens} answer tokens\n")
    head = init_head(engine.runner, identity=not cfg.random_init)
    if cfg.init_head is not None:
        from specgate.engine.spec_decode.eagle_io import load_head

        start, _ = load_head(Path(cfg.init_head), engine.runner.hidden_size, engine.runner.vocab_size)
        head.load_state_dict(start.float().state_dict())
    tcfg = TrainConfig(
        steps=cfg.steps, lr=cfg.lr, batch_tokens=cfg.batch_tokens, seed=cfg.seed, ttt_steps=cfg.ttt_steps
    )
    with tqdm(total=tcfg.steps, desc="training", unit="step") as bar:

        def on_step(step: int, m: dict[str, float]) -> None:
            bar.n = step + 1
            bar.set_postfix(vloss=f"{m['vloss']:.3f}", ploss=f"{m['ploss']:.2f}", acc=f"{m['acc']:.3f}")
            bar.refresh()

        metrics = train(head, engine.runner, samples, tcfg, out / "checkpoint.pt", cfg.resume, on_step)
    if cfg.draft_vocab > 0:
        head.draft_vocab, coverage = draft_vocabulary(samples, cfg.draft_vocab)
        sys.stdout.write(
            f"draft vocabulary: {len(head.draft_vocab)} tokens, {coverage:.1%} of training answer tokens\n"
        )
    head_dir = out / "head"
    command = "specgate eagle train " + shlex.join(
        sys.argv[3:] if sys.argv[1:3] == ["eagle", "train"] else []
    )
    provenance = {
        "target": engine.model_name,
        "command": command,
        "samples": len(samples),
        "answer_tokens": tokens,
        "steps": tcfg.steps,
        "final_train_metrics": metrics,
    }
    save_head(head.to(torch.bfloat16), head_dir, {"specgate": provenance})
    sys.stdout.write(f"head -> {head_dir} ({time.time() - t0:.0f} s so far)\n")
    del engine
    ev = engine_for(cfg, head=head_dir)
    with tqdm(total=len(eval_items), desc="held-out evaluation", unit="prompt") as bar:
        results: dict[str, dict[str, Any]] = acceptance_by_class(
            ev, eval_items, "eagle", cfg.k, cfg.max_tokens, cfg.max_prompt_tokens, bar.update
        )
    (out / "eval.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def evaluate(cfg: RunConfig, method: str, head: Path | None) -> dict[str, dict[str, Any]]:
    """Held-out acceptance per workload class of one method (the same split training leaves out)."""
    from tqdm import tqdm

    from specgate.gateway.training.eagle import data
    from specgate.gateway.training.eagle.evaluate import acceptance_by_class

    _, eval_items = data.prompts(cfg.train_per_class, cfg.eval_per_class, cfg.seed)
    engine = engine_for(cfg, head=head)
    with tqdm(total=len(eval_items), desc=method, unit="prompt") as bar:
        results: dict[str, dict[str, Any]] = acceptance_by_class(
            engine, eval_items, method, cfg.k, cfg.max_tokens, cfg.max_prompt_tokens, bar.update
        )
    return results
