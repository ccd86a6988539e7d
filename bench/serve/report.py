"""report.json, report.md and PNG plots of one `specgate bench serve` run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specgate.bench.serve import comparison


def fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def markdown(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [
        "# specgate bench serve",
        "",
        f"Model `{cfg['model']}` at {cfg['base_url']}; {cfg['num_requests']} requests per arm; arrivals: "
        f"{cfg['arrivals']}; max_tokens {cfg['max_tokens']}; temperature {cfg['temperature']}.",
        f"Command: `{cfg['command']}`",
        "",
        "## Arms",
        "",
        "| arm | point | done | req/s | out tok/s | goodput | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
        "| ITL p50 ms | E2E p50 / p99 ms | accepted len | accept rate |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        s = run["summary"]
        t, p, i, e, sp = s["ttft_ms"], s["tpot_ms"], s["itl_ms"], s["e2e_ms"], s["spec"]
        cells = [
            run["arm"],
            run["point"],
            f"{s['completed']}/{s['requests']}",
            fmt(s["request_throughput"], 2),
            fmt(s["output_throughput"]),
            fmt(s["goodput"], 2),
            f"{fmt(t['p50'])} / {fmt(t['p99'])}",
            f"{fmt(p['p50'])} / {fmt(p['p99'])}",
            fmt(i["p50"]),
            f"{fmt(e['p50'], 0)} / {fmt(e['p99'], 0)}",
            fmt(sp["mean_acceptance_length"], 2),
            fmt(sp["acceptance_rate"], 2),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    peer = report.get("peer")
    if peer and peer.get("error"):
        lines += ["", f"The {peer['arm']} peer failed: {peer['error']}"]
    elif peer:
        lines += ["", *comparison.markdown(peer["table"], peer["arm"])]
    cats = report.get("categories") or {}
    if cats:
        arms = sorted({a for per in cats.values() for a in per})
        lines += [
            "",
            "## Per category (tokens/s per request, mean; ratio to plain; accepted length / acceptance rate)",
            "",
            "| category | " + " | ".join(arms) + " | route mix (policy arm) |",
            "|---|" + "---|" * len(arms) + "---|",
        ]
        for cat, per in cats.items():
            base = (per.get("plain") or {}).get("tokens_per_s")
            cells = []
            for a in arms:
                c = per.get(a) or {}
                tps = c.get("tokens_per_s")
                ratio = f" ({tps / base:.2f}x)" if tps and base else ""
                acc, rate = c.get("mean_acceptance_length"), c.get("acceptance_rate")
                spec = f", len {acc:.2f} / {rate:.0%}" if acc and rate is not None else ""
                cells.append(f"{fmt(tps)}{ratio}{spec}")
            mix = (per.get("policy") or {}).get("route_mix") or {}
            lines.append(
                f"| {cat} | " + " | ".join(cells) + f" | {', '.join(f'{k} {v}' for k, v in mix.items())} |"
            )
    hf = report.get("hf_baselines") or []
    if hf:
        lines += [
            "",
            "## Batch 1: Hugging Face `generate` on the same prompts",
            "",
            "| baseline | category | tokens/s |",
            "|---|---|---|",
        ]
        lines += [f"| {r['baseline']} | {r['category']} | {fmt(r['tokens_per_s'])} |" for r in hf]
    tel = report.get("telemetry")
    if tel:
        lines += [
            "",
            f"Telemetry cross-check: {tel['rows']} rows for {tel['sent']} requests sent "
            f"({'agree' if tel['agree'] else 'DISAGREE'}).",
        ]
    lines += ["", *[f"![{p}]({p})" for p in report.get("plots", [])], ""]
    return "\n".join(lines)


def plots(report: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    runs = report["runs"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in sorted({r["arm"] for r in runs}):
        pts = [
            (r["summary"]["output_throughput"], r["summary"]["tpot_ms"]["p50"])
            for r in runs
            if r["arm"] == arm
        ]
        pts = sorted(p for p in pts if p[0] is not None and p[1] is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=arm)
    ax.set(xlabel="output tokens/s", ylabel="TPOT p50 (ms)", title="Throughput vs latency by arm")
    ax.legend()
    made.append(_save(fig, out, "throughput_latency.png"))

    cats = report.get("categories") or {}
    arms = [a for a in sorted({a for per in cats.values() for a in per}) if a != "plain"]
    if cats and arms:
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(arms)
        names = list(cats)
        for k, arm in enumerate(arms):
            ys = []
            for cat in names:
                base = (cats[cat].get("plain") or {}).get("tokens_per_s")
                tps = (cats[cat].get(arm) or {}).get("tokens_per_s")
                ys.append(tps / base if tps and base else 0.0)
            ax.bar([i + k * width for i in range(len(names))], ys, width, label=arm)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(
            [i + width * (len(arms) - 1) / 2 for i in range(len(names))], names, rotation=30, ha="right"
        )
        ax.set(ylabel="tokens/s vs plain", title="Speedup by category")
        ax.legend()
        made.append(_save(fig, out, "speedup_by_category.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        pos = run["summary"]["spec"]["acceptance_by_position"]
        if pos:
            ax.plot(range(1, len(pos) + 1), pos, marker=".", label=f"{run['arm']} {run['point']}")
    ax.set(xlabel="draft position", ylabel="accepted share of steps", title="Acceptance by position")
    if ax.lines:
        ax.legend()
    made.append(_save(fig, out, "acceptance_by_position.png"))

    timeline = report.get("route_timeline") or []
    if timeline:
        fig, ax = plt.subplots(figsize=(6, 3))
        methods = sorted({m for _, m in timeline})
        for m in methods:
            xs = [t for t, mm in timeline if mm == m]
            ax.scatter(xs, [methods.index(m)] * len(xs), s=8, label=m)
        ax.set_yticks(range(len(methods)), methods)
        ax.set(xlabel="seconds into the policy arm", title="Route mix over time (policy arm)")
        made.append(_save(fig, out, "route_mix.png"))
    return made


def _save(fig: Any, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return name


def write(report: dict[str, Any], out: Path, with_plots: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if with_plots:
        report["plots"] = plots(report, out)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "report.md").write_text(markdown(report))
