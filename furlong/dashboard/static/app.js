// furlong dashboard: router, API access, charts, and the overview / engines / advisories views.
// Plain JS + SVG, no library: the page must work offline from a wheel or a laptop without a CDN.
"use strict";
const F = (window.F = {});
const SVGNS = "http://www.w3.org/2000/svg";

F.h = (tag, attrs = {}, ...kids) => {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "text") el.textContent = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const kid of kids.flat()) if (kid !== null && kid !== undefined) el.append(kid.nodeType ? kid : String(kid));
  return el;
};
F.s = (tag, attrs = {}, ...kids) => {
  const el = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== null && v !== undefined) el.setAttribute(k, v);
  for (const kid of kids.flat()) if (kid) el.append(kid.nodeType ? kid : document.createTextNode(String(kid)));
  return el;
};
const { h, s } = F;

F.api = async (path) => {
  const r = await fetch(path);
  let body;
  try { body = await r.json(); } catch (e) { body = { detail: `${r.status} ${r.statusText}` }; }
  if (!r.ok) { const err = new Error(body.detail || r.statusText); err.status = r.status; throw err; }
  return body;
};
F.fmt = (v, d = 3) => (v === null || v === undefined ? "–" : typeof v === "number" ? (Number.isInteger(v) ? String(v) : Number(v.toPrecision(d)).toString()) : String(v));
F.message = (text, cls = "") => (text ? h("div", { class: `message ${cls}` }, text) : document.createTextNode(""));
F.PHASE_COLORS = { generate: "#4e79a7", reward: "#f28e2b", "ref-logprob": "#76b7b2", "forward-backward": "#e15759", optimiser: "#59a14f", "weight-sync": "#edc948", eval: "#b07aa1", idle: "#dcdcdc",
  prefill: "#2b5d8a", decode: "#7aa6d6", paused: "#c9c9c9", "weight-apply": "#d4b000", "weight-push": "#f0d35c", "old-logprob": "#a8d5d1", "checkpoint-save": "#9c755f",
  route: "#bab0ac", retry: "#ff4d4d", filter: "#ffbe7d", "buffer-wait": "#e8e8e8", "tool-call": "#ff9da7", "env-step": "#d37295", "sandbox-run": "#8cd17d", "cores-lent": "#f1ce63" };
F.PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];

// ------------------------------------------------------------------ line chart
// series: [{name, points: [[step, value], ...]}]; one polyline and one dot per point (data-points = count).
F.lineChart = (title, series, { width = 360, height = 170 } = {}) => {
  const m = { l: 46, r: 10, t: 8, b: 22 };
  const pts = series.flatMap((x) => x.points.filter((p) => p[1] !== null));
  const svg = s("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "chart", "data-chart": title });
  if (!pts.length) { svg.append(s("text", { x: width / 2, y: height / 2, "text-anchor": "middle" }, "no data")); return svg; }
  let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...pts.map((p) => p[1])), Math.max(...pts.map((p) => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const pad = (y1 - y0) * 0.06; y0 = y0 >= 0 ? Math.max(0, y0 - pad) : y0 - pad; y1 += pad;
  const X = (v) => m.l + ((v - x0) / (x1 - x0)) * (width - m.l - m.r);
  const Y = (v) => height - m.b - ((v - y0) / (y1 - y0)) * (height - m.t - m.b);
  svg.append(s("line", { class: "axis", x1: m.l, x2: width - m.r, y1: height - m.b, y2: height - m.b }));
  svg.append(s("line", { class: "axis", x1: m.l, x2: m.l, y1: m.t, y2: height - m.b }));
  for (let i = 0; i <= 3; i++) {
    const v = y0 + ((y1 - y0) * i) / 3;
    svg.append(s("text", { x: m.l - 4, y: Y(v) + 3, "text-anchor": "end" }, F.fmt(v, 3)));
    svg.append(s("line", { class: "axis", x1: m.l, x2: width - m.r, y1: Y(v), y2: Y(v), "stroke-dasharray": "2 3", opacity: 0.6 }));
  }
  const steps = [...new Set(pts.map((p) => p[0]))].sort((a, b) => a - b);
  const every = Math.max(1, Math.ceil(steps.length / 8));
  steps.filter((_, i) => i % every === 0).forEach((st) => svg.append(s("text", { x: X(st), y: height - 6, "text-anchor": "middle" }, st)));
  series.forEach((ser, i) => {
    const color = F.PALETTE[i % F.PALETTE.length];
    const good = ser.points.filter((p) => p[1] !== null);
    const g = s("g", { class: "series", "data-metric": ser.name, "data-points": good.length });
    g.append(s("polyline", { fill: "none", stroke: color, "stroke-width": 1.6, points: good.map((p) => `${X(p[0])},${Y(p[1])}`).join(" ") }));
    for (const p of good) g.append(s("circle", { class: "pt", cx: X(p[0]), cy: Y(p[1]), r: good.length > 60 ? 1.2 : 2.4, fill: color, "data-step": p[0] }, s("title", {}, `${ser.name}\nstep ${p[0]}: ${F.fmt(p[1], 5)}`)));
    svg.append(g);
  });
  return svg;
};
F.chartCard = (title, series, opts) => h("div", { class: "card", "data-testid": `card-${title}` }, h("h3", { text: title }), F.lineChart(title, series, opts),
  h("div", { class: "legend" }, series.map((x, i) => h("span", {}, h("i", { style: `background:${F.PALETTE[i % F.PALETTE.length]}` }), x.name))));

// ------------------------------------------------------------------ overview
const OVERVIEW = [
  ["Reward", /reward/], ["Accuracy", /acc/], ["Loss", /^loss\//], ["KL", /(^|[/_])kl/], ["Entropy", /entropy/],
  ["Throughput", /tokens_per_s|throughput|_per_s(ec)?$/], ["Staleness", /stale/], ["Response length", /length_mean/],
];
F.views = {};
F.views.overview = async (main) => {
  const m = await F.api("api/metrics");
  main.append(h("h2", { text: "Overview" }), F.message(m.message));
  const names = m.names.filter((n) => !n.startsWith("engine/"));
  const used = new Set();
  const grid = h("div", { class: "grid" });
  for (const [title, re] of OVERVIEW) {
    const picked = names.filter((n) => re.test(n));
    picked.forEach((n) => used.add(n));
    if (picked.length) grid.append(F.chartCard(title, picked.map((n) => ({ name: n, points: m.series[n] }))));
  }
  main.append(grid);
  const rest = names.filter((n) => !used.has(n));
  if (rest.length) {
    const more = h("div", { class: "grid" }, rest.map((n) => F.chartCard(n, [{ name: n, points: m.series[n] }], { width: 300, height: 130 })));
    main.append(h("details", { style: "margin-top:14px" }, h("summary", { text: `All other metrics (${rest.length})` }), more));
  }
};

// ------------------------------------------------------------------ engines
F.views.engines = async (main) => {
  const d = await F.api("api/engines");
  main.append(h("h2", { text: "Engines" }), F.message(d.message));
  if (!d.engines.length) return;
  const health = (e) => (e.healthy === null ? h("span", { class: "badge" }, "unknown") : e.healthy ? h("span", { class: "badge ok" }, "healthy") : h("span", { class: "badge bad" }, "unhealthy"));
  main.append(h("table", { id: "engines-table" },
    h("tr", {}, ["engine", "health", "queue", "tokens/s", "other fields"].map((t) => h("th", { text: t, class: t === "queue" || t === "tokens/s" ? "num" : "" }))),
    d.engines.map((e) => h("tr", { class: "engine-row", "data-engine": e.id, "data-healthy": String(e.healthy) },
      h("td", { text: `engine/${e.id}` }), h("td", {}, health(e)), h("td", { class: "num", text: F.fmt(e.latest.queue) }),
      h("td", { class: "num", text: F.fmt(e.latest.tokens_per_s, 4) }),
      h("td", { class: "muted", text: Object.keys(e.latest).filter((k) => !["queue", "tokens_per_s", "healthy"].includes(k)).join(", ") })))));
  const fields = ["queue", "tokens_per_s", "healthy"];
  main.append(h("div", { class: "grid", style: "margin-top:12px" }, fields.map((f) =>
    F.chartCard(`engine ${f}`, d.engines.filter((e) => e.series[f]).map((e) => ({ name: `engine/${e.id}`, points: e.series[f] }))))));
};

// ------------------------------------------------------------------ advisories
F.views.advisories = async (main) => {
  const d = await F.api("api/advisories");
  main.append(h("h2", { text: "Advisories" }), F.message(d.message));
  if (!d.advisories.length) main.append(h("p", { class: "muted", id: "no-advisories" }, "Nothing unusual found: no stalls, zero-variance groups, truncation or abort storms, drift or dropped events."));
  for (const a of d.advisories) {
    const steps = a.steps.slice(0, 20).map((st) => h("a", { href: `#/rollouts?step=${st}` }, `step ${st}`));
    main.append(h("div", { class: `card advisory sev-${a.severity}`, "data-kind": a.kind, style: "margin-bottom:8px" },
      h("h3", {}, h("span", { class: `badge ${a.severity === "warn" ? "warn" : ""}` }, a.severity), " ", a.kind),
      h("div", { text: a.message }), steps.length ? h("div", { class: "legend" }, steps) : null));
  }
};

// ------------------------------------------------------------------ router, status, polling
F.state = { summary: null, timer: null, rendering: false };
F.route = () => {
  const [path, query] = (location.hash.slice(2) || "overview").split("?");
  const [view, arg] = path.split("/");
  return { view: F.views[view] ? view : "overview", arg, params: new URLSearchParams(query || "") };
};
F.refreshStatus = async () => {
  const sm = (F.state.summary = await F.api("api/summary"));
  document.getElementById("run-name").textContent = sm.run;
  const age = sm.last_time ? Math.max(0, Date.now() / 1000 - sm.last_time) : null;
  const parts = [`${sm.steps.length} steps`, `${sm.workers.length} workers`, `${sm.counts.samples} samples`];
  if (age !== null) parts.push(`last event ${age < 120 ? Math.round(age) + "s" : Math.round(age / 60) + "min"} ago`);
  parts.push(sm.follow ? "following (live)" : "offline");
  if (sm.dropped_events) parts.push(`⚠ ${sm.dropped_events} dropped events`);
  document.getElementById("status").textContent = parts.join(" · ");
  return sm;
};
F.render = async ({ poll = false } = {}) => {
  // One render at a time; a navigation during a render renders again afterwards (never dropped).
  if (F.state.rendering) { F.state.pending = true; return; }
  F.state.rendering = true;
  const hash = location.hash;
  const r = F.route();
  document.querySelectorAll("#nav a").forEach((a) => a.classList.toggle("active", a.dataset.view === r.view));
  const old = document.getElementById("view");
  const main = h("main", { id: "view" });
  try {
    await F.refreshStatus();
    await F.views[r.view](main, r.arg, r.params, { poll });
  } catch (e) {
    main.append(F.message(`${e.status ? "HTTP " + e.status + ": " : ""}${e.message}`, "error"));
  }
  old.replaceWith(main);
  F.state.rendering = false;
  if (F.state.pending || hash !== location.hash) { F.state.pending = false; return F.render(); }
  // What tests (and scripts) wait on: the view and the exact route now on screen.
  document.body.dataset.ready = r.view;
  document.body.dataset.route = hash;
  F.api("api/advisories").then((d) => { document.getElementById("adv-count").textContent = d.advisories.filter((a) => a.severity === "warn").length || ""; }).catch(() => {});
};
F.start = async () => {
  window.addEventListener("hashchange", () => F.render());
  await F.render();
  const sm = F.state.summary;
  if (sm && sm.follow) F.state.timer = setInterval(() => { if (F.route().view !== "sample") F.render({ poll: true }); }, (sm.poll_s || 2) * 1000);
};
