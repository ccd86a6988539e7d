// Traffic: request rate, errors by code, TTFT / TPOT percentiles, tokens/s, per model and backend.
import { api, h, fmt, ms, pct, table, tile } from "./api.js";
import { lineChart, stackedBars } from "./charts.js";
import { Controls } from "./controls.js";

export class TrafficPage {
  constructor(root) {
    this.root = root;
    this.controls = new Controls("traffic", () => this.load());
    this.body = h("div", { "aria-live": "polite", "aria-busy": "false" });
    root.append(this.controls.el, this.body);
  }

  show() { this.load(); this.controls.schedule(); }
  hide() { this.controls.stop(); }

  async load() {
    this.body.setAttribute("aria-busy", "true");
    try {
      const data = await api("GET", `/admin/timeseries/traffic?${this.controls.query()}`);
      this.controls.render(data.window);
      this.render(data);
    } catch (e) {
      this.body.replaceChildren(h("p", { class: "error", role: "alert" }, `Could not load traffic: ${e.message}`));
    } finally {
      this.body.setAttribute("aria-busy", "false");
    }
  }

  render(data) {
    const pts = data.points, step = data.window.step;
    const times = pts.map((p) => p.t);
    const total = pts.reduce((a, p) => a + p.requests, 0);
    const errors = pts.reduce((a, p) => a + p.errors, 0);
    const tokens = pts.reduce((a, p) => a + p.completion_tokens, 0);
    const span = data.window.end - data.window.start;
    const codes = [...new Set(pts.flatMap((p) => Object.keys(p.errors_by_code)))].sort();
    const pick = (key, q) => pts.map((p) => p[key][q]);
    this.body.replaceChildren(
      h("div", { class: "tiles" },
        tile("Requests", fmt(total)), tile("Requests / s", fmt(total / span, 3)), tile("Error rate", total ? pct(errors / total) : "–"),
        tile("Output tokens / s", fmt(tokens / span, 2))),
      h("div", { class: "charts" },
        lineChart({ id: "chart-rate", title: "Requests per second", times, step, yFormat: (v) => fmt(v, 2), series: [
          { name: "all", values: pts.map((p) => p.requests_per_s) },
          { name: "errors", values: pts.map((p) => p.errors / step), color: "#d1242f" }] }),
        lineChart({ id: "chart-ttft", title: "Time to first token (ms)", times, step, series: [
          { name: "p50", values: pick("ttft_ms", "p50") }, { name: "p90", values: pick("ttft_ms", "p90") }, { name: "p99", values: pick("ttft_ms", "p99") }] }),
        lineChart({ id: "chart-tpot", title: "Time per output token (ms)", times, step, series: [
          { name: "p50", values: pick("tpot_ms", "p50") }, { name: "p90", values: pick("tpot_ms", "p90") }, { name: "p99", values: pick("tpot_ms", "p99") }] }),
        lineChart({ id: "chart-tokens", title: "Output tokens per second", times, step, yFormat: (v) => fmt(v, 2), series: [
          { name: "all requests", values: pts.map((p) => p.tokens_per_s) },
          { name: "mean per request", values: pts.map((p) => p.mean_request_tokens_per_s) }] }),
        stackedBars({ id: "chart-errors", title: "Errors by code", times, step, series: codes.map((c) => (
          { name: c, values: pts.map((p) => p.errors_by_code[c] || 0) })) }),
      ),
      h("h2", null, "By model and backend"),
      table([
        { label: "Model", get: (r) => r.model }, { label: "Backend", get: (r) => r.backend ?? "none" },
        { label: "Requests", get: (r) => r.requests, num: true }, { label: "Errors", get: (r) => r.errors, num: true },
        { label: "Error rate", get: (r) => pct(r.error_rate), num: true },
        { label: "Tokens / s", get: (r) => r.tokens_per_s, num: true, digits: 2 },
        { label: "TTFT p50", get: (r) => ms(r.ttft_ms.p50), num: true }, { label: "TTFT p99", get: (r) => ms(r.ttft_ms.p99), num: true },
        { label: "TPOT p50", get: (r) => ms(r.tpot_ms.p50), num: true }, { label: "TPOT p99", get: (r) => ms(r.tpot_ms.p99), num: true },
      ], data.by_route, "Traffic by model and backend"),
    );
  }
}
