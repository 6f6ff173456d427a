// The comparison page: the chosen runs overlaid, one chart per metric, with EMA smoothing.
(function () {
  "use strict";
  const page = JSON.parse(document.getElementById("compare-page").textContent);
  const DEFAULT = ["reward/accuracy", "reward/mean", "eval/accuracy", "perf/trained_tokens_per_s",
                   "perf/gen_tokens_per_s", "actor/kl", "rollout/response_len/mean", "async/staleness/max",
                   "rollout/zero_var_ratio", "greso/skip_rate", "timing/step_s", "system/gpu_util",
                   "episode/turns", "episode/tool_use_rate"];   // listed only where a run has them
  const el = RLCommon.el, plotlyText = RLCommon.plotlyText;   // static/dashboard/common.js
  const data = [];          // per run: {key: {steps, values}}
  const divs = {};
  const chartsEl = document.getElementById("compare-charts");
  const picks = document.getElementById("metric-picks");
  const ema = document.getElementById("ema");
  const forkLines = page.runs.filter(r => r.fork_step !== null && r.fork_step !== undefined).map(r => (
    { type: "line", xref: "x", yref: "paper", x0: r.fork_step, x1: r.fork_step, y0: 0, y1: 1,
      line: { dash: "dash", width: 1, color: "#888" } }));

  // the mismatch band's ends (RLCharts.band: each run's current mismatch.lower / upper) on the
  // chart of the |Δ log p| a band chart shows (mismatch/abs_logp_diff_max): one line per height,
  // its label naming the runs of each end when not every run has it
  const BAND_KEYS = RLCharts.bandKeys();
  function bandOf(key) {
    if (BAND_KEYS.indexOf(key) < 0) return [];
    const lines = [];   // [{y, ends: [{text, runs}]}]
    page.runs.forEach(function (r) {
      RLCharts.band({ config: { mismatch: r.mismatch || {} }, knobs: {} }).forEach(function (b) {
        let line = lines.find(l => Math.abs(l.y - b.y) <= 1e-9 * Math.max(1, b.y));
        if (!line) lines.push(line = { y: b.y, ends: [] });
        let end = line.ends.find(e => e.text === b.text);
        if (!end) line.ends.push(end = { text: b.text, runs: [] });
        end.runs.push("#" + r.id);
      });
    });
    const all = page.runs.length;
    return lines.map(l => ({ y: l.y, text: l.ends.map(e => e.text + (e.runs.length < all ? " (" + e.runs.join(", ") + ")" : ""))
                                                 .join("; ") }));
  }

  function selected() {
    return Array.from(picks.querySelectorAll("input:checked")).map(i => i.value);
  }
  function draw() {
    const alpha = parseFloat(ema.value) || 0;
    document.getElementById("ema-value").textContent = String(alpha);
    const keys = selected();
    Object.keys(divs).forEach(k => { divs[k].hidden = keys.indexOf(k) < 0; });
    keys.forEach(function (key) {
      let div = divs[key];
      if (!div) {
        div = divs[key] = el("div", { class: "chart", "data-metric": key, "data-npoints": "0" });
        chartsEl.appendChild(div);
      }
      let n = 0;
      // a fork's steps continue its parent's numbering (it resumed the parent's checkpoint), so
      // x = step lines the two up from the fork step, which a dashed line marks
      const traces = page.runs.map(function (r, i) {
        const s = data[i][key] || { steps: [], values: [] };
        n += s.steps.length;
        const fork = r.fork_step !== null && r.fork_step !== undefined ? " (fork of #" + r.parent + " @ " + r.fork_step + ")" : "";
        return { type: "scatter", mode: s.steps.length < 60 ? "lines+markers" : "lines",
                 name: plotlyText("#" + r.id + " " + r.name + fork), x: s.steps, y: RLCharts.ema(s.values, alpha), marker: { size: 4 } };
      });
      const band = RLCharts.bandShapes(bandOf(key), "y");
      Plotly.react(div, traces, { title: { text: plotlyText(key), font: { size: 13 } }, margin: { l: 48, r: 20, t: 32, b: 32 },
        legend: { orientation: "h", y: -0.2, font: { size: 10 } }, uirevision: key, shapes: forkLines.concat(band.shapes),
        annotations: band.annotations }, { displaylogo: false, responsive: true });
      div.setAttribute("data-npoints", String(n));
    });
  }
  // one point per run: its best held-out accuracy (its best training accuracy when a run has no
  // evaluation) against its price (device-hours when a run has no price); the axes say which
  function drawCost() {
    const div = document.getElementById("compare-cost");
    const note = document.getElementById("compare-cost-note");
    const c = page.runs.map(r => r.cost || {});
    const paid = c.filter(x => typeof x.device_hours === "number");   // the runs with an account decide the axes
    const priced = paid.length > 0 && paid.every(x => typeof x.cost_price === "number");
    const held = paid.length > 0 && paid.every(x => typeof x.eval_accuracy_best === "number");
    const xKey = priced ? "cost_price" : "device_hours", yKey = held ? "eval_accuracy_best" : "accuracy_best";
    const shown = page.runs.map((r, i) => ({ r: r, x: c[i][xKey], y: c[i][yKey] }))
      .filter(p => typeof p.x === "number" && typeof p.y === "number");
    const left = page.runs.length - shown.length;
    note.textContent = !paid.length ? "No run here has a cost account (runs recorded before it)." :
      (left ? left + " run" + (left > 1 ? "s" : "") + " without a cost account or an accuracy left out. " : "") +
      (priced ? "" : "Device-hours: not every run has a rate. ") + (held ? "" : "Training accuracy: not every run was evaluated.");
    Plotly.react(div, [{ type: "scatter", mode: "markers+text", x: shown.map(p => p.x), y: shown.map(p => p.y),
                         text: shown.map(p => plotlyText("#" + p.r.id + " " + p.r.name)), textposition: "top center",
                         marker: { size: 10 } }],
      { margin: { l: 56, r: 20, t: 12, b: 44 }, height: 320,
        xaxis: { title: { text: priced ? "price" : "device-hours (GPU-hours + CPU core-hours)" }, rangemode: "tozero" },
        yaxis: { title: { text: held ? "best held-out accuracy" : "best training accuracy" }, range: [0, 1.05] } },
      { displaylogo: false, responsive: true });
    div.setAttribute("data-npoints", String(shown.length));
  }
  drawCost();

  Promise.all(page.runs.map(r => fetch("/api/runs/" + r.id + "/metrics", { credentials: "same-origin" }).then(x => x.json())))
    .then(function (snaps) {
      snaps.forEach(s => data.push(s.points || {}));
      const all = new Set();
      data.forEach(d => Object.keys(d).forEach(k => all.add(k)));
      Array.from(all).sort().forEach(function (k) {
        const lab = el("label");
        const box = el("input", { type: "checkbox", value: k });
        box.checked = DEFAULT.indexOf(k) >= 0;
        box.addEventListener("change", draw);
        lab.appendChild(box);
        lab.appendChild(document.createTextNode(" " + k));
        picks.appendChild(lab);
        picks.appendChild(el("br"));
      });
      draw();
      document.body.setAttribute("data-charts-drawn", "1");
    });
  ema.addEventListener("input", draw);
})();
