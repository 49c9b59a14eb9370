// Rollouts view (sortable, filterable sample table and a group view) and the sample view (conversation + tokens).
// Filters and sort live in the URL hash, so a live refresh or a shared link keeps them.
"use strict";
(() => {
  const { h } = F;
  const PAGE = 200;
  const COLS = [["id", "id"], ["step", "step"], ["idx", "index"], ["grp", "group"], ["reward", "reward"], ["status", "status"],
    ["staleness", "staleness"], ["response_length", "length"], ["trained_tokens", "trained"], ["version_min", "versions"]];
  const go = (params) => { location.hash = `#/rollouts?${new URLSearchParams(Object.entries(params).filter(([, v]) => v !== "" && v !== null && v !== undefined))}`; };

  F.views.rollouts = async (main, _arg, params) => {
    const p = Object.fromEntries(params.entries());
    const mode = p.mode || "samples";
    const set = (k, v) => go({ ...p, [k]: v, offset: "" });
    const steps = F.state.summary.steps;
    const controls = h("div", { class: "controls" },
      h("button", { id: "mode-samples", class: mode === "samples" ? "on" : "", onclick: () => set("mode", "") }, "samples"),
      h("button", { id: "mode-groups", class: mode === "groups" ? "on" : "", onclick: () => set("mode", "groups") }, "groups"),
      h("label", {}, "step"), h("select", { id: "f-step", onchange: (e) => set("step", e.target.value) },
        h("option", { value: "" }, "all"), steps.map((st) => h("option", { value: st, selected: String(st) === p.step }, st))));
    main.append(h("h2", { text: "Rollouts" }), controls);
    if (mode === "groups") return groups(main, p);

    const q = new URLSearchParams({ sort: p.sort || "id", order: p.order || "asc", limit: PAGE, offset: p.offset || 0 });
    for (const k of ["step", "status", "group", "q"]) if (p[k]) q.set(k, p[k]);
    const d = await F.api(`api/samples?${q}`);
    controls.append(
      h("label", {}, "status"), h("select", { id: "f-status", onchange: (e) => set("status", e.target.value) },
        h("option", { value: "" }, "all"), d.statuses.map((st) => h("option", { value: st, selected: st === p.status }, st))),
      h("label", {}, "group"), h("input", { id: "f-group", type: "number", min: 0, style: "width:70px", value: p.group || "", onchange: (e) => set("group", e.target.value) }),
      h("input", { id: "f-q", placeholder: "search prompt / response", value: p.q || "", onchange: (e) => set("q", e.target.value) }));
    main.append(F.message(d.message));
    const sort = q.get("sort"), order = q.get("order");
    const head = h("tr", {}, COLS.map(([key, label]) => h("th", {
      "data-sort": key, class: ["reward", "staleness", "response_length", "trained_tokens", "id", "step", "idx", "grp"].includes(key) ? "num" : "",
      onclick: () => go({ ...p, sort: key, order: sort === key && order === "asc" ? "desc" : "asc", offset: "" }),
    }, label + (sort === key ? (order === "asc" ? " ▲" : " ▼") : ""))), h("th", {}, "prompt"), h("th", {}, "response"));
    const rows = d.rows.map((r) => h("tr", { class: "sample-row", "data-id": r.id, "data-step": r.step, "data-reward": r.reward ?? "", "data-staleness": r.staleness ?? "", "data-status": r.status, onclick: () => { location.hash = `#/sample/${r.id}`; } },
      h("td", { class: "num", text: r.id }), h("td", { class: "num", text: r.step }), h("td", { class: "num", text: r.idx }), h("td", { class: "num", text: r.grp }),
      h("td", { class: "num", text: F.fmt(r.reward) }), h("td", {}, h("span", { class: `badge st-${r.status}`, title: r.status_reason || "" }, r.status)),
      h("td", { class: "num", text: F.fmt(r.staleness) }), h("td", { class: "num", text: r.response_length }), h("td", { class: "num", text: r.trained_tokens }),
      h("td", { text: r.version_min === r.version_max ? F.fmt(r.version_min) : `${r.version_min}–${r.version_max}` }),
      h("td", { class: "text", text: r.prompt || "" }), h("td", { class: "text", text: r.response || "" })));
    const off = Number(p.offset || 0);
    main.append(h("div", { class: "controls" }, h("span", { id: "rows-shown", class: "muted" }, `showing ${d.rows.length ? off + 1 : 0}–${off + d.rows.length} of ${d.total}`),
      off > 0 ? h("button", { onclick: () => go({ ...p, offset: Math.max(0, off - PAGE) }) }, "previous") : null,
      off + d.rows.length < d.total ? h("button", { onclick: () => go({ ...p, offset: off + PAGE }) }, "next") : null),
    h("table", { id: "samples-table" }, head, rows));
  };

  async function groups(main, p) {
    const d = await F.api(`api/groups${p.step ? "?step=" + p.step : ""}`);
    main.append(F.message(d.message));
    const head = h("tr", {}, ["step", "group", "n", "reward mean", "± std", "min", "max", "zero variance", "statuses", "mean length"].map((t) => h("th", { text: t, class: ["zero variance", "statuses"].includes(t) ? "" : "num" })));
    main.append(h("table", { id: "groups-table" }, head, d.groups.map((g) => h("tr", {
      class: "group-row", "data-step": g.step, "data-group": g.group, "data-zero": String(g.zero_variance),
      onclick: () => go({ step: g.step, group: g.group }),
    }, h("td", { class: "num", text: g.step }), h("td", { class: "num", text: g.group }), h("td", { class: "num", text: g.n }),
      h("td", { class: "num", text: F.fmt(g.reward_mean) }), h("td", { class: "num", text: F.fmt(g.reward_std) }),
      h("td", { class: "num", text: F.fmt(g.reward_min) }), h("td", { class: "num", text: F.fmt(g.reward_max) }),
      h("td", {}, g.zero_variance ? h("span", { class: "badge warn" }, "zero variance") : ""),
      h("td", {}, Object.entries(g.statuses).map(([st, n]) => h("span", { class: `badge st-${st}`, style: "margin-right:4px" }, `${st} ${n}`))),
      h("td", { class: "num", text: F.fmt(g.length_mean) })))));
  }

  // ---------------------------------------------------------------- sample view
  const MODES = {
    logprob: "rollout log-prob", diff: "train − rollout log-prob", advantage: "advantage", loss_mask: "loss mask", version: "weight version", source: "source",
  };
  const SOURCE_COLORS = { policy: "#dbeafe", tool: "#fde68a", env: "#d9f99d", template: "#e5e7eb" };
  const diverging = (v, max) => { const a = Math.min(1, Math.abs(v) / (max || 1)); return `hsl(${v >= 0 ? 4 : 215}, 85%, ${Math.round(100 - 42 * a)}%)`; };

  function colours(t, mode) {
    const n = t.ids.length;
    const get = (i) => {
      if (mode === "logprob") return t.logprob[i];
      if (mode === "diff") return t.train_logprob && t.train_logprob[i] !== null && t.logprob[i] !== null ? t.train_logprob[i] - t.logprob[i] : null;
      if (mode === "advantage") return t.advantage ? t.advantage[i] : null;
      return t[mode] ? t[mode][i] : null;
    };
    const vals = Array.from({ length: n }, (_, i) => get(i));
    const max = Math.max(1e-9, ...vals.filter((v) => typeof v === "number").map(Math.abs));
    const colour = (v) => {
      if (v === null || v === undefined) return "#f0f0f0";
      if (mode === "logprob") return `hsl(${Math.round(120 * Math.exp(v))}, 75%, 78%)`;
      if (mode === "diff" || mode === "advantage") return diverging(v, max);
      if (mode === "loss_mask") return v ? "#cfe3ff" : "#e6e6e6";
      if (mode === "version") return `hsl(${(v * 67 + 200) % 360}, 65%, 82%)`;
      return SOURCE_COLORS[v] || "#eee";
    };
    const legend = {
      logprob: h("span", {}, "p=0", h("span", { class: "scale", style: "background:linear-gradient(90deg,hsl(0,75%,78%),hsl(60,75%,78%),hsl(120,75%,78%))" }), "p=1"),
      diff: h("span", {}, `−${F.fmt(max)}`, h("span", { class: "scale", style: "background:linear-gradient(90deg,hsl(215,85%,58%),#fff,hsl(4,85%,58%))" }), `+${F.fmt(max)}`),
      loss_mask: h("span", {}, h("i", { style: "background:#cfe3ff" }), "trained ", h("i", { style: "background:#e6e6e6" }), "not trained"),
      version: h("span", {}, [...new Set(vals)].map((v) => h("span", { style: "margin-right:8px" }, h("i", { style: `background:${colour(v)}` }), `v${v}`))),
      source: h("span", {}, Object.entries(SOURCE_COLORS).map(([k, c]) => h("span", { style: "margin-right:8px" }, h("i", { style: `background:${c}` }), k))),
    };
    legend.advantage = legend.diff;
    return { vals, colour, legend: legend[mode] };
  }

  F.views.sample = async (main, arg) => {
    if (!arg) {
      const first = await F.api("api/samples?limit=1");
      if (!first.rows.length) { main.append(h("h2", { text: "Sample" }), F.message(first.message || "no samples recorded yet")); return; }
      arg = first.rows[0].id;
    }
    const d = await F.api(`api/samples/${encodeURIComponent(arg)}`);
    const t = d.tokens;
    const nav = h("span", { class: "controls", style: "display:inline-flex;margin-left:12px" },
      d.prev_id ? h("a", { href: `#/sample/${d.prev_id}`, id: "prev-sample" }, "← previous") : null,
      d.next_id ? h("a", { href: `#/sample/${d.next_id}`, id: "next-sample" }, "next →") : null);
    main.append(h("h2", {}, `Sample ${d.id}`, nav));
    const kv = (k, v) => h("div", {}, h("span", { text: k }), v);
    main.append(h("div", { class: "card kv", id: "sample-meta" },
      kv("step", d.step), kv("index / group", `${d.idx} / ${d.grp}`), kv("reward", F.fmt(d.reward, 4) + (d.reward_detail ? " " + JSON.stringify(d.reward_detail) : "")),
      kv("status", h("span", { class: `badge st-${d.status}` }, d.status + (d.status_reason ? `: ${d.status_reason}` : ""))),
      kv("staleness", F.fmt(d.staleness)), kv("weight versions", d.version_min === d.version_max ? F.fmt(d.version_min) : `${d.version_min}–${d.version_max}`),
      kv("prompt / response tokens", `${d.prompt_length} / ${d.response_length}`), kv("trained tokens", d.trained_tokens)));
    const convo = h("div", { class: "card", id: "conversation", style: "margin-top:12px" }, h("h3", { text: "Conversation" }));
    const msgs = d.messages || [{ role: "user", content: d.prompt_text || "" }];
    for (const m of msgs) convo.append(h("div", { class: `msg ${m.role}` }, h("b", { text: m.role }), typeof m.content === "string" ? m.content : JSON.stringify(m.content)));
    convo.append(h("div", { class: "msg assistant" }, h("b", { text: "response" }), d.response_text ?? t.text?.join("") ?? "(text not recorded: token ids below)"));
    main.append(convo);

    const mode = F.state.tokenMode || "logprob";
    const select = h("select", { id: "colour-by", onchange: (e) => { F.state.tokenMode = e.target.value; paint(); } },
      Object.entries(MODES).map(([k, v]) => h("option", { value: k, selected: k === mode }, v)));
    const legend = h("span", { id: "token-legend", class: "legend", style: "display:inline-flex;margin:0 0 0 10px" });
    const info = h("div", { id: "tokinfo" }, "hover a token for its provenance");
    const box = h("div", { id: "tokens", "data-count": t.ids.length });
    const fields = (i) => [`#${i}`, `id ${t.ids[i]}`, t.text ? `text ${JSON.stringify(t.text[i])}` : null, `logprob ${F.fmt(t.logprob[i], 4)}`,
      t.train_logprob ? `train ${F.fmt(t.train_logprob[i], 4)} (Δ ${F.fmt(t.train_logprob[i] - t.logprob[i], 3)})` : "train –",
      `adv ${t.advantage ? F.fmt(t.advantage[i], 4) : "–"}`, `mask ${t.loss_mask[i]}`, `v${t.version[i]}`, t.source[i]].filter(Boolean).join(" · ");
    const spans = t.ids.map((id, i) => {
      const text = t.text ? t.text[i] : `⟨${id}⟩`;
      const el = h("span", { class: `tok${t.loss_mask[i] ? "" : " masked"}`, "data-i": i, "data-source": t.source[i], "data-version": t.version[i], title: fields(i) },
        text.replace(/\n/g, "↵\n") || "∅");
      el.addEventListener("mouseenter", () => { info.textContent = fields(i); });
      return el;
    });
    box.append(...spans);
    function paint() {
      const c = colours(t, select.value);
      spans.forEach((el, i) => { el.style.background = c.colour(c.vals[i]); el.dataset.value = c.vals[i] ?? ""; });
      legend.replaceChildren(c.legend || "");
      box.dataset.mode = select.value;
    }
    const missing = [!t.train_logprob && "train log-probs", !t.advantage && "advantages", !t.text && "token text"].filter(Boolean);
    main.append(h("div", { class: "card", style: "margin-top:12px" },
      h("h3", {}, `Tokens (${t.ids.length} response tokens, ${t.loss_mask.reduce((a, b) => a + b, 0)} trained)`),
      h("div", { class: "controls" }, h("label", {}, "colour by"), select, legend),
      missing.length ? h("div", { class: "muted" }, `not recorded for this sample: ${missing.join(", ")}`) : null, info, box));
    paint();
  };
})();
