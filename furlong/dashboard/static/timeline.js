// Timeline view: one lane per worker, its phases as coloured spans on a shared wall clock.
// Wheel zooms around the cursor, drag pans, the step picker jumps to one step; the zoom survives live refreshes.
"use strict";
(() => {
  const { h, s } = F;
  const LABEL_W = 150, LANE_H = 26, AXIS_H = 34;
  const zoom = (F.state.timeline = { domain: null, key: null });

  F.views.timeline = async (main, _arg, params) => {
    const step = params.get("step");
    const q = step ? `?step_from=${step}&step_to=${step}` : "";
    const d = await F.api(`api/timeline${q}`);
    const steps = F.state.summary.steps;
    const picker = h("select", { id: "tl-step", onchange: (e) => { location.hash = e.target.value ? `#/timeline?step=${e.target.value}` : "#/timeline"; } },
      h("option", { value: "" }, "all steps"), steps.map((st) => h("option", { value: st, selected: String(st) === step }, `step ${st}`)));
    const seen = new Set(d.lanes.flatMap((l) => l.spans.map((x) => x.phase)));
    const phases = [...F.state.summary.phases.filter((p) => seen.has(p)), ...[...seen].filter((p) => !F.state.summary.phases.includes(p))];
    main.append(h("h2", { text: "Timeline" }), F.message(d.message),
      h("div", { class: "controls" }, h("label", {}, "show "), picker,
        h("button", { id: "tl-zoom-in", onclick: () => scale(0.5) }, "zoom in"),
        h("button", { id: "tl-zoom-out", onclick: () => scale(2) }, "zoom out"),
        h("button", { id: "tl-reset", onclick: () => { zoom.domain = null; draw(); } }, "reset"),
        h("span", { class: "muted" }, "wheel: zoom · drag: pan"),
        h("span", { class: "legend", style: "margin:0" }, phases.map((p) => h("span", {}, h("i", { style: `background:${F.PHASE_COLORS[p] || "#999"}` }), p)))));
    if (!d.lanes.length) return;
    const wrap = h("div", { class: "timeline-wrap" });
    const info = h("div", { id: "tl-info", class: "muted", style: "min-height:18px;margin-top:6px" });
    main.append(wrap, info);
    const t0 = d.t0, full = [0, d.t1 - d.t0];
    const key = `${step}|${d.t0}`;
    if (zoom.key !== key) { zoom.key = key; zoom.domain = null; }
    const width = Math.max(600, document.documentElement.clientWidth - 36);
    const height = AXIS_H + d.lanes.length * LANE_H + 6;
    const svg = s("svg", { width, height, id: "timeline", "data-lanes": d.lanes.length });
    wrap.append(svg);

    function scale(f, centre) {
      const [a, b] = zoom.domain || full;
      const c = centre ?? (a + b) / 2;
      zoom.domain = [c - (c - a) * f, c + (b - c) * f];
      draw();
    }
    function draw() {
      const [a, b] = zoom.domain || full;
      const span = Math.max(b - a, 1e-6);
      const X = (t) => LABEL_W + ((t - t0 - a) / span) * (width - LABEL_W - 8);
      svg.replaceChildren();
      const clip = s("clipPath", { id: "tl-clip" }, s("rect", { x: LABEL_W, y: 0, width: width - LABEL_W, height }));
      svg.append(s("defs", {}, clip));
      const body = s("g", { "clip-path": "url(#tl-clip)" });
      d.steps.forEach((st, i) => {
        const x = X(st.start), w = Math.max(1, X(st.end) - x);
        body.append(s("rect", { x, y: 14, width: w, height: height - 14, fill: i % 2 ? "#f6f8fa" : "#fff" }));
        body.append(s("text", { x: x + 3, y: 11, class: "step-label", "data-step": st.step }, `step ${st.step}`));
      });
      for (let i = 0; i <= 6; i++) {
        const t = a + (span * i) / 6;
        body.append(s("text", { x: X(t0 + t) + 2, y: 28 }, `${t.toFixed(span < 5 ? 2 : 1)}s`));
      }
      d.lanes.forEach((lane, i) => {
        const y = AXIS_H + i * LANE_H;
        const g = s("g", { class: "lane", "data-worker": lane.worker, "data-spans": lane.spans.length });
        svg.append(s("text", { x: 6, y: y + 16, style: "fill:#1f2328;font-size:11px" }, lane.worker,
          lane.devices.length ? s("tspan", { dx: 6, style: "fill:#656d76" }, lane.devices.join(",")) : null));
        g.append(s("line", { class: "axis", x1: LABEL_W, x2: width, y1: y + LANE_H - 1, y2: y + LANE_H - 1 }));
        for (const sp of lane.spans) {
          const x = X(sp.start), w = Math.max(1, X(sp.end) - x);
          if (x > width || x + w < LABEL_W) continue;
          const dur = sp.end - sp.start;
          const r = s("rect", { class: "span", x, y: y + 3, width: w, height: LANE_H - 7, rx: 2, fill: F.PHASE_COLORS[sp.phase] || "#999", "data-phase": sp.phase, "data-step": sp.step },
            s("title", {}, `${lane.worker} · ${sp.phase} · step ${sp.step} · ${dur.toFixed(3)}s`));
          // A span links to the samples it produced: its step's rollouts (its group's, when it names one).
          const link = sp.step === null || sp.step === undefined ? null : `#/rollouts?step=${sp.step}${sp.attrs && sp.attrs.group !== undefined ? "&group=" + sp.attrs.group : ""}`;
          if (link) { r.style.cursor = "pointer"; r.addEventListener("click", () => { if (!moved) location.hash = link; }); }
          r.addEventListener("mouseenter", () => { info.textContent = `${lane.worker} (${lane.devices.join(",")}) · ${sp.phase} · step ${sp.step} · ${dur.toFixed(3)}s${sp.attrs ? " · " + JSON.stringify(sp.attrs) : ""}`; });
          g.append(r);
        }
        body.append(g);
      });
      svg.append(body);
    }
    svg.addEventListener("wheel", (e) => {
      e.preventDefault();
      const [a, b] = zoom.domain || full;
      const c = a + ((e.offsetX - LABEL_W) / (width - LABEL_W - 8)) * (b - a);
      scale(e.deltaY < 0 ? 0.8 : 1.25, c);
    }, { passive: false });
    let drag = null;
    let moved = false;  // a drag that panned is not a click on a span
    svg.addEventListener("mousedown", (e) => { moved = false; drag = { x: e.clientX, domain: zoom.domain || full }; });
    window.addEventListener("mouseup", () => { drag = null; });
    svg.addEventListener("mousemove", (e) => {
      if (!drag) return;
      const [a, b] = drag.domain;
      if (Math.abs(e.clientX - drag.x) > 2) moved = true;
      const dt = ((e.clientX - drag.x) / (width - LABEL_W - 8)) * (b - a);
      zoom.domain = [a - dt, b - dt];
      draw();
    });
    draw();
  };
})();
