// The run page's cost line (#run-forecast): what the run has cost so far ("cost_so_far"), and
// time and price to max_steps at the recent pace and to its target accuracy ("forecast",
// trainer/accounting/forecast.py; docs/cost.md), from GET /api/runs/<id>, read on load and again when
// new steps arrive (at most every FORECAST_EVERY_MS). The forecast part only while the run is
// active. Every text is inserted as text.
//
// RLForecast.create(runId, element, active, onRead) -> {load, schedule, status(active)}, from
// run.js; onRead(reply) hears every read of the run (run.js: APRIL's context for the tuning panel).
(function () {
  "use strict";
  const FORECAST_EVERY_MS = 5000;
  const duration = RLCommon.duration, money = RLCommon.sig;   // static/dashboard/common.js

  // A range "(a–b)"; "(up to b)" when its low end is 0 (the spread of a few uneven steps reaches
  // below nothing: "0 s" would claim the run may be over now); "(a or later)" when the late end is
  // unbounded.
  function range(lo, hi, fmt) {
    if (lo === null || lo === undefined) return "";
    if (hi === null || hi === undefined) return " (" + fmt(lo) + " or later)";
    return lo > 0 ? " (" + fmt(lo) + "–" + fmt(hi) + ")" : " (up to " + fmt(hi) + ")";
  }

  function soFar(c) {
    const hours = Object.keys(c.device_hours).map(k => money(c.device_hours[k]) + " " + k + " device-hours");
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
    t += "To go: " + f.steps_left + " steps, about " + duration(f.seconds) + range(f.low_s, f.high_s, duration) +
      " at " + f.pace_s.toFixed(2) + " s a step over the last " + f.window;
    if (f.price !== null && f.price !== undefined)
      t += "; price about " + money(f.price) + range(f.price_low, f.price_high, money);
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

  // The line of run `runId` in `node`. The forecast part only while the run is active: ended()
  // drops it at once (the status arrived on the stream) and a reply read before then shows no "To
  // go" either; started() lets it back (a resumed run).
  function create(runId, node, isActive, onRead) {
    let active = isActive !== false, cost = null;
    function show(f) {
      node.hidden = !f && !cost;
      node.textContent = f || cost ? text(f, cost) : "";
    }
    function read() {
      return fetch("/api/runs/" + runId, { credentials: "same-origin" })
        .then(r => (r.ok ? r.json() : null))
        .then(function (d) {
          if (!d) return;
          if (onRead) onRead(d);
          if (!node) return;
          cost = d.cost_so_far || null;
          show(active ? d.forecast : null);
          if (cost) wasteCaption(cost);
        });
    }
    const reads = RLCommon.poller(FORECAST_EVERY_MS, read);
    function status(isActive) {
      if (isActive === active) return;
      active = isActive;
      if (!active && node) show(null);
      reads.schedule();
    }
    return { load: reads.load, schedule: reads.schedule, status: status };
  }
  window.RLForecast = { create: create, text: text };
})();
