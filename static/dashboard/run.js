// The live run page: charts (Plotly, served from static/), live updates over the WebSocket,
// the live-tuning panel, stop/pause/resume/kill and the event log. Everything a user typed is
// inserted with textContent, never as HTML.
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

  // --- helpers -----------------------------------------------------------------------------
  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const k in (attrs || {})) e.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function cookie(name) {
    const m = document.cookie.match("(^|;)\\s*" + name + "=([^;]*)");
    return m ? decodeURIComponent(m[2]) : "";
  }
  function fmt(v) {
    if (typeof v !== "number") return String(v);
    return String(Number(v.toPrecision(4)));
  }
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
    } else if (m.type === "histogram") {
      addHist(m);
    } else if (m.type === "status") {
      setStatus(m.status, m.cursor, m.allowed_actions);
      logEvent(m.step, "status", m.status + (m.message ? " — " + m.message : ""));
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

  // an event as one readable line (the report page writes the same: reports.describe_event)
  function pairs(d, skip) {
    return Object.keys(d || {}).filter(k => (skip || []).indexOf(k) < 0).slice(0, 8)
      .map(k => k + "=" + (d[k] !== null && typeof d[k] === "object" ? JSON.stringify(d[k]) : fmt(d[k]))).join(" ");
  }
  function by(d) { return d.requested_by ? " (by " + d.requested_by + ")" : ""; }
  function describe(kind, d) {
    d = d || {};
    if (kind === "knob_applied") return Object.keys(d.changes || {}).map(k => k + ": " + fmt(d.changes[k].old) + " → " + fmt(d.changes[k].new)).join(", ") + by(d);
    if (kind === "auto_staleness") return Object.keys(d.changes || {}).map(k => k + ": " + fmt(d.changes[k].old) + " → " + fmt(d.changes[k].new)).join(", ") + " (auto)";
    if (kind === "knob_requested") return Object.keys(d.knobs || {}).map(k => k + " = " + fmt(d.knobs[k])).join(", ") + by(d);
    if (kind === "knob_rejected") return Object.keys(d.errors || {}).map(k => k + ": " + d.errors[k]).join("; ") + by(d);
    if (kind === "error" || kind === "warning") return d.message || pairs(d);
    if (kind === "alert") return (d.rule || "alert") + ": " + (d.message || pairs(d, ["rule"]));
    if (kind === "alert_cleared") return (d.rule || "alert") + " cleared";
    if (kind === "checkpoint") return d.path || pairs(d);
    return pairs(d);
  }
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
    logEvent(m.step, m.kind, describe(m.kind, d));
    if (m.kind === "knob_applied") {
      for (const k in (d.changes || {})) state.knobs[k] = d.changes[k].new;
      state.annotations.push({ step: m.step, text: describe(m.kind, d) });
      renderKnobValues();
      markChange(d.change_id, "applied", "applied at step " + m.step);
    } else if (m.kind === "knob_rejected") {
      markChange(d.change_id, "rejected", "rejected: " + describe(m.kind, d));
    } else if (m.kind === "knob_requested") {
      markChange(d.change_id, "pending", "pending: " + describe(m.kind, d), true);
    } else if (m.kind === "rewound") {
      rewind(d.step || 0);
      if (window.RLTimeline && RLTimeline.live) RLTimeline.live.rewind(d.step || 0);
    } else if (m.kind === "auto_staleness") {   // the trainer moved η itself
      for (const k in (d.changes || {})) state.knobs[k] = d.changes[k].new;
      state.annotations.push({ step: m.step, text: describe(m.kind, d) });
      renderKnobValues();
    } else if (m.kind === "alert" || m.kind === "alert_cleared") {
      // any rule (staleness, kl_high, stalled, ...): the banner shows its name and message
      showAlert(m.kind === "alert", d.rule || "alert", d.message || pairs(d, ["rule"]), m.step);
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

  // --- tuning panel -----------------------------------------------------------------------------
  // Grouped by technique / section. The knobs that matter most for the techniques this run uses
  // come first (η, APRIL's early termination, GRESO's alpha), then the rest of the enabled
  // techniques, then the general sections, then the techniques the run does not use; all but the
  // first group are folded.
  const TECHNIQUES = {
    async: { label: "Asynchronous training (AReaL)", key: ["async.max_staleness"] },
    april: { label: "APRIL (active partial rollouts)", key: ["april.segment_max_tokens", "april.over_sampling_batch_size"] },
    greso: { label: "GRESO (selective rollouts)", key: ["greso.alpha"] },
  };
  const SECTIONS = { rollout: "Rollout and sampling", algo: "Algorithm (GRPO / DAPO)", optim: "Optimiser" };
  function techniqueEnabled(t) {
    const knob = t + ".enabled";
    if (state.knobs[knob] !== undefined) return state.knobs[knob] === true || state.knobs[knob] === "true";
    const sec = (page.config || {})[t] || {};
    return sec.enabled === true;
  }
  function knobRow(k) {
    const tr = el("tr", { "data-knob": k.name });
    const name = el("td");
    name.appendChild(el("code", {}, k.name));
    const range = k.choices ? "one of " + k.choices.join(", ") : k.type === "bool" ? "true / false"
      : "[" + (k.min === null ? "-∞" : k.min) + ", " + (k.max === null ? "∞" : k.max) + "]";
    name.appendChild(el("small", {}, range + " — " + k.help));
    tr.appendChild(name);
    tr.appendChild(el("td", { class: "current", "data-current": k.name }, ""));
    const td = el("td");
    let input;
    if (k.choices || k.type === "bool") {
      input = el("select", { name: k.name, "data-type": k.type });
      input.appendChild(el("option", { value: "" }, ""));
      (k.choices || ["true", "false"]).forEach(c => input.appendChild(el("option", { value: String(c) }, String(c))));
    } else {
      input = el("input", { type: "text", name: k.name, "data-type": k.type, size: "8", placeholder: "new value" });
    }
    if (!page.can_control) input.disabled = true;
    td.appendChild(input);
    tr.appendChild(td);
    return tr;
  }
  function knobGroup(id, title, note, knobs, open) {
    if (!knobs.length) return;
    const det = el("details", { class: "knob-group", "data-group": id });
    det.open = !!open;
    const sum = el("summary");
    sum.appendChild(el("span", { class: "group-title" }, title));
    sum.appendChild(el("span", { class: "muted" }, " " + knobs.length + (knobs.length === 1 ? " knob" : " knobs") + (note ? " · " + note : "")));
    det.appendChild(sum);
    const table = el("table", { class: "knobs" });
    const head = el("tr");
    ["Knob", "Current", "New"].forEach(h => head.appendChild(el("th", {}, h)));
    table.appendChild(el("thead")).appendChild(head);
    const body = el("tbody");
    knobs.forEach(k => body.appendChild(knobRow(k)));
    table.appendChild(body);
    det.appendChild(table);
    knobRows.appendChild(det);
  }
  const knobRows = document.getElementById("knob-rows");
  (function buildTuningPanel() {
    const bySection = {};
    page.knob_schema.forEach(function (k) { (bySection[k.name.split(".")[0]] = bySection[k.name.split(".")[0]] || []).push(k); });
    const byName = {};
    page.knob_schema.forEach(k => { byName[k.name] = k; });
    const on = Object.keys(TECHNIQUES).filter(techniqueEnabled);
    const keyNames = [];
    on.forEach(t => TECHNIQUES[t].key.forEach(n => { if (byName[n]) keyNames.push(n); }));
    knobGroup("key", "Key knobs: " + on.map(t => TECHNIQUES[t].label.split(" ")[0]).join(", "), "",
              keyNames.map(n => byName[n]), true);
    const done = new Set(keyNames);
    const rest = sec => (bySection[sec] || []).filter(k => !done.has(k.name));
    on.forEach(t => knobGroup(t, TECHNIQUES[t].label, "enabled", rest(t), false));
    Object.keys(SECTIONS).forEach(sec => knobGroup(sec, SECTIONS[sec], "", rest(sec), !on.length));
    Object.keys(bySection).filter(sec => !SECTIONS[sec] && !TECHNIQUES[sec])
      .forEach(sec => knobGroup(sec, sec, "", rest(sec), false));
    Object.keys(TECHNIQUES).filter(t => on.indexOf(t) < 0)
      .forEach(t => knobGroup(t, TECHNIQUES[t].label, "not used by this run", rest(t), false));
  })();
  function renderKnobValues() {
    document.querySelectorAll("[data-current]").forEach(function (td) {
      const v = state.knobs[td.getAttribute("data-current")];
      td.textContent = v === undefined ? "" : fmt(v);
    });
  }
  renderKnobValues();
  function markChange(id, cls, text, onlyIfNew) {
    if (!id) return;
    let li = document.getElementById("kc-" + id);
    if (li && onlyIfNew) return;
    if (!li) {
      li = el("li", { id: "kc-" + id });
      const ul = document.getElementById("knob-changes");
      ul.insertBefore(li, ul.firstChild);
    }
    if (li.classList.contains("applied") || li.classList.contains("rejected")) return;
    li.className = cls;
    li.setAttribute("data-state", cls);
    li.textContent = text;
  }
  function showMessage(text, isError) {
    const p = document.getElementById("action-msg");
    p.textContent = text;
    p.className = isError ? "error" : "muted";
  }
  document.getElementById("knob-form").addEventListener("submit", function (ev) {
    ev.preventDefault();
    const knobs = {};
    knobRows.querySelectorAll("input, select").forEach(function (inp) {
      const raw = inp.value.trim();
      if (raw === "") return;
      const t = inp.getAttribute("data-type");
      if ((t === "float" || t === "int") && raw !== "" && !isNaN(Number(raw))) knobs[inp.name] = Number(raw);
      else if (t === "bool") knobs[inp.name] = raw === "true";
      else knobs[inp.name] = raw;
    });
    if (!Object.keys(knobs).length) { showMessage("Enter a new value for at least one knob.", true); return; }
    pendingKnobs = knobs;
    if (state.ws && state.ws.readyState === WebSocket.OPEN) {
      state.ws.send(JSON.stringify({ type: "set_knobs", knobs: knobs }));
    } else {
      fetch("/api/runs/" + RUN + "/knobs", { method: "POST", credentials: "same-origin",
        headers: { "Content-Type": "application/json", "X-CSRFToken": cookie("csrftoken") },
        body: JSON.stringify(knobs) }).then(r => r.json().then(j => onKnobReply(r.ok ? Object.assign({ type: "knob_ack" }, j) : Object.assign({ type: "error" }, j))));
    }
  });
  let pendingKnobs = null;
  function onKnobReply(m) {
    if (m.type === "knob_ack") {
      markChange(m.change_id, "pending", "pending: " + Object.keys(m.knobs).map(k => k + " = " + fmt(m.knobs[k])).join(", "));
      knobRows.querySelectorAll("input, select").forEach(inp => { inp.value = ""; });
      showMessage("Change " + m.change_id + " sent; it applies at the next step boundary.");
    } else {
      const errs = Object.keys(m.errors || {}).map(k => k + ": " + m.errors[k]).join("; ");
      showMessage(m.message + (errs ? " — " + errs : ""), true);
    }
  }

  // --- buttons ----------------------------------------------------------------------------------
  function updateButtons() {
    document.querySelectorAll("button[data-action]").forEach(function (b) {
      b.disabled = !page.can_control || state.allowed.indexOf(b.dataset.action) < 0;
    });
    document.getElementById("knob-apply").disabled = !page.can_control || state.allowed.indexOf("knobs") < 0;
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
      if (m.type === "knob_ack" || m.type === "error") onKnobReply(m);
      else if (m.type === "stream") showStream(m.mode, m.message);
      else handle(m, true);
    };
    ws.onclose = function () {
      conn.textContent = "reconnecting…"; conn.removeAttribute("data-live");
      if (!state.closed) setTimeout(connect, 1000);
    };
  }

  fetch("/api/runs/" + RUN + "/metrics", { credentials: "same-origin" })
    .then(r => r.json())
    .then(function (data) {
      for (const k in data.points) state.series[k] = { steps: data.points[k].steps, values: data.points[k].values };
      data.histograms.forEach(addHist);
      data.events.forEach(function (m) {
        if (m.type === "status") {
          setStatus(m.status, m.cursor, m.allowed_actions);
          logEvent(m.step, "status", m.status + (m.message ? " — " + m.message : ""));
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
