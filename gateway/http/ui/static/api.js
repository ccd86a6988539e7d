// The admin API as the dashboard calls it: same-origin cookie session, the CSRF header on every
// call that changes something, OpenAI-shaped errors turned into messages. Plus DOM helpers that
// only ever set text (never HTML), so no value from the server can inject markup.

let csrf = null;

export async function startSession() {
  const r = await fetch("/admin/ui/session", { credentials: "same-origin", cache: "no-store" });
  if (r.status === 401) { location.assign("/admin/ui/login"); return null; }
  const info = await r.json();
  csrf = info.csrf_token;
  return info;
}

export class ApiError extends Error {
  constructor(status, body) {
    const err = (body && body.error) || {};
    super(err.message || `HTTP ${status}`);
    this.status = status;
    this.code = err.code;
  }
}

export async function api(method, path, body) {
  const headers = { accept: "application/json" };
  if (method !== "GET") headers["x-csrf-token"] = csrf || "";
  if (body !== undefined) headers["content-type"] = "application/json";
  const r = await fetch(path, {
    method, headers, credentials: "same-origin", cache: "no-store",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (r.status === 401) { location.assign("/admin/ui/login"); throw new ApiError(401, null); }
  const text = await r.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (e) { data = null; }
  if (!r.ok) throw new ApiError(r.status, data);
  return data;
}

export async function signOut() {
  await fetch("/admin/ui/logout", { method: "POST", credentials: "same-origin", headers: { "x-csrf-token": csrf || "" } });
  csrf = null;
  location.assign("/admin/ui/login");
}

// h("p", {class: "x"}, "text", child): an element; attributes set as attributes, text as text nodes.
export function h(tag, attrs, ...children) {
  const ns = ["svg", "path", "line", "text", "g", "rect", "circle", "title", "polyline"].includes(tag)
    ? "http://www.w3.org/2000/svg" : null;
  const el = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export function fmt(v, digits = 1) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof v !== "number") return String(v);
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
  if (Number.isInteger(v)) return String(v);
  return v.toFixed(a < 1 ? Math.max(digits, 2) : digits);
}

export const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%");
export const ms = (v) => (v === null || v === undefined ? "–" : fmt(v, 1) + " ms");

export function table(columns, rows, caption) {
  const head = h("tr", null, columns.map((c) => h("th", { scope: "col", class: c.num ? "num" : null }, c.label)));
  const body = rows.map((row) => h("tr", null, columns.map((c) => {
    const v = c.get(row);
    return h("td", { class: c.num ? "num" : null }, v instanceof Node ? v : fmt(v, c.digits));
  })));
  return h("div", { class: "table-wrap" }, h("table", { "data-table": caption || null },
    caption ? h("caption", { class: "sr-only" }, caption) : null,
    h("thead", null, head), h("tbody", null, rows.length ? body : h("tr", null, h("td", { colspan: columns.length, class: "empty" }, "No data in this window.")))));
}

export function say(message, error = false) {
  const status = document.getElementById("status");
  status.replaceChildren(h("span", { class: error ? "error" : null }, message));
  clearTimeout(say.timer);
  say.timer = setTimeout(() => status.replaceChildren(), error ? 8000 : 4000);
}

// A modal confirmation (the <dialog> of index.html): resolves true on Confirm, false otherwise.
export function confirmAction(title, ...body) {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-title").textContent = title;
  document.getElementById("confirm-text").replaceChildren(...body.map((b) => (b instanceof Node ? b : h("p", null, b))));
  dialog.returnValue = "";
  dialog.showModal();
  document.getElementById("confirm-ok").focus();
  return new Promise((resolve) => dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true }));
}

export function tile(label, value) {
  return h("div", { class: "tile", "data-tile": label }, h("p", { class: "label" }, label), h("p", { class: "value" }, value));
}
