// The window / filter / refresh controls the Traffic and Speculation pages share.
import { h } from "./api.js";

// Window -> step: about 60 points whatever the window.
export const WINDOWS = [
  { label: "Last 15 minutes", window: 900, step: 15 },
  { label: "Last hour", window: 3600, step: 60 },
  { label: "Last 6 hours", window: 21600, step: 360 },
  { label: "Last 24 hours", window: 86400, step: 1440 },
  { label: "Last 7 days", window: 604800, step: 10800 },
];

function select(id, label, options, value, onchange) {
  return h("div", { class: "field" }, h("label", { for: id }, label),
    h("select", { id, onchange }, options.map(([v, text]) => h("option", { value: v, selected: String(v) === String(value) }, text))));
}

export class Controls {
  constructor(prefix, onchange, { refresh = 15 } = {}) {
    this.prefix = prefix;
    this.onchange = onchange;
    this.state = { window: 1, model: "", backend: "", refresh };
    this.el = h("form", { class: "controls", "aria-label": "Window and filters", onsubmit: (e) => e.preventDefault() });
    this.timer = null;
    this.render({ models: [], backends: [] });
  }

  render(choices) {
    const s = this.state;
    const models = [["", "All models"], ...choices.models.map((m) => [m, m])];
    const backends = [["", "All backends"], ...choices.backends.map((b) => [b, b])];
    if (s.model && !choices.models.includes(s.model)) models.push([s.model, s.model]);
    if (s.backend && !choices.backends.includes(s.backend)) backends.push([s.backend, s.backend]);
    const change = (key) => (e) => { s[key] = e.target.value; this.onchange(); this.schedule(); };
    this.el.replaceChildren(
      select(`${this.prefix}-window`, "Window", WINDOWS.map((w, i) => [i, w.label]), s.window, change("window")),
      select(`${this.prefix}-model`, "Model", models, s.model, change("model")),
      select(`${this.prefix}-backend`, "Backend", backends, s.backend, change("backend")),
      select(`${this.prefix}-refresh`, "Refresh", [[0, "Off"], [5, "Every 5 s"], [15, "Every 15 s"], [60, "Every minute"]], s.refresh, change("refresh")),
    );
  }

  query() {
    const w = WINDOWS[Number(this.state.window)];
    const q = new URLSearchParams({ window: w.window, step: w.step });
    if (this.state.model) q.set("model", this.state.model);
    if (this.state.backend) q.set("backend", this.state.backend);
    return q.toString();
  }

  // Live refresh while the page is shown and the tab visible.
  schedule() {
    clearTimeout(this.timer);
    const every = Number(this.state.refresh);
    if (!every) return;
    this.timer = setTimeout(() => {
      if (!document.hidden && this.visible()) this.onchange();
      this.schedule();
    }, every * 1000);
  }

  visible() { return !this.el.closest(".page").hidden; }

  stop() { clearTimeout(this.timer); }
}
