"""`specgate bench steps`: what a forward pass of the engine costs by its number of new tokens, and
the machine's int8 roof. (bench/README.md, "What each benchmark does", has the method.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict

from specgate.bench import launch, models
from specgate.bench.stats import table
from specgate.bench.workload import DATA

STEP_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--max-size", type=int, default=64)
    launch.options(p, model=None, reps=5)
    p.add_argument("--roof", action="store_true", help="also GMAC/s per pass and the machine's int8 roof")


def int8_roof(threads: int) -> float | None:
    """GMAC/s of int8 dot products on `threads` threads (bench/data/roof.c, compiled here with the
    system compiler; None: no compiler, or no AVX2)."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "roof")
        cmd = ["cc", "-O3", "-march=native", "-fopenmp", str(DATA / "roof.c"), "-o", exe]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            return None
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        out = subprocess.run([exe], capture_output=True, text=True, env=env, timeout=120)
        return float(out.stdout.strip()) if out.returncode == 0 else None


def macs_per_token(path: str) -> int:
    """Multiply-adds of one token's pass through every matrix of the file (the LM head included)."""
    from gguf import GGUFReader

    tensors = {t.name: [int(n) for n in t.shape] for t in GGUFReader(path).tensors}
    # The token embeddings are a lookup table, not a product, unless the LM head is tied to them.
    lookup = "token_embd.weight" if "output.weight" in tensors else ""
    weights = [s for name, s in tensors.items() if name.endswith(".weight") and name != lookup]
    return sum(s[0] * s[1] for s in weights if len(s) == 2)


def run(args: argparse.Namespace) -> int:
    import torch

    from specgate.engine.batch_layout import ForwardItem
    from specgate.engine.config import EngineConfig
    from specgate.engine.model_runner import ModelRunner

    path = str(models.gguf_path(args.model))
    runner = ModelRunner(EngineConfig(model=path, prefix_caching=False, kv_cache_bytes=2 << 30))
    sizes = [n for n in STEP_SIZES if n <= args.max_size]
    ctx, bs = args.context, runner.config.block_size
    ids = torch.randint(100, 20000, (ctx + max(sizes),), generator=torch.Generator().manual_seed(0)).tolist()
    per_seq = -(-(ctx + max(sizes)) // bs)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(max(sizes))]
    if len(tables) * per_seq > runner.kv_cache.num_blocks:
        raise ValueError("the KV cache is too small for this many sequences: lower --max-size or --context")
    for table_ in tables:  # every sequence holds the same context
        for start in range(0, ctx, 256):
            runner.execute([ForwardItem(ids[start : min(ctx, start + 256)], start, table_, 1)])
    kinds = {
        "verify k": lambda n: [ForwardItem(ids[ctx : ctx + n], ctx, tables[0], n)],
        "batch b": lambda n: [ForwardItem([ids[ctx]], ctx, tables[i], 1) for i in range(n)],
    }
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    for rep in range(args.reps + 1):
        for n in sizes:
            for name, items in kinds.items():
                t = time.perf_counter()
                runner.execute(items(n))
                if rep:  # the first round warms up
                    times[(name, n)].append(time.perf_counter() - t)
    threads = torch.get_num_threads()
    macs = macs_per_token(path) if args.roof else 0
    print(f"{os.path.basename(path)}: forward pass after a {ctx}-token context, {threads} threads, median ms")
    rows = []
    for n in sizes:
        med = {k: statistics.median(times[(k, n)]) for k in kinds}
        cells = [f"{med[k] * 1000:.1f} ({med[k] / statistics.median(times[(k, 1)]):.2f}x)" for k in kinds]
        rows.append([n, *cells, *([f"{n * macs / med['verify k'] / 1e9:.0f}"] if macs else [])])
    head = ["new tokens", *(f"{k}: ms (x one token)" for k in kinds), *(["verify k: GMAC/s"] if macs else [])]
    print("\n".join(table(head, rows)))
    if macs:
        roof = int8_roof(threads)
        floor = f"{8 * macs / roof / 1e6:.1f} ms" if roof else "unknown"
        print(
            f"{macs / 1e9:.2f} GMAC per token; int8 roof on {threads} threads: "
            f"{roof if roof is not None else 'not measured'} GMAC/s; 8 tokens' products at the roof: {floor}"
        )
    return 0
