// The run charts (Plotly), shared by the live page, the report page and the exported HTML
// report. RLCharts.create(container, state) makes one div per chart; draw() (re)draws those whose
// metrics exist. state: {series: {key: {steps, values}}, hists: {name: [{step, edges, counts}]},
// annotations: [{step, text}], knobs: {dotted: value}, config: {section: {key: value}}}.
//
// Drawing live: Plotly redraws a trace only when it is handed new arrays (or extendTraces, or a
// new layout.datarevision); arrays mutated in place are NOT redrawn. So a chart is drawn whole
// (Plotly.react) with copies of the series, and afterwards only the points appended since are
// handed over with Plotly.extendTraces. Whenever anything else changes (a new trace, a series
// replaced or shortened -- thinned, rewound --, markers off past 60 points, a knob-change
// annotation, η or the mismatch band, the title) the chart is drawn whole again with a new
// datarevision.
//
// Line charts are SVG ("scatter"), never WebGL: Chromium keeps at most 16 WebGL contexts per
// page and drops the oldest, so with ~13 scattergl charts the first ones drawn (the system
// chart first of all) came out empty.
//
// Nothing here inserts user text as HTML, and text handed to Plotly (titles, legend names,
// annotations, hover text) goes through plotlyText(): Plotly renders a subset of HTML in those.
//
// The helpers every page script shares are common.js' (RLCommon: el, fmt, plotlyText, ...);
// holdable() here is the hover-hold of a live chart, used by these charts and by the timeline
// (timeline.js).
(function () {
  "use strict";
  const HOLD_MS = 10000;   // the longest a resting pointer holds a live chart still

  const el = RLCommon.el, fmt = RLCommon.fmt, plotlyText = RLCommon.plotlyText;   // common.js, loaded first
  // The hover-hold. Any redraw of a Plotly div (extendTraces included) removes its hover label,
  // and a live run brings a step a second or faster: while the pointer rests on a point of `div`,
  // the div is held (data-held="1"), for at most HOLD_MS, and catches up when the pointer leaves.
  // holdable(div, redraw) -> {defer()}: a draw calls defer() first and, when it returns true
  // (held), draws nothing: redraw() runs once on release. Call it once Plotly has drawn the div
  // (div.on exists from then); a second call for the same div returns the same hold.
  function holdable(div, redraw) {
    if (div._rlHold) return div._rlHold;
    let held = false, pending = false, timer = null;
    function release() {
      clearTimeout(timer);
      held = false;
      div.removeAttribute("data-held");
      if (pending) { pending = false; redraw(); }
    }
    div.on("plotly_hover", function () {
      held = true;
      div.setAttribute("data-held", "1");
      clearTimeout(timer);
      timer = setTimeout(release, HOLD_MS);
    });
    div.on("plotly_unhover", release);
    div._rlHold = { defer: function () { if (held) pending = true; return held; } };
    return div._rlHold;
  }
  // The chart list and the histogram axes come from the trainer's one declaration of metric
  // names (trainer/observe/metric_names.py), which every page embeds as JSON (#chart-specs).
  function registry() {
    const el = document.getElementById("chart-specs");
    return el ? JSON.parse(el.textContent) : { charts: [], histogram_axes: {} };
  }
  // names matching a pattern, one per device, in device order
  const matching = (series, pattern) => Object.keys(series).filter(k => new RegExp(pattern).test(k))
    .sort((a, b) => (parseInt((a.match(/\d+/) || [0])[0], 10) - parseInt((b.match(/\d+/) || [0])[0], 10)));

  function histAxis(name) {
    const axes = registry().histogram_axes || {};
    if (axes[name]) return axes[name];
    if (/(^|[/_])(len|length|tokens?)($|[/_])/.test(name)) return "tokens";
    if (/staleness|version|age/.test(name)) return "policy versions";
    return name;
  }

  function specs(state) {
    return registry().charts.map(function (spec) {
      const c = Object.assign({}, spec);
      const useFallback = () => spec.fallback && !state.series[(spec.keys || [])[0]];
      if (spec.fallback) c.title = () => useFallback() ? spec.fallback.title : spec.title;
      if (spec.keys || spec.pattern || spec.fallback) {
        c.keys = function () {
          if (useFallback()) return spec.fallback.keys;
          const fixed = (spec.keys || []).filter(k => !spec.pattern || state.series[k]);
          return spec.pattern ? fixed.concat(matching(state.series, spec.pattern)) : fixed;
        };
      }
      return c;
    });
  }

  function findEta(state) {
    const cfg = state.config || {};
    for (const sec in cfg) for (const k in cfg[sec])
      if (/^(eta|max_staleness|staleness(_bound)?)$/.test(k)) {
        const name = sec + "." + k;
        return { key: name, value: (state.knobs || {})[name] !== undefined ? state.knobs[name] : cfg[sec][k] };
      }
    return null;
  }

  // async.staleness_schedule's points still ahead of `step` (the run's current knob value, else its
  // config's), as the η chart's dashed step line: from `step` at the η in force (`eta`), each
  // point's η from its step (a point applies at the boundary after its step: where its ⚙ lands),
  // on to run.max_steps. The server refuses a bad schedule (trainer/rollout/staleness_schedule.py);
  // a part that does not read as STEP:ETA here is skipped. Returns {x, y} or null when none is ahead.
  function scheduleAhead(state, step, eta) {
    const cfg = state.config || {}, knobs = state.knobs || {};
    const text = knobs["async.staleness_schedule"] !== undefined ? knobs["async.staleness_schedule"]
      : (cfg.async || {}).staleness_schedule;
    if (typeof text !== "string" || !text.trim() || eta === null) return null;
    const ahead = text.split(",").map(p => p.trim().match(/^(\d+)\s*:\s*(\d+)$/)).filter(Boolean)
      .map(m => ({ step: +m[1], eta: +m[2] })).filter(p => p.step > step);
    if (!ahead.length) return null;
    const last = ahead[ahead.length - 1].step, end = Math.max(last, Number((cfg.run || {}).max_steps) || last);
    return { x: [step].concat(ahead.map(p => p.step), [end]),
             y: [eta].concat(ahead.map(p => p.eta), [ahead[ahead.length - 1].eta]) };
  }

  // The mismatch band of a chart with "band": the ends of [mismatch.lower, mismatch.upper] as the
  // |Δ log p| (|log pi_old - log pi_rollout|, the chart's y2 axis) where a token's ratio
  // ρ = pi_old / pi_rollout leaves it: ln(upper) (ρ above upper) and |ln(lower)| (ρ below lower;
  // none when lower is 0). The run's current knob values, else its config's, as for η. Returns
  // [{y, text}] (one line when both ends sit at the same |Δ log p|: 0.5 and 2), or [].
  function findBand(state) {
    const cfg = (state.config || {}).mismatch || {}, knobs = state.knobs || {};
    const value = k => knobs["mismatch." + k] !== undefined ? knobs["mismatch." + k] : cfg[k];
    const lower = Number(value("lower")), upper = Number(value("upper"));
    const up = isFinite(upper) && upper > 0 ? Math.log(upper) : null;
    const low = isFinite(lower) && lower > 0 ? Math.abs(Math.log(lower)) : null;
    if (up !== null && low !== null && Math.abs(up - low) <= 1e-9 * Math.max(1, up))
      return [{ y: up, text: "band: " + fmt(lower) + " ≤ ρ ≤ " + fmt(upper) }];
    const out = [];
    if (up !== null) out.push({ y: up, text: "band: ρ ≤ " + fmt(upper) });
    if (low !== null) out.push({ y: low, text: "band: ρ ≥ " + fmt(lower) });
    return out;
  }

  // findBand's lines as Plotly shapes (dashed, across the plot) and their labels on axis `yref`:
  // above the line at the plot's left end (the right end is where the latest knob change's ⚙
  // sits, and a change of the band is one), on a pale ground over any trace
  function bandShapes(band, yref) {
    return {
      shapes: band.map(b => ({ type: "line", name: "mismatch-band", xref: "paper", x0: 0, x1: 1, yref: yref,
                               y0: b.y, y1: b.y, line: { color: "#dc2626", dash: "dash", width: 1 } })),
      annotations: band.map(b => ({ name: "mismatch-band", xref: "paper", x: 0, xanchor: "left", yref: yref, y: b.y,
                                    yanchor: "bottom", text: plotlyText(b.text), showarrow: false,
                                    bgcolor: "rgba(255, 255, 255, 0.75)", font: { color: "#dc2626", size: 10 } })),
    };
  }
  // a line chart's right axis: "y2": 1 puts its second key there, "y2": [keys] those keys
  function onY2(c, key, i) {
    return Array.isArray(c.y2) ? c.y2.indexOf(key) >= 0 : !!c.y2 && i === 1;
  }
  // the metrics a band is drawn against: per chart with "band", the key on its |Δ log p| axis
  // (and its fallback's)
  function bandKeys() {
    const axisKey = (c, keys) => keys[c.y2 && keys.length > 1 ? 1 : 0];
    return [].concat.apply([], registry().charts.filter(c => c.band && c.keys).map(
      c => [axisKey(c, c.keys)].concat(c.fallback ? [axisKey(c, c.fallback.keys)] : [])));
  }

  // counts -> log10(1 + count) colour, with colour-bar ticks that read as real counts
  const LOG_TICKS = [0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 1000000];
  function logColour(maxCount) {
    const ticks = LOG_TICKS.filter(t => t <= maxCount);
    if (maxCount > 1.6 * ticks[ticks.length - 1]) ticks.push(maxCount);   // the top, unless crowded
    return { tickvals: ticks.map(t => Math.log10(1 + t)), ticktext: ticks.map(String), zmax: Math.log10(1 + Math.max(1, maxCount)) };
  }

  function create(container, state, opts) {
    opts = opts || {};
    const charts = specs(state);
    let revision = 0;
    charts.forEach(function (c) {
      c.div = el("div", { id: "chart-" + c.id, class: "chart empty" + (c.split ? " split" : ""), "data-npoints": "0" });
      container.appendChild(c.div);
    });
    function keysOf(c) {
      if (c.prefix) return Object.keys(state.series).filter(k => k.startsWith(c.prefix)).sort();
      return typeof c.keys === "function" ? c.keys() : c.keys;
    }
    function layoutFor(c, title, withAnnotations) {
      const lay = { title: { text: plotlyText(title), font: { size: 13 } }, margin: { l: 48, r: 40, t: 32, b: 32 },
                    showlegend: true, legend: { orientation: "h", y: -0.2, font: { size: 10 } },
                    xaxis: {}, uirevision: c.id, datarevision: ++revision };
      if (c.y2 && c.split) {
        // two panels, one scale each: the y2 keys below, the x axis under them. Overlaid, each
        // axis fits its own peak to the plot's top, so two unrelated values (2 turns and a share
        // of 1.0; a KL and the band's |Δ log p|) land on one pixel row and read as equal
        lay.yaxis = { domain: [0.56, 1], rangemode: "tozero" };   // magnitudes: counts, shares, KL
        lay.yaxis2 = { domain: [0, 0.44], anchor: "x", rangemode: "tozero" };
        lay.xaxis = { anchor: "y2" };
      } else if (c.y2) {
        // tickmode "auto": Plotly syncs an overlaying axis' ticks to the left axis' grid by
        // default, which labels the right axis with odd values (0.4882, 0.696); it has no grid
        lay.yaxis2 = { overlaying: "y", side: "right", showgrid: false, tickmode: "auto" };
        lay.margin.r = 60;   // room for the right axis' tick labels
      }
      if (c.axes) {   // what each axis counts
        lay.yaxis = Object.assign(lay.yaxis || {}, { title: { text: plotlyText(c.axes[0]), font: { size: 11 } } });
        if (lay.yaxis2 && c.axes[1]) lay.yaxis2.title = { text: plotlyText(c.axes[1]), font: { size: 11 } };
        lay.margin.l = 60;
      }
      if (c.band) {   // magnitudes (a KL, |Δ log p|): both axes from 0, so the band's headroom reads
        lay.yaxis = Object.assign(lay.yaxis || {}, { rangemode: "tozero" });
        if (lay.yaxis2) lay.yaxis2.rangemode = "tozero";
      }
      if (withAnnotations) {
        const anns = (state.annotations || []).slice(-30);
        lay.shapes = anns.map(a => ({ type: "line", x0: a.step, x1: a.step, yref: "paper", y0: 0, y1: 1,
                                      line: { color: "#9333ea", width: 1, dash: "dot" } }));
        lay.annotations = anns.map(a => ({ x: a.step, yref: "paper", y: 1, text: "⚙", hovertext: plotlyText(a.text),
                                           showarrow: false, font: { color: "#9333ea" } }));
        if (c.highlight) lay.shapes.push(highlightShape(c.highlight));   // kept across whole redraws
      }
      return lay;
    }
    // A piece of advice's evidence (static/dashboard/run.js): the steps a figure covers, shaded
    // on the chart of its metric. One highlight on the page at a time.
    const HIGHLIGHT = "advice-evidence";
    function highlightShape(h) {
      return { type: "rect", name: HIGHLIGHT, xref: "x", yref: "paper", x0: h.first - 0.5, x1: h.last + 0.5,
               y0: 0, y1: 1, layer: "below", fillcolor: "rgba(245, 158, 11, 0.22)",
               line: { color: "rgba(217, 119, 6, 0.8)", width: 1 } };
    }
    function chartOf(key) {   // the drawn line chart with a trace of metric `key`
      return charts.find(c => c.type !== "hist" && c.type !== "heat" && c.drawn && keysOf(c).indexOf(key) >= 0) || null;
    }
    function setHighlight(c, h) {
      c.highlight = h;
      const shapes = ((c.div.layout && c.div.layout.shapes) || []).filter(sh => sh.name !== HIGHLIGHT);
      if (h) shapes.push(highlightShape(h));
      Plotly.relayout(c.div, { shapes: shapes });
    }
    // highlight(key, first, last): shade steps first..last on the chart of `key` (and clear any
    // other highlight); returns that chart's div, or null when no drawn chart shows `key`.
    function highlight(key, first, last) {
      const target = chartOf(key);
      charts.forEach(function (c) { if (c.highlight && c !== target) setHighlight(c, null); });
      if (!target) return null;
      setHighlight(target, { first: first, last: last });
      return target.div;
    }
    const config = () => ({ displaylogo: false, responsive: true, staticPlot: !!opts.staticPlot });
    // opts.onPick({step, min_len?, max_len?}): a click on a point of a line chart (its step), a
    // bar of a histogram (the step drawn; for a length histogram, that bin's lengths) or a cell of
    // the heatmap (its step and bin). The inspector (inspector.js) opens those samples.
    function binLengths(edges, i) {   // bins are [lo, hi), the last closed; outside values clamp in
      const p = {};
      if (i > 0) p.min_len = Math.max(0, Math.ceil(edges[i]));
      if (i < edges.length - 2) p.max_len = Math.max(0, Math.ceil(edges[i + 1]) - 1);
      return p;
    }
    const countsTokens = c => /token/.test(histAxis(c.name));   // a length histogram: bins are lengths
    function pickable(c) {
      if (!opts.onPick || c.div._rlPick) return;
      c.div._rlPick = true;
      c.div.on("plotly_click", function (ev) {
        const pt = ev && ev.points && ev.points[0];
        if (!pt || !c.drawn) return;
        let pick = null;
        if (c.type === "hist" && c.drawn.last) {
          const i = pt.pointNumber;
          pick = { step: c.drawn.last.step };
          if (countsTokens(c)) Object.assign(pick, binLengths(c.drawn.last.edges, i));
        } else if (c.type === "heat" && c.drawn.rows) {
          const rc = pt.pointNumber || [];
          const h = c.drawn.rows[rc[0]];
          if (!h) return;
          pick = Object.assign({ step: h.step }, countsTokens(c) ? binLengths(h.edges, rc[1]) : {});
        } else if (typeof pt.x === "number") {
          pick = { step: Math.round(pt.x) };
        }
        if (pick) opts.onPick(pick);
      });
      c.div.classList.add("pickable");
    }
    function show(c, npoints) {
      c.div.classList.remove("empty");
      c.div.setAttribute("data-npoints", String(npoints));
    }

    function drawHist(c, title) {
      const hs = state.hists[c.name] || [];
      if (!hs.length) return;
      const last = hs[hs.length - 1];
      const sig = hs.length + ":" + last.step + ":" + (last.cursor || "") + ":" + title;
      if (c.drawn && c.drawn.hs === hs && c.drawn.sig === sig) return;   // nothing new
      const edges = last.edges;
      // unit-wide integer bins (versions, staleness): one bar per value, at the value
      const unit = edges.length > 1 && edges.every((e, i) => Number.isInteger(e) && (i === 0 || e - edges[i - 1] === 1));
      const xs = edges.slice(0, -1).map((e, i) => unit ? e : (e + edges[i + 1]) / 2);
      let traces, lay, rows = null;
      if (c.type === "hist") {
        traces = [{ type: "bar", x: xs, y: last.counts.slice(), name: "step " + last.step,
                    hovertemplate: "%{x}: %{y}<extra></extra>" }];
        lay = layoutFor(c, title + " — step " + last.step, false);
        lay.xaxis = { title: { text: plotlyText(histAxis(c.name)) } };
        if (unit) { lay.xaxis.dtick = 1; lay.xaxis.tick0 = 0; }
        lay.yaxis = { title: { text: "count" }, rangemode: "tozero" };
        lay.showlegend = false;
        lay.bargap = 0.05;
        if (!last.counts.some(v => v > 0)) {   // e.g. APRIL's buffer, empty at this step
          lay.yaxis.range = [0, 1];
          lay.annotations = [{ text: "nothing to count at this step", xref: "paper", yref: "paper", x: 0.5, y: 0.5,
                               showarrow: false, font: { color: "#6b7280" } }];
        }
      } else {
        rows = hs.filter(h => h.edges.length === edges.length).slice(-300);
        const counts = rows.map(h => h.counts.slice());
        let maxCount = 0;
        counts.forEach(r => r.forEach(v => { if (v > maxCount) maxCount = v; }));
        const lc = logColour(maxCount);
        // colour = log10(1 + count), so the long tail of rare lengths shows next to the short bins
        traces = [{ type: "heatmap", x: xs, y: rows.map(h => h.step), z: counts.map(r => r.map(v => Math.log10(1 + (v || 0)))),
                    text: counts, hovertemplate: "step %{y}, length %{x}: %{text}<extra></extra>",
                    zmin: 0, zmax: lc.zmax, colorscale: "Viridis",
                    colorbar: { title: { text: "count", side: "right" }, tickvals: lc.tickvals, ticktext: lc.ticktext,
                                thickness: 12 } }];
        lay = layoutFor(c, title, false);
        lay.xaxis = { title: { text: plotlyText(histAxis(c.name)) } };
        lay.yaxis = { title: { text: "step" } };
        lay.showlegend = false;
      }
      lay.margin = Object.assign({}, lay.margin, { b: 50 });
      show(c, hs.length);
      Plotly.react(c.div, traces, lay, config());
      c.drawn = { hs: hs, sig: sig, last: last, rows: rows };
      pickable(c);
    }

    function drawLines(c, title) {
      const cur = [];
      keysOf(c).forEach(function (k, i) {
        const s = state.series[k];
        if (s && s.steps.length) cur.push({ key: k, s: s, axis: onY2(c, k, i) ? "y2" : "y" });
      });
      if (!cur.length) return;
      const mode = n => n < 60 ? "lines+markers" : "lines";
      const sig = cur.map(t => t.key + "@" + t.axis + ":" + mode(t.s.steps.length)).join("|");
      let eta = null;
      if (c.eta) {
        const e = findEta(state);
        if (e !== null && typeof e.value === "number") eta = e.value;
      }
      const band = c.band ? findBand(state) : [];
      // η's schedule ahead of the latest step drawn (redrawn whole when a point passes or η moves)
      const now = Math.max.apply(null, cur.map(t => t.s.steps[t.s.steps.length - 1]));
      const ahead = c.eta ? scheduleAhead(state, now, eta) : null;
      const anns = (state.annotations || []);
      const last = anns[anns.length - 1];
      const laySig = title + "|" + anns.length + "|" + (last ? last.step + last.text : "") + "|" + eta + "|" +
        band.map(b => b.y + ":" + b.text).join(",") + "|" + (ahead ? ahead.x.slice(1).join(",") + "/" + ahead.y.join(",") : "");
      let npoints = 0;
      cur.forEach(t => { npoints += t.s.steps.length; });
      const d = c.drawn;
      const incremental = d && d.sig === sig && d.laySig === laySig && cur.every((t, i) =>
        t.s === d.series[i] && t.s.steps === d.steps[i] && t.s.values === d.values[i] && t.s.steps.length >= d.lens[i]);
      if (incremental) {
        const idx = [], xs = [], ys = [];
        cur.forEach(function (t, i) {
          if (t.s.steps.length > d.lens[i]) {
            idx.push(i);
            xs.push(t.s.steps.slice(d.lens[i]));
            ys.push(t.s.values.slice(d.lens[i]));
            d.lens[i] = t.s.steps.length;
          }
        });
        if (idx.length) {
          Plotly.extendTraces(c.div, { x: xs, y: ys }, idx);
          show(c, npoints);
        }
        return;
      }
      // drawn whole, with copies: extendTraces then appends to Plotly's arrays, not ours
      const traces = cur.map(t => ({ type: "scatter", mode: mode(t.s.steps.length), name: plotlyText(t.key),
                                     x: t.s.steps.slice(), y: t.s.values.slice(), yaxis: t.axis, marker: { size: 4 } }));
      if (ahead)   // after the metrics' traces: extendTraces addresses those by index
        traces.push({ type: "scatter", mode: "lines", name: "η schedule", x: ahead.x, y: ahead.y, hoverinfo: "x+y",
                      line: { shape: "hv", dash: "dash", color: "#dc2626", width: 1.5 } });
      const lay = layoutFor(c, title, true);
      if (eta !== null) {
        lay.shapes.push({ type: "line", xref: "paper", x0: 0, x1: 1, y0: eta, y1: eta,
                          line: { color: "#dc2626", dash: "dash" } });
        lay.annotations.push({ xref: "paper", x: 1, y: eta, text: "η = " + plotlyText(eta), showarrow: false,
                               font: { color: "#dc2626" } });
      }
      // the band's ends, on the |Δ log p| axis (y2; y on a chart without one)
      const drawnBand = bandShapes(band, c.y2 ? "y2" : "y");
      lay.shapes = lay.shapes.concat(drawnBand.shapes);
      lay.annotations = lay.annotations.concat(drawnBand.annotations);
      show(c, npoints);
      Plotly.react(c.div, traces, lay, config());
      c.drawn = { sig: sig, laySig: laySig, series: cur.map(t => t.s), steps: cur.map(t => t.s.steps),
                  values: cur.map(t => t.s.values), lens: cur.map(t => t.s.steps.length) };
      pickable(c);
    }

    function drawChart(c) {
      if (c.hold && c.hold.defer()) return;   // the pointer rests on it: drawn on release
      const title = typeof c.title === "function" ? c.title() : c.title;
      if (c.type === "hist" || c.type === "heat") drawHist(c, title);
      else drawLines(c, title);
      if (!c.hold && c.div.on) c.hold = holdable(c.div, () => drawSafely(c));   // c.div.on: drawn once
    }
    function drawSafely(c) {   // one chart's failure leaves the others drawn
      try { drawChart(c); } catch (e) { c.drawn = null; console.error(c.id, e); }
    }
    function addChartsForNewHistograms() { // a histogram without a chart of its own yet
      Object.keys(state.hists).forEach(function (name) {
        if (charts.some(c => c.name === name)) return;
        const c = { id: "hist-" + name.replace(/[^A-Za-z0-9]+/g, "-"), type: "hist", name: name,
                    title: name + " (latest step)" };
        c.div = el("div", { id: "chart-" + c.id, class: "chart empty", "data-npoints": "0" });
        container.appendChild(c.div);
        charts.push(c);
      });
    }
    function draw() {
      addChartsForNewHistograms();
      charts.forEach(drawSafely);
    }
    return { charts: charts, draw: draw, highlight: highlight, chartOf: key => (chartOf(key) || {}).div || null };
  }

  // A run snapshot (GET /api/runs/<id>/metrics) as chart state; a knob change's annotation reads
  // as the event log writes it.
  function stateFromSnapshot(data, config, knobs) {
    const state = { series: {}, hists: {}, annotations: [], knobs: Object.assign({}, knobs || {}), config: config || {} };
    for (const k in data.points) state.series[k] = { steps: data.points[k].steps, values: data.points[k].values };
    (data.histograms || []).forEach(h => (state.hists[h.name] = state.hists[h.name] || []).push(h));
    (data.events || []).forEach(function (m) {
      if (m.type === "event" && (m.kind === "knob_applied" || m.kind === "auto_staleness"))
        state.annotations.push({ step: m.step, text: m.text });   // the server's text (formatting.describe_event)
    });
    return state;
  }

  // Exponential moving average (alpha = weight of the past, 0 = raw); nulls are skipped.
  function ema(values, alpha) {
    if (!alpha) return values.slice();
    let acc = null;
    return values.map(function (v) {
      if (v === null || typeof v !== "number" || !isFinite(v)) return null;
      acc = acc === null ? v : alpha * acc + (1 - alpha) * v;
      return acc;
    });
  }

  window.RLCharts = { create: create, stateFromSnapshot: stateFromSnapshot, ema: ema, holdable: holdable,
                      histAxis: histAxis, band: findBand, bandKeys: bandKeys, bandShapes: bandShapes };
})();
