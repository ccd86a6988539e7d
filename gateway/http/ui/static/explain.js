// Explain: paste a chat request, see how the gateway would classify and route it (a dry run of the
// routing policy: nothing is generated, no exploration budget is spent).
import { api, h, fmt, pct, table } from "./api.js";
import { barList } from "./charts.js";

export class ExplainPage {
  constructor(root) {
    this.root = root;
    this.text = h("textarea", { id: "explain-body", rows: 10, spellcheck: "false", "aria-describedby": "explain-help" });
    this.out = h("div", { id: "explain-result", "aria-live": "polite" });
    const form = h("form", { class: "card", onsubmit: (e) => { e.preventDefault(); this.run(); } },
      h("label", { for: "explain-body" }, "Chat completion request (JSON)"), this.text,
      h("p", { id: "explain-help", class: "help" }, "The body you would POST to /v1/chat/completions. Nothing is generated."),
      h("button", { type: "submit", id: "explain-run" }, "Explain"));
    root.append(form, this.out);
  }

  async show() {
    if (this.text.value) return;
    let model = "MODEL";
    try {
      const b = await api("GET", "/admin/backends");
      model = (b.backends.find((x) => (x.models || []).length) || { models: [model] }).models[0];
    } catch (e) { /* keep the placeholder */ }
    this.text.value = JSON.stringify({ model, messages: [{ role: "user", content: "Write a Python function that merges two sorted lists." }], max_tokens: 256, temperature: 0 }, null, 2);
  }
  hide() {}

  async run() {
    let body;
    try { body = JSON.parse(this.text.value); } catch (e) {
      this.out.replaceChildren(h("p", { class: "error", role: "alert" }, `Not valid JSON: ${e.message}`)); return;
    }
    try {
      this.render(await api("POST", "/admin/route/explain", body));
    } catch (e) {
      this.out.replaceChildren(h("p", { class: "error", role: "alert" }, `Refused: ${e.message}`));
    }
  }

  render(x) {
    if (x.policy === "static") {
      this.out.replaceChildren(h("p", null, "The routing policy is disabled: the static route decides."), h("pre", null, JSON.stringify(x.route, null, 2)));
      return;
    }
    const d = x.decision;
    const preds = Object.entries(x.predictions || {});
    const arms = x.arms.map((a) => {
      const p = (x.predictions || {})[a];
      return { name: a, value: p ? p.tokens_per_s : 0, label: p ? `${fmt(p.tokens_per_s, 1)} tok/s` + (p.tpot_ms ? `, ${fmt(p.tpot_ms, 1)} ms/token` : "") : "no model (rules)", chosen: a === d.arm };
    });
    this.out.replaceChildren(
      h("div", { class: "card", id: "explain-decision" },
        h("h2", null, "Decision"),
        h("p", null, h("strong", null, "Class: "), h("span", { id: "explain-class" }, x.workload_class), ` (confidence ${pct(x.class_confidence)}${x.class_rule ? `, by rule: ${x.class_rule}` : ""})`),
        h("p", null, h("strong", null, "Chosen arm: "), h("span", { id: "explain-arm" }, d.arm), d.method !== "off" && d.k_max ? ` with K ${d.k_min}–${d.k_max}, controller ${d.controller}` : ""),
        h("p", null, h("strong", null, "Why: "), h("span", { id: "explain-reason" }, d.reason)),
        x.route && x.route.policy_version ? h("p", null, `Policy version ${x.route.policy_version} (${x.route.policy}).`) : null),
      h("div", { class: "charts" },
        barList({ id: "explain-arms", title: preds.length ? "Predicted goodput per arm" : "Arms (the rules decide: no goodput model yet)", items: arms }),
        barList({ id: "explain-probs", title: "Class probabilities", items: Object.entries(x.class_probs || {}).sort((a, b) => b[1] - a[1]).map(([k, v]) => ({ name: k, value: v, label: pct(v), chosen: k === x.workload_class })) })),
      h("h2", null, "Features"),
      table([{ label: "Feature", get: (r) => r[0] }, { label: "Value", get: (r) => r[1], num: true, digits: 3 }], Object.entries(x.features || {}), "Features"),
    );
  }
}
