// Backends: health, breaker, load (and where it comes from), speculation and models of each, the
// replica groups (one routing arm each), and the engine load the policy sees.
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
        { label: "Running", get: (b) => (b.policy_load && b.policy_load.running !== null && b.policy_load.running !== undefined ? b.policy_load.running : "–"), num: true },
        { label: "Waiting", get: (b) => b.num_waiting ?? (b.policy_load && b.policy_load.waiting !== null && b.policy_load.waiting !== undefined ? b.policy_load.waiting : "–"), num: true },
        { label: "Load from", get: (b) => (b.metrics ? (b.metrics.error ? h("span", { class: "badge warn", title: b.metrics.error }, `gateway (${b.metrics.error.slice(0, 40)})`) : b.metrics.load_source) : "engine") },
        { label: "Speculation", get: (b) => (b.metrics ? (b.speculation ?? "off") : "per request") },
        { label: "Latency (EWMA)", get: (b) => (b.latency_ewma_ms === null || b.latency_ewma_ms === undefined ? "–" : `${fmt(b.latency_ewma_ms, 1)} ms`), num: true },
        { label: "Models", get: (b) => (b.models || []).join(", ") || "–" },
      ], data.backends, "Backends"),
      ...((data.groups || []).length ? [
        h("h2", null, "Replica groups (one routing arm each)"),
        table([
          { label: "Group", get: (g) => g.name },
          { label: "Replicas", get: (g) => g.members.join(", ") },
          { label: "Speculation", get: (g) => g.speculation ?? "off" },
          { label: "Mean batch", get: (g) => (g.policy_load ? g.policy_load.batch : "–"), num: true },
        ], data.groups, "Replica groups"),
      ] : []),
      h("h2", null, "Engine load (what the routing policy sees)"),
      table([{ label: "Signal", get: (r) => r[0] }, { label: "Value", get: (r) => r[1], num: true, digits: 3 }],
        Object.entries(load), "Engine load"),
    );
  }
}
