"""Replica affinity vs shuffling: prefix-cache hits and TTFT of later turns, two real replicas, one run.

    python bench/bench_affinity.py [--conversations 12] [--answer-tokens 64] [--max-tokens 16]

Two `specgate serve` replicas (the embedded default model, prefix caching on, telemetry off) sit
behind one front gateway that declares them a `replica_group`. Multi-turn conversations (MT-bench's
two-turn ones, Spec-Bench's copy in bench/data) go through the front gateway with the openai client,
streamed, in two arms interleaved conversation by conversation:
- affinity: the conversation's `user` id keys it, so turn 2 lands where turn 1 did;
- shuffle: a fresh random `user` per request, so each turn lands on a replica at random (what a
  gateway without affinity does: LiteLLM's default simple-shuffle), half the time the other one.
Turn 2 resends turn 1's question and answer. Reported per arm: the share of turn-2 prompt tokens
served from the prefix cache (usage.prompt_tokens_details.cached_tokens), turn-2 TTFT p50 and the
ratio, and how often turn 2 reached turn 1's replica (`metrics.route.backend`).
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from specgate.bench import gateway_targets as gt
from specgate.bench.stub_backend import free_port
from specgate.bench.workloads import DATA

MODEL = "pooled"


def conversations(n: int) -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in (DATA / "spec_bench_dev.jsonl").read_text().splitlines()]
    return [(r["turns"][0], r["turns"][1]) for r in rows if len(r["turns"]) == 2][:n]


def serve(name: str, config: dict[str, Any], tmp: Path) -> gt.Target:
    port = free_port()
    path = tmp / f"{name}.json"
    path.write_text(json.dumps({"port": port, **config}))
    cmd = [sys.executable, "-m", "specgate.gateway.cli.main", "serve", "--config", str(path)]
    return gt.start(name, cmd, f"http://127.0.0.1:{port}", "/readyz", tmp)


def ask(client: openai.OpenAI, messages: list[dict[str, str]], user: str, max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft, text, usage, route = None, [], None, None
    stream = client.chat.completions.create(  # type: ignore[call-overload]
        model=MODEL,
        messages=messages,
        user=user,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
        route = ((chunk.model_extra or {}).get("metrics") or {}).get("route") or route
    assert usage is not None and route is not None
    details = usage.prompt_tokens_details
    return {
        "text": "".join(text),
        "ttft": ttft if ttft is not None else time.perf_counter() - t0,
        "prompt": usage.prompt_tokens,
        "cached": (details.cached_tokens or 0) if details is not None else 0,
        "backend": route["backend"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--answer-tokens", type=int, default=64, help="turn 1's answer, resent by turn 2")
    ap.add_argument("--max-tokens", type=int, default=16, help="turn 2's answer")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-affinity-"))
    replica = {"embedded": {"served_model_name": MODEL}, "telemetry": {"enabled": False}}
    replicas = [serve(f"replica{i}", replica, tmp) for i in range(2)]
    front_cfg = {
        "embedded": {"enabled": False},
        "telemetry": {"enabled": False},
        "backends": [
            {"name": f"replica{i}", "base_url": f"{r.url}/v1", "models": [MODEL], "replica_group": "pool"}
            for i, r in enumerate(replicas)
        ],
    }
    front = serve("front", front_cfg, tmp)
    client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=600)
    results: dict[str, list[dict[str, Any]]] = {"affinity": [], "shuffle": []}
    try:
        convs = conversations(args.conversations)
        print(
            f"{len(convs)} two-turn conversations, 2 replicas of the default model, front gateway {front.url}"
        )
        for i, (q1, q2) in enumerate(convs):
            arms = ("affinity", "shuffle") if i % 2 == 0 else ("shuffle", "affinity")
            for arm in arms:
                conv_user = f"{arm}-{i}-{secrets.token_hex(4)}"

                def user() -> str:
                    return conv_user if arm == "affinity" else secrets.token_hex(8)  # noqa: B023

                # Each arm's conversation is its own (a salt in the system message), so neither arm
                # hits the other's cached prompts.
                system = {"role": "system", "content": f"You are a helpful assistant. [{arm} {i}]"}
                first = ask(client, [system, {"role": "user", "content": q1}], user(), args.answer_tokens)
                turn2 = [
                    system,
                    {"role": "user", "content": q1},
                    {"role": "assistant", "content": first["text"]},
                    {"role": "user", "content": q2},
                ]
                second = ask(client, turn2, user(), args.max_tokens)
                second["same_replica"] = second["backend"] == first["backend"]
                results[arm].append(second)
        print(f"\n{'arm':9s} {'same replica':>12s} {'cached share':>12s} {'TTFT p50 ms':>12s}")
        ttft = {}
        for arm, rows in results.items():
            same = sum(r["same_replica"] for r in rows) / len(rows)
            cached = sum(r["cached"] for r in rows) / max(1, sum(r["prompt"] for r in rows))
            ttft[arm] = statistics.median(r["ttft"] for r in rows) * 1e3
            print(f"{arm:9s} {same:12.0%} {cached:12.1%} {ttft[arm]:12.1f}")
        print(f"\nturn-2 TTFT p50, shuffle / affinity: {ttft['shuffle'] / ttft['affinity']:.2f}x")
    finally:
        front.stop()
        for r in replicas:
            r.stop()


if __name__ == "__main__":
    main()
