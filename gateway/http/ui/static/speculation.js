// Speculation: acceptance over time, the route mix, the speed-up per class and method against plain
// requests of the same class, and where the load turned speculation off.
import { api, h, fmt, pct, table, tile } from "./api.js";
import { barList, lineChart, stackedBars } from "./charts.js";
import { Controls } from "./controls.js";

export class SpeculationPage {
  constructor(root) {
    this.root = root;
    this.controls = new Controls("spec", () => this.load());
    this.body = h("div", { "aria-live": "polite" });
    root.append(this.controls.el, this.body);
  }

  show() { this.load(); this.controls.schedule(); }
  hide() { this.controls.stop(); }

  async load() {
    try {
      const [data, policy] = await Promise.all([
        api("GET", `/admin/timeseries/speculation?${this.controls.query()}`),
        api("GET", "/admin/policy").catch(() => null),
      ]);
      this.controls.render(data.window);
      this.render(data, policy);
    } catch (e) {
      this.body.replaceChildren(h("p", { class: "error", role: "alert" }, `Could not load speculation: ${e.message}`));
    }
  }

  render(data, policy) {
    const pts = data.points, step = data.window.step, times = pts.map((p) => p.t);
    const drafted = pts.reduce((a, p) => a + p.draft_tokens, 0);
    const accepted = pts.reduce((a, p) => a + p.accepted_tokens, 0);
    const arms = [...new Set(pts.flatMap((p) => Object.keys(p.route_mix)))].sort();
    const speedups = data.by_class.filter((r) => r.speedup_vs_plain !== null);
    const limit = policy ? policy.rules.max_batch_for_spec : null;
    const off = data.by_load.turned_off_at_batch;
    this.body.replaceChildren(
      h("div", { class: "tiles" },
        tile("Drafted tokens", fmt(drafted)), tile("Accepted tokens", fmt(accepted)),
        tile("Acceptance rate", drafted ? pct(accepted / drafted) : "–"),
        tile("Speculation turned off at batch", off === null ? "not in window" : String(off))),
      h("div", { class: "charts" },
        lineChart({ id: "chart-acceptance", title: "Draft acceptance rate", times, step, yFormat: pct, series: [
          { name: "accepted / drafted", values: pts.map((p) => p.acceptance_rate) }] }),
        lineChart({ id: "chart-accept-len", title: "Mean accepted length (tokens per verification step)", times, step, yFormat: (v) => fmt(v, 2), series: [
          { name: "mean accepted length", values: pts.map((p) => p.mean_acceptance_length) }] }),
        stackedBars({ id: "chart-mix", title: "Route mix (backend : method), successful requests", times, step, series: arms.map((a) => (
          { name: a, values: pts.map((p) => p.route_mix[a] || 0) })) }),
        barList({ id: "chart-speedup", title: "Speed-up over plain requests of the same class (tokens/s ratio)",
          items: speedups.map((r) => ({ name: `${r.workload_class} × ${r.method}`, value: r.speedup_vs_plain, label: `${fmt(r.speedup_vs_plain, 2)}×` })) }),
      ),
      h("h2", null, "Acceptance by workload class and method"),
      table([
        { label: "Class", get: (r) => r.workload_class }, { label: "Method", get: (r) => r.method },
        { label: "Requests", get: (r) => r.requests, num: true },
        { label: "Acceptance", get: (r) => pct(r.acceptance_rate), num: true },
        { label: "Mean accepted length", get: (r) => r.mean_acceptance_length, num: true, digits: 2 },
        { label: "Tokens / s", get: (r) => r.mean_tokens_per_s, num: true, digits: 1 },
        { label: "Speed-up vs plain", get: (r) => (r.speedup_vs_plain === null ? "–" : `${fmt(r.speedup_vs_plain, 2)}×`), num: true },
      ], data.by_class, "Acceptance by class and method"),
      h("h2", null, "Speculation by load at arrival"),
      h("p", { class: "help" }, limit ? `The active policy turns speculation off from a batch of ${limit} running + waiting sequences (max_batch_for_spec). ` : "",
        off === null ? "No request in this window was kept plain for the load." : `In this window it did so from a batch of ${off}.`),
      table([
        { label: "Batch at arrival", get: (b) => (b.batch_max === null ? `${b.batch_min}+` : b.batch_min === b.batch_max ? String(b.batch_min) : `${b.batch_min}–${b.batch_max}`) },
        { label: "Requests", get: (b) => b.requests, num: true },
        { label: "Speculating", get: (b) => pct(b.speculating_share), num: true },
        { label: "Kept plain for the load", get: (b) => b.off_for_load, num: true },
      ], data.by_load.bands, "Speculation by load"),
    );
  }
}
