// The run page's cost line (#run-forecast): what the run has cost so far ("cost_so_far"), and
// time and price to max_steps at the recent pace and to its target accuracy ("forecast",
// trainer/observe/forecast.py; docs/cost.md), from GET /api/runs/<id>, read on load and again when
// new steps arrive (at most every FORECAST_EVERY_MS). The forecast part only while the run is
// active. Every text is inserted as text.
//
// RLForecast.create(runId, element) -> {load, schedule}, from run.js.
(function () {
  "use strict";
  const FORECAST_EVERY_MS = 5000;

  function duration(s) {   // 42 s, 7.5 min, 3.2 h
    if (s < 120) return Math.round(s) + " s";
    if (s < 7200) return (s / 60).toFixed(1) + " min";
    return (s / 3600).toFixed(1) + " h";
  }
  function money(v) { return Number(v.toPrecision(3)).toString(); }

  function range(lo, hi, fmt) {   // "(a–b)", "(a or later)" when the late end is unbounded
    if (lo === null || lo === undefined) return "";
    return hi === null || hi === undefined ? " (" + fmt(lo) + " or later)" : " (" + fmt(lo) + "–" + fmt(hi) + ")";
  }

  function soFar(c) {
    const hours = Object.keys(c.device_hours).map(k => c.device_hours[k].toPrecision(3) + " " + k + " device-hours");
    let t = "So far: " + (hours.length ? hours.join(", ") : "no device time yet");
    if (c.price !== null && c.price !== undefined) t += ", price " + money(c.price);
    t += "; idle " + Math.round(100 * c.idle_share) + "%";
    if (c.waste_share > 0)
      t += "; " + (100 * c.waste_share).toFixed(1) + "% of it" +
        (c.waste_price !== null && c.waste_price !== undefined ? " (" + money(c.waste_price) + ")" : "") +
        " spent on tokens later dropped";
    return t + ".";
  }

  function target(g) {
    const goal = "Target accuracy " + g.target;
    if (g.reached) return goal + ": reached (" + g.accuracy.toFixed(3) + " at step " + g.at_step + ").";
    if (g.steps === null || g.steps === undefined)
      return goal + ": not at the present trend (" + g.points_per_100_steps.toFixed(1) +
        " accuracy points per 100 steps over the last " + g.evals + " evaluations).";
    let t = goal + ": about " + g.steps + " steps" + range(g.steps_low, g.steps_high, String) +
      ", " + duration(g.seconds) + range(g.low_s, g.high_s, duration);
    if (g.price !== null && g.price !== undefined) t += ", price about " + money(g.price);
    return t + " (+" + g.points_per_100_steps.toFixed(1) + " accuracy points per 100 steps over the last " +
      g.evals + " evaluations).";
  }

  function text(f, c) {
    let t = c ? soFar(c) + " " : "";
    if (!f) return t.trim();
    t += "To go: " + f.steps_left + " steps, about " + duration(f.seconds) + " (" +
      duration(f.low_s) + "–" + duration(f.high_s) + ") at " + f.pace_s.toFixed(2) +
      " s a step over the last " + f.window;
    if (f.price !== null && f.price !== undefined)
      t += "; price about " + money(f.price) + " (" + money(f.price_low) + "–" + money(f.price_high) + ")";
    t += ".";
    if (f.target) t += " " + target(f.target);
    return t;
  }

  // what each reason's dropped tokens cost, under the "Where the generated tokens went" chart
  function wasteCaption(c) {
    const chart = document.getElementById("chart-tokens");
    if (!chart) return;
    let p = document.getElementById("tokens-cost");
    if (!p) {
      p = document.createElement("p");
      p.id = "tokens-cost";
      p.className = "muted chart-caption";
      chart.insertAdjacentElement("afterend", p);
    }
    const reasons = Object.keys(c.waste_by_reason || {}).sort((a, b) => c.waste_by_reason[b].device_s - c.waste_by_reason[a].device_s);
    p.textContent = reasons.length ? "What the dropped tokens cost so far: " + reasons.map(function (r) {
      const w = c.waste_by_reason[r];
      return r + " " + (w.price !== null && w.price !== undefined ? money(w.price) : money(w.device_s) + " device-s");
    }).join(", ") + " (" + (100 * c.waste_share).toFixed(1) + "% of the run's device time)." : "No generated token dropped so far.";
  }

  function create(runId, node) {
    const st = { timer: null, fetching: false, again: false, last: 0 };
    function load() {
      if (!node) return;
      st.fetching = true;
      st.last = Date.now();
      fetch("/api/runs/" + runId, { credentials: "same-origin" })
        .then(r => (r.ok ? r.json() : null))
        .then(function (d) {
          const f = d && d.forecast;
          const c = d && d.cost_so_far;
          node.hidden = !f && !c;
          if (f || c) node.textContent = text(f, c);
          if (c) wasteCaption(c);
        })
        .catch(function () { /* the next step asks again */ })
        .finally(function () {
          st.fetching = false;
          if (st.again) { st.again = false; schedule(); }
        });
    }
    function schedule() {
      if (st.fetching) { st.again = true; return; }
      if (st.timer) return;
      const wait = Math.max(0, st.last + FORECAST_EVERY_MS - Date.now());
      st.timer = setTimeout(function () { st.timer = null; load(); }, wait);
    }
    return { load: load, schedule: schedule };
  }
  window.RLForecast = { create: create, text: text };
})();
