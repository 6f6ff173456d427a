// The run page's forecast line (#run-forecast): time and price to max_steps at the recent pace,
// from GET /api/runs/<id> ("forecast", trainer/observe/forecast.py; docs/cost.md), read on load
// and again when new steps arrive (at most every FORECAST_EVERY_MS). Hidden when the run is not
// active or has no pace yet. Every text is inserted as text.
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

  function text(f) {
    let t = "To go: " + f.steps_left + " steps, about " + duration(f.seconds) + " (" +
      duration(f.low_s) + "–" + duration(f.high_s) + ") at " + f.pace_s.toFixed(2) +
      " s a step over the last " + f.window;
    if (f.price !== null && f.price !== undefined)
      t += "; price about " + money(f.price) + " (" + money(f.price_low) + "–" + money(f.price_high) + ")";
    return t;
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
          node.hidden = !f;
          if (f) node.textContent = text(f);
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
