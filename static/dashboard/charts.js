// The run charts (Plotly), shared by the live page, the report page and the exported HTML
// report. RLCharts.create(container, state) makes one div per chart; draw() (re)draws those whose
// metrics exist. state: {series: {key: {steps, values}}, hists: {name: [{step, edges, counts}]},
// annotations: [{step, text}], knobs: {dotted: value}, config: {section: {key: value}}}.
// Nothing here inserts user text as HTML.
(function () {
  "use strict";

  function el(tag, attrs) {
    const e = document.createElement(tag);
    for (const k in (attrs || {})) e.setAttribute(k, attrs[k]);
    return e;
  }
  const devKeys = (series, what) => Object.keys(series).filter(k => new RegExp("^system/gpu\\d+/" + what + "$").test(k))
    .sort((a, b) => parseInt(a.slice(10), 10) - parseInt(b.slice(10), 10));

  function specs(state) {
    const hasGpu = () => !!state.series["system/gpu_util"];
    return [
      { id: "system", title: () => hasGpu() ? "GPU utilisation (%) and memory (GB), mean over devices" : "CPU utilisation (%) and RAM (GB) — no GPU",
        keys: () => hasGpu() ? ["system/gpu_util", "system/gpu_mem_gb"] : ["system/cpu_util", "system/ram_gb"], y2: 1 },
      { id: "gpu-util", title: "GPU utilisation per device (%)", keys: () => devKeys(state.series, "util") },
      { id: "gpu-mem", title: "GPU memory per device (GB)", keys: () => devKeys(state.series, "mem_gb") },
      { id: "gpu-power", title: "GPU power (W): mean and per device", keys: () => (state.series["system/gpu_power_w"] ? ["system/gpu_power_w"] : []).concat(devKeys(state.series, "power_w")) },
      { id: "reward", title: "Reward and accuracy", keys: ["reward/mean", "reward/accuracy", "eval/accuracy"] },
      { id: "kl", title: "KL to the reference (k3)", keys: ["actor/kl"] },
      { id: "len-hist", type: "hist", name: "rollout/response_len", title: "Rollout length (latest step)" },
      { id: "len-heat", type: "heat", name: "rollout/response_len", title: "Rollout length: steps × length bins" },
      { id: "resp-len", title: "Response length (tokens)", keys: ["rollout/response_len/mean", "rollout/response_len/p50",
        "rollout/response_len/p90", "rollout/response_len/max"] },
      { id: "staleness", title: "Staleness: mean and max against η", keys: ["async/staleness/mean", "async/staleness/max"], eta: true },
      { id: "staleness-hist", type: "hist", name: "async/staleness", title: "Staleness histogram (latest step)" },
      { id: "throughput", title: "Throughput (tokens/s): generated and trained", keys: ["perf/gen_tokens_per_s", "perf/trained_tokens_per_s"] },
      { id: "zero-var", title: "Zero-variance group ratio", keys: ["rollout/zero_var_ratio", "rollout/zero_var_ratio/all_correct",
        "rollout/zero_var_ratio/all_wrong"] },
      { id: "greso", title: "GRESO: skip rate, p_easy, p_hard", keys: ["greso/skip_rate", "greso/p_easy", "greso/p_hard"] },
      { id: "april", title: "APRIL: buffer size and off-policy token ratio", keys: ["april/buffer_size", "april/offpolicy_token_ratio"], y2: 1 },
      { id: "timing", title: "Step timings (s)", prefix: "timing/" },
      { id: "actor", title: "Clip ratio, importance weight, grad norm", keys: ["actor/clip_ratio", "actor/importance_weight",
        "actor/behave_imp_weight", "actor/grad_norm"] },
    ];
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

  function create(container, state, opts) {
    opts = opts || {};
    const charts = specs(state);
    charts.forEach(function (c) {
      c.div = el("div", { id: "chart-" + c.id, class: "chart empty", "data-npoints": "0" });
      container.appendChild(c.div);
    });
    function keysOf(c) {
      if (c.prefix) return Object.keys(state.series).filter(k => k.startsWith(c.prefix)).sort();
      return typeof c.keys === "function" ? c.keys() : c.keys;
    }
    function layoutFor(c, title, withAnnotations) {
      const lay = { title: { text: title, font: { size: 13 } }, margin: { l: 48, r: 40, t: 32, b: 32 },
                    showlegend: true, legend: { orientation: "h", y: -0.2, font: { size: 10 } },
                    xaxis: {}, uirevision: c.id };
      if (c.y2) lay.yaxis2 = { overlaying: "y", side: "right", showgrid: false };
      if (withAnnotations) {
        const anns = (state.annotations || []).slice(-30);
        lay.shapes = anns.map(a => ({ type: "line", x0: a.step, x1: a.step, yref: "paper", y0: 0, y1: 1,
                                      line: { color: "#9333ea", width: 1, dash: "dot" } }));
        lay.annotations = anns.map(a => ({ x: a.step, yref: "paper", y: 1, text: "⚙", hovertext: a.text,
                                           showarrow: false, font: { color: "#9333ea" } }));
      }
      return lay;
    }
    function drawChart(c) {
      const title = typeof c.title === "function" ? c.title() : c.title;
      let traces = [], npoints = 0, lay;
      if (c.type === "hist" || c.type === "heat") {
        const hs = state.hists[c.name] || [];
        if (!hs.length) return;
        const last = hs[hs.length - 1];
        const centers = last.edges.slice(0, -1).map((e, i) => (e + last.edges[i + 1]) / 2);
        if (c.type === "hist") {
          traces = [{ type: "bar", x: centers, y: last.counts, name: "step " + last.step }];
          lay = layoutFor(c, title + " — step " + last.step, false);
          lay.xaxis = { title: { text: c.name.endsWith("staleness") ? "staleness (versions)" : "tokens" } };
          lay.bargap = 0.05;
        } else {
          const rows = hs.filter(h => h.edges.length === last.edges.length).slice(-300);
          traces = [{ type: "heatmap", x: centers, y: rows.map(h => h.step), z: rows.map(h => h.counts),
                      colorscale: "Viridis" }];
          lay = layoutFor(c, title, false);
          lay.xaxis = { title: { text: "length (tokens)" } };
          lay.yaxis = { title: { text: "step" } };
          lay.showlegend = false;
        }
        npoints = hs.length;
      } else {
        keysOf(c).forEach(function (k, i) {
          const s = state.series[k];
          if (!s || !s.steps.length) return;
          npoints += s.steps.length;
          traces.push({ type: opts.svg ? "scatter" : "scattergl", mode: s.steps.length < 60 ? "lines+markers" : "lines",
                        name: k, x: s.steps, y: s.values, yaxis: c.y2 && i === 1 ? "y2" : "y",
                        marker: { size: 4 } });
        });
        if (!traces.length) return;
        lay = layoutFor(c, title, true);
        if (c.eta) {
          const eta = findEta(state);
          if (eta !== null && typeof eta.value === "number") {
            lay.shapes.push({ type: "line", xref: "paper", x0: 0, x1: 1, y0: eta.value, y1: eta.value,
                              line: { color: "#dc2626", dash: "dash" } });
            lay.annotations.push({ xref: "paper", x: 1, y: eta.value, text: "η = " + eta.value, showarrow: false,
                                   font: { color: "#dc2626" } });
          }
        }
      }
      c.div.classList.remove("empty");
      Plotly.react(c.div, traces, lay, { displaylogo: false, responsive: true, staticPlot: !!opts.staticPlot });
      c.div.setAttribute("data-npoints", String(npoints));
    }
    function addChartsForNewHistograms() { // e.g. an APRIL buffer-age histogram: a chart of its own
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
      charts.forEach(function (c) { try { drawChart(c); } catch (e) { console.error(c.id, e); } });
    }
    return { charts: charts, draw: draw };
  }

  // A run snapshot (GET /api/runs/<id>/metrics) as chart state.
  function stateFromSnapshot(data, config, knobs) {
    const state = { series: {}, hists: {}, annotations: [], knobs: Object.assign({}, knobs || {}), config: config || {} };
    for (const k in data.points) state.series[k] = { steps: data.points[k].steps, values: data.points[k].values };
    (data.histograms || []).forEach(h => (state.hists[h.name] = state.hists[h.name] || []).push(h));
    (data.events || []).forEach(function (m) {
      if (m.type === "event" && m.kind === "knob_applied") {
        const d = m.data || {};
        state.annotations.push({ step: m.step, text: Object.keys(d.changes || {}).map(
          k => k + ": " + d.changes[k].old + " → " + d.changes[k].new).join(", ") });
      }
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

  window.RLCharts = { create: create, stateFromSnapshot: stateFromSnapshot, ema: ema, el: el };
})();
