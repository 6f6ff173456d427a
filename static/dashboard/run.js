// The live run page: charts (Plotly, served from static/), live updates over the WebSocket,
// stop/pause/resume/kill, the alerts banner and the event log (each event's text is the server's).
// The panels are modules of their own, made here: the live tuning (knobs.js, RLKnobs) and the
// pilot's advice with the autopilot (advice.js, RLAdvice); the shared helpers are charts.js'
// (RLCharts) and common.js' (RLCommon). Scripts, in order: common.js, charts.js, inspector.js, advice.js, knobs.js, run.js.
// Everything a user typed is inserted with textContent, never as HTML.
(function () {
  "use strict";
  const page = JSON.parse(document.getElementById("run-page").textContent);
  const RUN = page.id;
  const state = { series: {}, hists: {}, cursor: 0, status: page.status, step: page.step,
                  statusSeq: page.seq,   // the sequence number the shown status is as of
                  // what the run accepts now, from the server (lifecycle.allowed_actions): the
                  // page holds no copy of the rules, only the latest list a frame or reply brought
                  allowed: page.allowed_actions,
                  knobs: Object.assign({}, page.knobs), annotations: [], ws: null, closed: false };
  const MAX_LOCAL = 4000;
  const ACTIVE = page.active_statuses;   // models.ACTIVE, from the server

  // --- helpers (static/dashboard/common.js, loaded first) -----------------------------------------
  const el = RLCommon.el, cookie = RLCommon.cookie;
  // --- charts (static/dashboard/charts.js) ----------------------------------------------------
  state.config = page.config;
  // the rollout inspector (static/dashboard/inspector.js): a click on a chart opens that step's samples
  const samplesBox = document.getElementById("samples-panel");
  const inspector = samplesBox && window.RLInspector ? RLInspector.create(samplesBox, { run: RUN }) : null;
  const charts = RLCharts.create(document.getElementById("charts"), state,
                                 { onPick: inspector ? inspector.open : null });
  let drawTimer = null;
  function scheduleDraw() {
    if (drawTimer) return;
    drawTimer = setTimeout(function () {
      drawTimer = null;
      charts.draw();
    }, 250);
  }

  // --- data ----------------------------------------------------------------------------------
  function addPoint(key, step, value) {
    let s = state.series[key];
    if (!s) s = state.series[key] = { steps: [], values: [] };
    s.steps.push(step); s.values.push(value);
    if (s.steps.length > MAX_LOCAL) thin(s);
  }
  function thin(s) { // min/max per bucket, like the server
    const n = s.steps.length, buckets = MAX_LOCAL / 4, size = n / buckets, st = [], va = [];
    for (let b = 0; b < buckets; b++) {
      const lo = Math.floor(b * size), hi = Math.floor((b + 1) * size);
      let imin = -1, imax = -1;
      for (let i = lo; i < hi; i++) {
        if (s.values[i] === null) continue;
        if (imin < 0 || s.values[i] < s.values[imin]) imin = i;
        if (imax < 0 || s.values[i] > s.values[imax]) imax = i;
      }
      if (imin < 0) continue;
      [...new Set([imin, imax])].sort((a, b) => a - b).forEach(i => { st.push(s.steps[i]); va.push(s.values[i]); });
    }
    s.steps = st; s.values = va;
  }
  function addHist(h) {
    (state.hists[h.name] = state.hists[h.name] || []).push(h);
    if (state.hists[h.name].length > 600) state.hists[h.name].splice(0, 300);
  }
  function setStep(step) {
    if (typeof step !== "number" || step < state.step && state.status !== "queued") return;
    state.step = step;
    document.getElementById("run-step").textContent = step;
    document.getElementById("run-progress").value = step;
  }
  function setAllowed(allowed) {
    if (!Array.isArray(allowed)) return;
    state.allowed = allowed;
    updateButtons();
  }
  function setStatus(status, seq, allowed) {
    if (typeof seq === "number") state.statusSeq = Math.max(state.statusSeq, seq);
    state.status = status;
    if (Array.isArray(allowed)) state.allowed = allowed;
    const e = document.getElementById("run-status");
    e.textContent = status;
    e.className = "status s-" + status;
    const title = document.getElementById("alerts-title");   // an ended run's alerts are history
    if (title) title.textContent = ACTIVE.indexOf(status) >= 0 ? "Alerts" : "Alerts active when the run ended";
    forecast.status(ACTIVE.indexOf(status) >= 0);   // an ended run has nothing to go
    const agents = document.getElementById("agents-panel");   // the endpoint ends with the run
    if (agents) agents.hidden = ACTIVE.indexOf(status) < 0;
    updateButtons();
  }
  function rewind(step) {
    for (const k in state.series) {   // new arrays, so the charts know to draw them whole
      const s = state.series[k];
      let n = s.steps.length;
      while (n > 0 && s.steps[n - 1] > step) n--;
      state.series[k] = { steps: s.steps.slice(0, n), values: s.values.slice(0, n) };
    }
    for (const k in state.hists) state.hists[k] = state.hists[k].filter(h => h.step <= step);
    state.step = step;
    setStep(step);
  }

  function handle(m, live) {
    if (typeof m.cursor === "number") {
      if (m.cursor <= state.cursor) return;   // already have it
      state.cursor = m.cursor;
    }
    if (m.type === "metrics") {
      for (const k in m.values) addPoint(k, m.step, m.values[k]);
      setStep(m.step);
      advice.schedule();   // new steps: the advice may have changed
      forecast.schedule();   // ... and the pace, and the lengths APRIL's rules of thumb read
    } else if (m.type === "histogram") {
      addHist(m);
    } else if (m.type === "status") {
      setStatus(m.status, m.cursor, m.allowed_actions);   // ... and tells the forecast
      logEvent(m.step, "status", m.text);
      if (m.message) { const e = document.getElementById("run-error"); e.textContent = m.message; e.hidden = false; }
    } else if (m.type === "event") {
      onEvent(m);
    } else if (m.type === "samples") {   // a step's samples, as summaries
      if (inspector) inspector.onFrame(m);
      return;
    } else if (m.type === "timeline") {   // a step's spans (static/dashboard/timeline.js)
      if (window.RLTimeline && RLTimeline.live) RLTimeline.live.onFrame(m);
      return;
    }
    scheduleDraw();
  }

  // an event's text is the server's (the "text" of each event and status message:
  // formatting.describe_event), the same line the report's event list shows
  function logEvent(step, kind, text) {
    const li = el("li");
    li.appendChild(el("span", { class: "muted" }, "step " + step + " "));
    li.appendChild(el("span", { class: "k" }, kind));
    li.appendChild(document.createTextNode(" " + text));
    const log = document.getElementById("event-log");
    log.insertBefore(li, log.firstChild);
    while (log.children.length > 300) log.removeChild(log.lastChild);
  }
  function onEvent(m) {
    const d = m.data || {};
    // a pending pause or resume changes what the run accepts without a status change
    if (m.allowed_actions) {
      if (typeof m.cursor === "number") state.statusSeq = Math.max(state.statusSeq, m.cursor);
      setAllowed(m.allowed_actions);
    }
    logEvent(m.step, m.kind, m.text);
    if ((m.kind === "run_started" || m.kind === "run_resumed") && d.agents_url) {
      // where the agents call (episode.agents; a resume may serve on another port)
      const url = document.getElementById("agents-url");
      if (url) { url.textContent = d.agents_url; url.classList.remove("muted"); }
    }
    if (m.kind === "knob_applied") {
      for (const k in (d.changes || {})) state.knobs[k] = d.changes[k].new;
      state.annotations.push({ step: m.step, text: m.text });
      knobValuesChanged();
      forecast.schedule();   // the pace and APRIL's context may have moved with it
      knobs.markChange(d.change_id, "applied", "applied from step " + RLCommon.actsFrom(m.step));
      advice.onOutcome(d.change_id);
      advice.onEvent(m);
    } else if (m.kind === "knob_rejected") {
      knobs.markChange(d.change_id, "rejected", "rejected: " + m.text);
      advice.onOutcome(d.change_id);
      advice.onEvent(m);
    } else if (m.kind === "knob_requested") {
      knobs.markChange(d.change_id, "pending", "pending: " + m.text, true);
      advice.onEvent(m);
    } else if (m.kind === "advice" || m.kind === "advice_dismissed") {
      advice.onEvent(m);
    } else if (m.kind === "rewound") {
      rewind(d.step || 0);
      if (window.RLTimeline && RLTimeline.live) RLTimeline.live.rewind(d.step || 0);
    } else if (m.kind === "auto_staleness") {   // the trainer moved η itself
      for (const k in (d.changes || {})) state.knobs[k] = d.changes[k].new;
      state.annotations.push({ step: m.step, text: m.text });
      knobValuesChanged();
    } else if ((m.kind === "run_started" || m.kind === "run_resumed") && m.trains) {
      // what trains, with the trainer's figures (the server's line: formatting.trains)
      const trains = document.getElementById("run-trains");
      if (trains) trains.textContent = m.trains;
    } else if (m.kind === "alert" || m.kind === "alert_cleared") {
      // any rule (staleness, kl_high, stalled, ...): the banner shows its name and message
      // the rule's own message, else the server's line without its "rule: " prefix
      const rule = d.rule || "alert", text = String(m.text || "");
      const message = d.message || (text.startsWith(rule + ": ") ? text.slice(rule.length + 2) : text);
      showAlert(m.kind === "alert", rule, message, m.step);
    }
  }
  // the alerts banner: one line per active rule (raised once, removed when it clears)
  function showAlert(on, rule, message, step) {
    const box = document.getElementById("alerts");
    if (!box) return;
    const ul = box.querySelector("ul");
    let li = ul.querySelector('li[data-rule="' + CSS.escape(rule) + '"]');
    if (on) {
      if (!li) { li = el("li", { "data-rule": rule }); ul.appendChild(li); }
      li.textContent = rule + " (step " + step + ")" + (message ? ": " + message : "");
    } else if (li) {
      li.remove();
    }
    box.hidden = !ul.children.length;
  }

  function showMessage(text, isError) {
    const p = document.getElementById("action-msg");
    p.textContent = text;
    p.className = isError ? "error" : "muted";
  }
  // --- the panels: live tuning (static/dashboard/knobs.js), advice and autopilot (advice.js) -------
  const knobs = RLKnobs.create({ page: page, state: state, cookie: cookie, showMessage: showMessage });
  const advice = RLAdvice.create({ page: page, state: state, charts: charts, knobs: knobs, cookie: cookie });
  // forecast.js reads the run (GET /api/runs/<id>) when steps arrive: its cost line, and APRIL's
  // rules of thumb beside the run's values for the tuning panel
  const forecast = RLForecast.create(RUN, document.getElementById("run-forecast"),
                                     ACTIVE.indexOf(state.status) >= 0,
                                     d => knobs.renderAprilContext(d.april_context || ""));
  forecast.load();
  function knobValuesChanged() {   // the tuning panel's current values and the autopilot's checkboxes
    knobs.renderValues();
    advice.renderAutopilot();
  }
  knobValuesChanged();

  // --- buttons ----------------------------------------------------------------------------------
  function updateButtons() {
    document.querySelectorAll("button[data-action]").forEach(function (b) {
      b.disabled = !page.can_control || state.allowed.indexOf(b.dataset.action) < 0;
    });
    knobs.renderButton();
    advice.render();
  }
  document.querySelectorAll("button[data-action]").forEach(function (b) {
    b.addEventListener("click", function () {
      const action = b.dataset.action;
      if (action === "kill" && !window.confirm("Kill this run now? Work since the last checkpoint is lost.")) return;
      fetch("/api/runs/" + RUN + "/" + action, { method: "POST", credentials: "same-origin",
        headers: { "X-CSRFToken": cookie("csrftoken"), "Content-Type": "application/json" }, body: "{}" })
        .then(r => r.json().then(j => {
          if (r.ok) {
            showMessage(action + " requested");
            // a reply read before a status the stream has already delivered must not undo it
            if (j.status && j.seq >= state.statusSeq) setStatus(j.status, j.seq, j.allowed_actions);
          }
          else showMessage(j.message || ("HTTP " + r.status), true);
        }));
    });
  });
  updateButtons();

  // --- the WebSocket ------------------------------------------------------------------------------
  // {"type": "stream", "mode": "polling" | "live", "message"}: the server lost (or found again)
  // its channel layer; while polling, a notice says so (the server's text, as text)
  function showStream(mode, message) {
    const box = document.getElementById("stream-notice");
    if (!box) return;
    const degraded = mode === "polling";
    box.textContent = degraded ? (message || "Live updates degraded: polling the database") : "";
    box.hidden = !degraded;
    box.setAttribute("data-mode", degraded ? "polling" : "live");
  }
  function connect() {
    const proto = location.protocol === "https:" ? "wss://" : "ws://";
    const ws = new WebSocket(proto + location.host + "/ws/runs/" + RUN + "/?after=" + state.cursor);
    state.ws = ws;
    const conn = document.getElementById("conn");
    ws.onopen = function () {
      conn.textContent = "live"; conn.setAttribute("data-live", "1");
      // a new consumer starts live and says so again if the channel layer is still down
      showStream("live", "");
    };
    ws.onmessage = function (ev) {
      let m;
      try { m = JSON.parse(ev.data); } catch (e) { return; }
      if (m.type === "knob_ack" || m.type === "error") knobs.reply(m);
      else if (m.type === "stream") showStream(m.mode, m.message);
      else handle(m, true);
    };
    ws.onclose = function () {
      conn.textContent = "reconnecting…"; conn.removeAttribute("data-live");
      if (!state.closed) setTimeout(connect, 1000);
    };
  }

  advice.load();
  fetch("/api/runs/" + RUN + "/metrics", { credentials: "same-origin" })
    .then(r => r.json())
    .then(function (data) {
      for (const k in data.points) state.series[k] = { steps: data.points[k].steps, values: data.points[k].values };
      data.histograms.forEach(addHist);
      data.events.forEach(function (m) {
        if (m.type === "status") {
          setStatus(m.status, m.cursor, m.allowed_actions);
          logEvent(m.step, "status", m.text);
        } else onEvent(m);
      });
      let maxStep = state.step;
      for (const k in state.series) { const s = state.series[k].steps; if (s.length) maxStep = Math.max(maxStep, s[s.length - 1]); }
      setStep(maxStep);
      state.cursor = data.cursor;
      scheduleDraw();
      connect();
    });
})();
