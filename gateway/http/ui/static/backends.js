// Backends: health, breaker, in-flight, latency and models of each, and the engine load the policy sees.
import { api, h, fmt, table } from "./api.js";

function badge(ok, yes, no) {
  return h("span", { class: `badge ${ok ? "ok" : "bad"}` }, ok ? yes : no);
}

export class BackendsPage {
  constructor(root) {
    this.root = root;
    this.body = h("div", { "aria-live": "polite" });
    root.append(h("p", { class: "help" }, "Refreshes every 5 seconds while shown."), this.body);
  }

  show() { this.load(); clearInterval(this.timer); this.timer = setInterval(() => { if (!document.hidden) this.load(); }, 5000); }
  hide() { clearInterval(this.timer); }

  async load() {
    try {
      this.render(await api("GET", "/admin/backends"));
    } catch (e) {
      this.body.replaceChildren(h("p", { class: "error", role: "alert" }, `Could not load backends: ${e.message}`));
    }
  }

  render(data) {
    const breaker = (b) => {
      if (!b.breaker) return "–";
      return h("span", { class: `badge ${b.breaker === "closed" ? "ok" : b.breaker === "open" ? "bad" : "warn"}` }, b.breaker);
    };
    const load = data.engine_load || {};
    this.body.replaceChildren(
      table([
        { label: "Backend", get: (b) => b.name },
        { label: "Health", get: (b) => badge(b.healthy, "healthy", "unhealthy") },
        { label: "State", get: (b) => b.state ?? (b.probe_ok === false ? "probe failing" : "up") },
        { label: "Breaker", get: breaker },
        { label: "In flight", get: (b) => b.in_flight ?? (b.policy_load ? b.policy_load.in_flight : b.num_running), num: true },
        { label: "Waiting", get: (b) => b.num_waiting, num: true },
        { label: "Latency (EWMA)", get: (b) => (b.latency_ewma_ms === null || b.latency_ewma_ms === undefined ? "–" : `${fmt(b.latency_ewma_ms, 1)} ms`), num: true },
        { label: "Models", get: (b) => (b.models || []).join(", ") || "–" },
      ], data.backends, "Backends"),
      h("h2", null, "Engine load (what the routing policy sees)"),
      table([{ label: "Signal", get: (r) => r[0] }, { label: "Value", get: (r) => r[1], num: true, digits: 3 }],
        Object.entries(load), "Engine load"),
    );
  }
}
