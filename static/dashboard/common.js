// The helpers every page script shares, loaded first by base.html (and inlined first in the
// offline HTML report): RLCommon = {el, fmt, sig, duration, plotlyText, cookie, poller, actsFrom}.
// One copy of each: the page scripts (charts.js, run.js, advice.js, forecast.js, estimate.js, ...)
// take them from here.
(function () {
  "use strict";

  // an element with attributes and, if given, its text (as text, never HTML)
  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const k in (attrs || {})) e.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  // A value as the pages write it (the server's formatting.number does the same): a number to
  // `digits` significant digits (4 unless given), never cutting its whole part (from 10^(digits-1)
  // up, a whole number: 16384, not 16380), without an exponent for ordinary magnitudes; a list as
  // "[a, b]"; anything else as its string.
  function fmt(v, digits) {
    digits = digits || 4;
    if (Array.isArray(v)) return "[" + v.map(x => fmt(x, digits)).join(", ") + "]";
    if (typeof v !== "number") return String(v);
    if (Math.abs(v) >= Math.pow(10, digits - 1)) return v.toFixed(0);
    return String(Number(v.toPrecision(digits)));
  }
  // an amount (device-hours, a price) to 3 significant digits, exponent and all where tiny: 0.0123,
  // 1.23e-5, 1230
  function sig(v) { return Number(v.toPrecision(3)).toString(); }
  // seconds as a person reads them: 42 s, 7.5 min, 3.2 h
  function duration(s) {
    if (s < 120) return Math.round(s) + " s";
    if (s < 7200) return (s / 60).toFixed(1) + " min";
    return (s / 3600).toFixed(1) + " h";
  }
  // Plotly's text fields understand <b>, <i>, <br>, <a href>, <span style>...: escape them (Plotly
  // turns &lt; &gt; &amp; back into the characters).
  function plotlyText(s) {
    return String(s === undefined || s === null ? "" : s)
      .replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }
  // a cookie's value ("" when unset): the CSRF token a POST carries
  function cookie(name) {
    const m = document.cookie.match("(?:^|;)\\s*" + name + "=([^;]*)");
    return m ? decodeURIComponent(m[1]) : "";
  }
  // A read repeated on demand, at most once every `everyMs`: poller(everyMs, read) ->
  // {load, schedule}. read() starts one request and returns its promise; load() reads now;
  // schedule() reads once `everyMs` has passed since the last read began (at once if it has), and
  // a schedule() during a read reads again after it. Many schedule() calls in a row: one read.
  function poller(everyMs, read) {
    const st = { fetching: false, again: false, last: 0, timer: null };
    function load() {
      st.fetching = true;
      st.last = Date.now();
      Promise.resolve().then(read).catch(function () { /* the next schedule() asks again */ })
        .finally(function () {
          st.fetching = false;
          if (st.again) { st.again = false; schedule(); }
        });
    }
    function schedule() {
      if (st.fetching) { st.again = true; return; }
      if (st.timer) return;
      const wait = Math.max(0, st.last + everyMs - Date.now());
      st.timer = setTimeout(function () { st.timer = null; load(); }, wait);
    }
    return { load: load, schedule: schedule };
  }

  // The first step a knob change acts on: a change is applied at the boundary after step N (its
  // event's step), so step N + 1 is the first one run with it.
  function actsFrom(step) { return step + 1; }

  window.RLCommon = { el: el, fmt: fmt, sig: sig, duration: duration, plotlyText: plotlyText,
                      cookie: cookie, poller: poller, actsFrom: actsFrom };
})();
