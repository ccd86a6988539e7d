// Charts drawn as SVG by hand (no library): time-series lines and stacked bars, horizontal bar
// lists. Each chart is a <figure> with a caption, an SVG the screen reader reads as one image with
// a summary, a legend, and its numbers as a table under a disclosure.
import { h, fmt } from "./api.js";

export const COLORS = ["#0b5cad", "#d1242f", "#1a7f37", "#9a6700", "#8250df", "#bf3989", "#0a7d8c", "#57606a", "#e16f24", "#4d2d00"];
// Drawn in the units of the screen it is shown on (narrower on a phone), so text stays legible.
let W = 640, H = 240;
const L = 56, R = 14, T = 12, B = 30;

function size() {
  const narrow = window.innerWidth < 600;
  W = narrow ? 400 : 640;
  H = narrow ? 220 : 240;
  return narrow ? 3 : 6;
}

// The axis top and how many gridlines, so that each gridline is a round number (integers only
// when `whole`, as for counts).
function niceMax(v, whole = false) {
  if (!(v > 0)) return { max: whole ? 4 : 1, ticks: 4 };
  if (whole && v <= 4) return { max: 4, ticks: 4 };
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 2.5, 4, 5, 10]) {
    if (m * p >= v) return { max: m * p, ticks: m === 1 || m === 2 || m === 4 ? 4 : 5 };
  }
  return { max: 10 * p, ticks: 5 };
}

function clock(t, span) {
  const d = new Date(t * 1000);
  const hm = d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", hourCycle: "h23" });
  return span > 2 * 86400 ? d.toLocaleDateString([], { month: "short", day: "numeric" }) + " " + hm : hm;
}

function frame(svg, times, step, scale, yFormat, ticks) {
  const { max, ticks: lines } = scale;
  const t0 = times[0], t1 = times[times.length - 1] + step;
  const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
  const y = (v) => T + (1 - v / max) * (H - T - B);
  for (let i = 0; i <= lines; i++) {
    const v = (max * i) / lines;
    svg.append(h("line", { class: "grid", x1: L, x2: W - R, y1: y(v), y2: y(v) }));
    svg.append(h("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end" }, yFormat(v)));
  }
  ticks = Math.min(ticks, times.length);
  for (let i = 0; i <= ticks; i++) {
    const t = t0 + ((t1 - t0) * i) / ticks;
    svg.append(h("text", { x: x(t), y: H - 8, "text-anchor": i === 0 ? "start" : i === ticks ? "end" : "middle" }, clock(t, t1 - t0)));
  }
  svg.append(h("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  svg.append(h("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  return { x, y };
}

function dataTable(times, series, yFormat) {
  const rows = times.map((t, i) => h("tr", null, h("th", { scope: "row" }, new Date(t * 1000).toLocaleString()),
    series.map((s) => h("td", { class: "num" }, s.values[i] === null || s.values[i] === undefined ? "–" : yFormat(s.values[i])))));
  return h("details", { class: "data" }, h("summary", null, "Data table"),
    h("div", { class: "table-wrap" }, h("table", null,
      h("thead", null, h("tr", null, h("th", { scope: "col" }, "Step start"), series.map((s) => h("th", { scope: "col", class: "num" }, s.name)))),
      h("tbody", null, rows))));
}

function legend(series) {
  return h("ul", { class: "legend" }, series.map((s, i) => h("li", null,
    h("span", { class: "swatch", "data-color": s.color || COLORS[i % COLORS.length] }), s.name)));
}

function paintSwatches(fig) {
  // Colours through the CSSOM (allowed by the page's CSP, unlike style attributes).
  for (const el of fig.querySelectorAll("[data-color]")) el.style.background = el.dataset.color;
}

function summary(series, yFormat) {
  return series.map((s) => {
    const last = [...s.values].reverse().find((v) => v !== null && v !== undefined);
    const peak = Math.max(...s.values.filter((v) => v !== null && v !== undefined), 0);
    return `${s.name}: latest ${last === undefined ? "none" : yFormat(last)}, peak ${yFormat(peak)}`;
  }).join("; ");
}

// series: [{name, values: [number|null per time], color?}]
export function lineChart({ id, title, times, step, series, yFormat = (v) => fmt(v) }) {
  const ticks = size();
  const vals = series.flatMap((s) => s.values).filter((v) => v !== null && v !== undefined);
  const scale = niceMax(Math.max(0, ...vals));
  const svg = h("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-labelledby": `${id}-cap ${id}-sum`, "data-chart": id });
  const { x, y } = frame(svg, times, step, scale, yFormat, ticks);
  const lines = h("g"), dots = h("g");
  svg.append(lines, dots);
  series.forEach((s, i) => {
    const color = s.color || COLORS[i % COLORS.length];
    let d = "";
    let pen = false;
    s.values.forEach((v, j) => {
      if (v === null || v === undefined) { pen = false; return; }
      const px = x(times[j] + step / 2), py = y(v);
      d += `${pen ? "L" : "M"}${px.toFixed(1)},${py.toFixed(1)}`;
      pen = true;
      dots.append(h("circle", { cx: px.toFixed(1), cy: py.toFixed(1), r: 2.5, fill: color },
        h("title", null, `${s.name} ${clock(times[j], 0)}: ${yFormat(v)}`)));
    });
    if (d) lines.append(h("path", { class: "line", d, stroke: color, "data-series": s.name }));
  });
  return figure(id, title, svg, series, times, yFormat, vals.length === 0);
}

// Stacked bars: series values are counts per time.
export function stackedBars({ id, title, times, step, series, yFormat = (v) => fmt(v) }) {
  const ticks = size();
  const totals = times.map((_, i) => series.reduce((a, s) => a + (s.values[i] || 0), 0));
  const scale = niceMax(Math.max(0, ...totals), true);
  const svg = h("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-labelledby": `${id}-cap ${id}-sum`, "data-chart": id });
  const { x, y } = frame(svg, times, step, scale, yFormat, ticks);
  const bw = Math.max(1, x(times[0] + step) - x(times[0]) - 1);
  times.forEach((t, i) => {
    let base = 0;
    series.forEach((s, k) => {
      const v = s.values[i] || 0;
      if (!v) return;
      svg.append(h("rect", { x: x(t).toFixed(1), y: y(base + v).toFixed(1), width: bw.toFixed(1), height: (y(base) - y(base + v)).toFixed(1), fill: s.color || COLORS[k % COLORS.length], "data-series": s.name },
        h("title", null, `${s.name} ${clock(t, 0)}: ${yFormat(v)}`)));
      base += v;
    });
  });
  return figure(id, title, svg, series, times, yFormat, totals.every((v) => !v));
}

function figure(id, title, svg, series, times, yFormat, empty) {
  const fig = h("figure", { class: "chart", id },
    h("figcaption", { id: `${id}-cap` }, title),
    h("p", { id: `${id}-sum`, class: "sr-only" }, empty ? "No data in this window." : summary(series, yFormat)),
    svg,
    empty ? h("p", { class: "empty" }, "No data in this window.") : null,
    legend(series),
    dataTable(times, series, yFormat));
  paintSwatches(fig);
  return fig;
}

// Horizontal bars: items [{name, value, label?, chosen?}]
export function barList({ id, title, items, format = (v) => fmt(v) }) {
  const max = Math.max(0, ...items.map((i) => i.value || 0)) || 1;
  const list = h("ul", { class: "bars", "aria-labelledby": `${id}-cap` }, items.map((it) => {
    const bar = h("span", { class: "bar", "data-width": ((100 * (it.value || 0)) / max).toFixed(1) });
    return h("li", { class: it.chosen ? "chosen" : null, "data-name": it.name },
      h("span", { class: "name" }, it.name, it.chosen ? " (chosen)" : ""), h("span", { class: "track", "aria-hidden": "true" }, bar),
      h("span", { class: "num" }, it.label ?? format(it.value)));
  }));
  const fig = h("figure", { class: "chart", id }, h("figcaption", { id: `${id}-cap` }, title),
    items.length ? list : h("p", { class: "empty" }, "Nothing to show."));
  for (const b of fig.querySelectorAll("[data-width]")) b.style.width = b.dataset.width + "%";
  return fig;
}
