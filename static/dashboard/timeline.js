// The timeline: where each process's time went (trainer/observe/timeline.py). One lane per process
// ("rank 0" the controller, "rank r" the training ranks, "engine" / generator lanes), time on x,
// one horizontal bar per span coloured by its phase; a generating bar's opacity is the
// engine's batch occupancy (pale = few slots busy), also in the hover.
//
// The box (#timeline, templates/dashboard/_timeline.html) says its run and mode:
// - live: the last `data-window` steps from GET /api/runs/<id>/timeline?last=N, then the
//   socket's `timeline` frames, which run.js hands to RLTimeline.live.onFrame (deduplicated by
//   cursor, so the fetch and the socket may overlap); `rewound` events drop later steps;
// - report: the whole run, thinned to evenly spaced steps by the server, and a second chart
//   with each lane's share of time per phase over every step (never thinned); in the offline
//   HTML export the same data comes inlined (#timeline-data) instead of fetched.
// Lane and phase names go to Plotly through plotlyText (Plotly renders a subset of HTML). The
// live chart holds still under a resting pointer like the charts do (RLCharts.holdable): charts.js
// is loaded before this file.
(function () {
  "use strict";
  const COLOURS = {
    generating: "#16a34a", waiting: "#cbd5e1", training: "#2563eb", "syncing weights": "#f59e0b",
    "recording samples": "#a855f7", evaluating: "#0891b2", checkpointing: "#92400e", paused: "#475569",
    bookkeeping: "#f9a8d4", tool: "#dc2626",
  };
  const IDLE = "idle";   // the report's share chart: a lane's time outside its spans
  const PHASES = Object.keys(COLOURS);
  const OTHER = "#9ca3af";
  const KEEP_SHORT = new Set(["tool"]), SHORT_MIN = 0.002;   // trainer/observe/timeline.py KEEP_SHORT

  const plotlyText = RLCommon.plotlyText;
  // rank 0, rank 1, ... first (by number), then the generators by name
  function laneOrder(a, b) {
    const ra = /^rank (\d+)$/.exec(a), rb = /^rank (\d+)$/.exec(b);
    if (ra && rb) return Number(ra[1]) - Number(rb[1]);
    if (ra || rb) return ra ? -1 : 1;
    return a < b ? -1 : a > b ? 1 : 0;
  }
  function phaseOrder(phases) {
    return PHASES.filter(p => phases.has(p)).concat([...phases].filter(p => PHASES.indexOf(p) < 0).sort());
  }
  function seconds(s) {
    return s >= 100 ? s.toFixed(0) + " s" : s >= 1 ? s.toFixed(2) + " s" : s >= 0.01 ? (s * 1000).toFixed(0) + " ms"
      : (s * 1000).toFixed(2) + " ms";
  }

  function create(box) {
    const run = box.getAttribute("data-run");
    const mode = box.getAttribute("data-mode") || "live";
    const windowSteps = Number(box.getAttribute("data-window") || 20);
    const chart = box.querySelector("#timeline-chart");
    const totalsDiv = box.querySelector("#timeline-totals");
    const note = box.querySelector("#timeline-note");
    const slices = new Map();   // cursor -> {step, spans}
    let totals = null, extent = 0, stride = 1, timer = null;
    // while the pointer rests on a bar of the live chart, new steps wait (RLCharts.holdable)
    let hold = null;

    function shown() {
      const all = [...slices.values()];
      if (mode !== "live") return all;
      const top = Math.max(...all.map(s => s.step));
      return all.filter(s => s.step > top - windowSteps);
    }
    function draw() {
      timer = null;
      if (hold && hold.defer()) return;   // drawn on release
      const rows = shown();
      if (!rows.length) return;
      box.hidden = false;
      const lanes = new Set(), phases = new Set();
      rows.forEach(r => r.spans.forEach(s => { lanes.add(s.lane); phases.add(s.phase); }));
      const laneList = [...lanes].sort(laneOrder);
      // a tool call is drawn at least SHORT_MIN of the window wide (a calculator's takes ~0.1 ms:
      // it happened, and shows); its hover says its real duration
      let lo = Infinity, hi = -Infinity;
      rows.forEach(r => r.spans.forEach(s => { lo = Math.min(lo, s.start); hi = Math.max(hi, s.end); }));
      const shortMs = Math.max(1, (hi - lo) * 1000 * SHORT_MIN);
      const traces = phaseOrder(phases).map(function (phase) {
        const spans = [];
        rows.forEach(r => r.spans.forEach(s => { if (s.phase === phase) spans.push([r.step, s]); }));
        return {
          type: "bar", orientation: "h", name: plotlyText(phase),
          y: spans.map(([, s]) => plotlyText(s.lane)),
          base: spans.map(([, s]) => s.start * 1000),
          x: spans.map(([, s]) => Math.max(KEEP_SHORT.has(phase) ? shortMs : 1, (s.end - s.start) * 1000)),
          marker: { color: COLOURS[phase] || OTHER, line: { width: 0 },
                    opacity: spans.map(([, s]) => typeof s.occupancy === "number" ? 0.3 + 0.7 * s.occupancy : 1) },
          customdata: spans.map(([step, s]) => [step, seconds(s.end - s.start),
            typeof s.occupancy === "number" ? "<br>batch occupancy " + Math.round(100 * s.occupancy) + "%" : ""]),
          hovertemplate: "%{y}: " + plotlyText(phase) + " %{customdata[1]}<br>step %{customdata[0]}%{customdata[2]}<extra></extra>",
        };
      });
      const first = Math.min(...rows.map(r => r.step)), last = Math.max(...rows.map(r => r.step));
      const title = mode === "live" ? "Where the time goes — steps " + first + "–" + last
        : "Where the time goes — steps " + first + "–" + last + (stride > 1 ? " (one step in " + stride + " shown)" : "");
      const lay = {
        title: { text: plotlyText(title), font: { size: 14 }, x: 0.01 }, barmode: "overlay", bargap: 0.25,
        height: 110 + 36 * laneList.length, margin: { l: 70, r: 16, t: 60, b: 36 },
        xaxis: { type: "date", title: { text: "" }, tickformat: "%H:%M:%S" },
        yaxis: { type: "category", categoryorder: "array", categoryarray: laneList.map(plotlyText), autorange: "reversed", automargin: true },
        legend: { orientation: "h", x: 0, y: 1.02, yanchor: "bottom", font: { size: 11 } },
        hoverlabel: { namelength: -1 }, uirevision: "timeline",
      };
      Plotly.react(chart, traces, lay, { displaylogo: false, responsive: true });
      if (!hold && mode === "live") hold = RLCharts.holdable(chart, schedule);   // chart.on: drawn once
      chart.setAttribute("data-steps", String(rows.length));
      chart.setAttribute("data-first-step", String(first));
      chart.setAttribute("data-last-step", String(last));
      if (note) note.textContent = laneList.length + (laneList.length === 1 ? " lane" : " lanes") + " · time in UTC";
      if (totals && totalsDiv) drawTotals();
      box.setAttribute("data-drawn", String(Number(box.getAttribute("data-drawn") || 0) + 1));
    }
    // each lane's share of the run's time per phase, over every step; the rest of a lane's time
    // (a generator with nothing to do, a training rank between its updates) is idle
    function drawTotals() {
      const laneList = Object.keys(totals).sort(laneOrder);
      const phases = new Set();
      laneList.forEach(l => Object.keys(totals[l]).forEach(p => phases.add(p)));
      const busy = l => Object.values(totals[l]).reduce((a, b) => a + b, 0);
      const whole = l => Math.max(extent || 0, busy(l)) || 1;
      const share = (l, phase) => phase === IDLE ? whole(l) - busy(l) : totals[l][phase] || 0;
      const traces = phaseOrder(phases).concat([IDLE]).map(phase => ({
        type: "bar", orientation: "h", name: plotlyText(phase), y: laneList.map(plotlyText),
        x: laneList.map(l => 100 * share(l, phase) / whole(l)),
        customdata: laneList.map(l => seconds(share(l, phase))),
        marker: { color: phase === IDLE ? "#ffffff" : COLOURS[phase] || OTHER,
                  line: { width: phase === IDLE ? 1 : 0, color: "#cbd5e1" } },
        hovertemplate: "%{y}: " + plotlyText(phase) + " %{x:.1f}% (%{customdata})<extra></extra>",
      }));
      Plotly.react(totalsDiv, traces, {
        title: { text: "Share of the run's time per phase (white: idle)", font: { size: 14 }, x: 0.01 },
        barmode: "stack", height: 90 + 30 * laneList.length, margin: { l: 70, r: 16, t: 40, b: 36 },
        xaxis: { range: [0, 100], ticksuffix: "%" }, showlegend: false,
        yaxis: { type: "category", categoryorder: "array", categoryarray: laneList.map(plotlyText), autorange: "reversed", automargin: true },
      }, { displaylogo: false, responsive: true });
    }
    function schedule() {
      if (!timer) timer = setTimeout(draw, 250);
    }
    function add(m) {
      if (!m || !Array.isArray(m.spans) || typeof m.cursor !== "number") return;
      slices.set(m.cursor, { step: m.step, spans: m.spans });
      if (mode === "live" && slices.size > 4 * windowSteps) {   // keep the window, drop the rest
        const top = Math.max(...[...slices.values()].map(s => s.step));
        for (const [c, s] of slices) if (s.step <= top - windowSteps) slices.delete(c);
      }
    }
    const api = {
      onFrame: function (m) { add(m); schedule(); },
      rewind: function (step) {
        for (const [c, s] of slices) if (s.step > step) slices.delete(c);
        schedule();
      },
    };
    const query = mode === "live" ? "?last=" + windowSteps : "";
    const inline = document.getElementById("timeline-data");
    (inline ? Promise.resolve(JSON.parse(inline.textContent))
      : fetch("/api/runs/" + run + "/timeline" + query, { credentials: "same-origin" }).then(r => r.json()))
      .then(function (data) {
        (data.slices || []).forEach(add);
        totals = data.totals || null;
        extent = data.extent || 0;
        stride = data.stride || 1;
        draw();
        box.setAttribute("data-loaded", "1");
      });
    return api;
  }

  const box = document.getElementById("timeline");
  window.RLTimeline = { create: create, live: null, colours: COLOURS };
  if (box && window.Plotly) {
    const tl = create(box);
    if (box.getAttribute("data-mode") === "live") window.RLTimeline.live = tl;
  }
})();
