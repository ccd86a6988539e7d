// Policy: the active version and its rules (editable: a new version), retraining, every version
// with its offline evaluation and live traffic, rollback, and a diff of any two versions.
import { api, confirmAction, h, fmt, say, table, tile } from "./api.js";

const THRESHOLDS = [
  ["min_confidence", "Minimum classifier confidence", 0.01],
  ["high_temperature", "High temperature (open chat: off until measured)", 0.05],
  ["max_batch_for_spec", "Largest batch that speculates", 1],
  ["exploration_rate", "Exploration rate", 0.01],
  ["exploration_cap", "Exploration cap", 0.01],
];
const CONTROLLERS = ["goodput", "static", "heuristic"];

export class PolicyPage {
  constructor(root) {
    this.root = root;
    this.body = h("div");
    root.append(this.body);
  }

  show() { this.load(); }
  hide() {}

  async load() {
    try {
      const [policy, versions, stats] = await Promise.all([
        api("GET", "/admin/policy"), api("GET", "/admin/policy/versions?limit=200"),
        api("GET", "/admin/stats?window=720").catch(() => null),
      ]);
      this.policy = policy;
      this.render(policy, versions, stats);
    } catch (e) {
      this.body.replaceChildren(h("p", { class: "error", role: "alert" }, `Could not load the policy: ${e.message}`));
    }
  }

  render(policy, versions, stats) {
    const live = new Map(((stats && stats.by_policy_version) || []).map((r) => [String(r.policy_version), r]));
    this.body.replaceChildren(
      h("div", { class: "tiles" }, tile("Active version", String(policy.version)), tile("Kind", policy.kind),
        tile("Exploration share", `${fmt(100 * policy.exploration_share, 1)}%`),
        tile("Modelled arms", policy.modelled_arms.length ? policy.modelled_arms.join(", ") : "none (rules)")),
      this.editor(policy),
      this.retrainCard(),
      h("h2", null, "Versions"),
      this.versionsTable(versions, live),
      this.diffCard(versions),
    );
  }

  editor(policy) {
    const rules = policy.rules;
    const methods = [...new Set(["off", ...policy.settings.methods, ...Object.values(rules.classes).map((r) => r.method), rules.uncertain.method])];
    const row = (name, rule) => h("tr", { "data-class": name }, h("th", { scope: "row" }, name),
      h("td", null, h("select", { "aria-label": `${name} method`, name: "method" }, methods.map((m) => h("option", { value: m, selected: m === rule.method }, m)))),
      h("td", null, h("input", { type: "number", min: 0, max: 64, step: 1, value: rule.k_min, name: "k_min", "aria-label": `${name} k_min` })),
      h("td", null, h("input", { type: "number", min: 0, max: 64, step: 1, value: rule.k_max, name: "k_max", "aria-label": `${name} k_max` })),
      h("td", null, h("select", { "aria-label": `${name} controller`, name: "controller" }, CONTROLLERS.map((c) => h("option", { value: c, selected: c === rule.controller }, c)))));
    const form = h("form", { class: "card", id: "rules-form", "aria-labelledby": "rules-h", onsubmit: (e) => { e.preventDefault(); this.save(form); } },
      h("h2", { id: "rules-h" }, `Rules of version ${policy.version}`),
      h("div", { class: "table-wrap" }, h("table", null,
        h("thead", null, h("tr", null, ["Class", "Method", "k_min", "k_max", "Controller"].map((c) => h("th", { scope: "col" }, c)))),
        h("tbody", null, Object.entries(rules.classes).map(([n, r]) => row(n, r)), row("uncertain", rules.uncertain)))),
      h("div", { class: "row" }, THRESHOLDS.map(([key, label, step]) => h("div", { class: "field" },
        h("label", { for: `rule-${key}` }, label),
        h("input", { id: `rule-${key}`, name: key, type: "number", step, min: 0, value: rules[key] })))),
      h("div", { class: "row" }, h("div", { class: "field" }, h("label", { for: "rule-note" }, "Note (optional)"),
        h("input", { id: "rule-note", type: "text", maxlength: 500, name: "note" })),
        h("button", { type: "submit", id: "rules-save" }, "Save as a new version…")));
    return form;
  }

  changes(form) {
    const rules = this.policy.rules, patch = {}, lines = [];
    for (const tr of form.querySelectorAll("tr[data-class]")) {
      const name = tr.dataset.class;
      const old = name === "uncertain" ? rules.uncertain : rules.classes[name];
      const diff = {};
      for (const field of ["method", "k_min", "k_max", "controller"]) {
        const el = tr.querySelector(`[name="${field}"]`);
        const value = el.type === "number" ? Number(el.value) : el.value;
        if (value !== old[field]) { diff[field] = value; lines.push(`${name}.${field}: ${old[field]} → ${value}`); }
      }
      if (Object.keys(diff).length) {
        if (name === "uncertain") patch.uncertain = diff; else (patch.classes ||= {})[name] = diff;
      }
    }
    for (const [key] of THRESHOLDS) {
      const value = Number(form.querySelector(`[name="${key}"]`).value);
      if (value !== rules[key]) { patch[key] = value; lines.push(`${key}: ${rules[key]} → ${value}`); }
    }
    return { patch, lines };
  }

  async save(form) {
    const { patch, lines } = this.changes(form);
    if (!lines.length) { say("Nothing changed."); return; }
    const note = form.querySelector('[name="note"]').value.trim();
    if (note) patch.note = note;
    if (!(await confirmAction("Save a new policy version?", "It becomes active at once:", h("ul", null, lines.map((l) => h("li", null, l)))))) return;
    try {
      const out = await api("PUT", "/admin/policy", patch);
      say(`Version ${out.version.version} is now active.`);
      await this.load();
    } catch (e) { say(`Not saved: ${e.message}`, true); }
  }

  retrainCard() {
    const out = h("div", { "aria-live": "polite", id: "retrain-result" });
    const force = h("input", { type: "checkbox", id: "retrain-force" });
    const hours = h("input", { type: "number", id: "retrain-hours", min: 1, step: 1, value: 168 });
    const run = async () => {
      const body = { force: force.checked, window_hours: Number(hours.value) || 168 };
      if (!(await confirmAction("Retrain the policy?", `Fit on the last ${body.window_hours} h of telemetry, evaluate on the newest 20%,` +
        (body.force ? " and make it active whatever the evaluation says." : " and make it active only if it beats the active version.")))) return;
      out.replaceChildren(h("p", null, "Retraining…"));
      try {
        const r = await api("POST", "/admin/policy/retrain", body);
        out.replaceChildren(h("p", null, `Version ${r.version} ${r.promoted ? "promoted: it is now active" : "kept out"} (${r.reason || ""}).`));
        if (r.promoted) await this.load();
      } catch (e) { out.replaceChildren(h("p", { class: "error", role: "alert" }, `Retrain refused: ${e.message}`)); }
    };
    return h("div", { class: "card" }, h("h2", null, "Retrain from telemetry"),
      h("div", { class: "row" },
        h("div", { class: "field" }, h("label", { for: "retrain-hours" }, "Window (hours)"), hours),
        h("div", { class: "field" }, h("label", { for: "retrain-force" }, force, " Promote even if not better")),
        h("button", { type: "button", id: "retrain", onclick: run }, "Retrain…")), out);
  }

  versionsTable(versions, live) {
    const evalText = (v) => {
      const m = v.metrics;
      if (!m || !m.candidate) return "–";
      return `${fmt(m.candidate.value_tokens_per_s, 1)} vs ${fmt(m.current && m.current.value_tokens_per_s, 1)} tok/s`;
    };
    const action = (v) => (v.status === "active" ? h("span", { class: "badge ok" }, "active")
      : h("button", { type: "button", class: "quiet", "data-rollback": v.version, onclick: () => this.rollback(v.version) }, `Roll back to v${v.version}…`));
    return table([
      { label: "Version", get: (v) => v.version, num: true }, { label: "Created", get: (v) => (v.created_at ? new Date(v.created_at).toLocaleString() : "–") },
      { label: "Kind", get: (v) => v.kind }, { label: "Source", get: (v) => v.source }, { label: "Status", get: (v) => v.status },
      { label: "Note", get: (v) => v.note || "" }, { label: "Offline eval (candidate vs current)", get: evalText },
      { label: "Requests (30 d)", get: (v) => (live.get(String(v.version)) || {}).requests ?? 0, num: true },
      { label: "Mean tok/s", get: (v) => (live.get(String(v.version)) || {}).mean_tokens_per_s ?? null, num: true, digits: 1 },
      { label: "Action", get: action },
    ], versions.versions, "Policy versions");
  }

  async rollback(version) {
    if (!(await confirmAction(`Roll back to version ${version}?`, `Its rules and model become active again, as a new version.`))) return;
    try {
      const out = await api("POST", `/admin/policy/rollback/${version}`);
      say(`Rolled back: version ${out.version.version} is now active.`);
      await this.load();
    } catch (e) { say(`Rollback failed: ${e.message}`, true); }
  }

  diffCard(versions) {
    const numbers = versions.versions.map((v) => v.version);
    const pick = (id, label, value) => h("div", { class: "field" }, h("label", { for: id }, label),
      h("select", { id }, numbers.map((n) => h("option", { value: n, selected: n === value }, `v${n}`))));
    const out = h("div", { id: "diff-result", "aria-live": "polite" });
    const run = async () => {
      const a = document.getElementById("diff-a").value, b = document.getElementById("diff-b").value;
      try {
        const d = await api("GET", `/admin/policy/diff?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`);
        const show = (v) => (v === null || v === undefined ? "–" : typeof v === "object" ? JSON.stringify(v) : String(v));
        out.replaceChildren(d.changes.length ? table([{ label: "Setting", get: (c) => c.path }, { label: `v${d.a.version}`, get: (c) => show(c.a) },
          { label: `v${d.b.version}`, get: (c) => show(c.b) }], d.changes, "Differences") : h("p", null, "The two versions are the same."));
      } catch (e) { out.replaceChildren(h("p", { class: "error", role: "alert" }, e.message)); }
    };
    return h("div", { class: "card" }, h("h2", null, "Compare two versions"),
      h("div", { class: "row" }, pick("diff-a", "Version A", numbers[1] ?? numbers[0]), pick("diff-b", "Version B", numbers[0]),
        h("button", { type: "button", id: "diff-run", onclick: run }, "Compare")), out);
  }
}
