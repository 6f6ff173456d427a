// The live run page: charts (Plotly, served from static/), live updates over the WebSocket,
// the pilot's advice (Apply, Dismiss, the autopilot's rules), the live-tuning panel,
// stop/pause/resume/kill and the event log. Everything a user typed is
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
    if (Array.isArray(v)) return "[" + v.map(fmt).join(", ") + "]";
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
      scheduleAdvice();   // new steps: the advice may have changed
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
  const AUTOPILOT = "autopilot";   // requested_by of the autopilot's knob changes (reports.AUTOPILOT)
  function changes(d, sep) {
    return Object.keys(d.changes || {}).map(k => k + sep + fmt((d.changes[k] || {}).old) + " → " + fmt((d.changes[k] || {}).new)).join(", ");
  }
  // a piece of advice's move: "async.max_staleness 0 → 1", or "no knob"
  function move(d) { return d.knob ? d.knob + " " + fmt(d.current) + " → " + fmt(d.proposed) : "no knob"; }
  function guardText(g) {
    if (g !== null && typeof g === "object") return String(g.message || g.name || pairs(g));
    return g === undefined || g === null ? "" : String(g);
  }
  function isObject(v) { return v !== null && typeof v === "object" && !Array.isArray(v); }
  // a knob change, saying when it came from the pilot's advice (the autopilot's, its undos, a person's Apply)
  function describeApplied(d) {
    const r = isObject(d.reason) ? d.reason : {};
    if (d.requested_by === AUTOPILOT && r.undo_of) {
      const g = guardText(r.guard);
      return "autopilot undo: " + changes(d, " ") + (g ? " (guard: " + g + ")" : "");
    }
    if (d.requested_by === AUTOPILOT && r.rule) return "autopilot: " + changes(d, " ") + " (" + (r.message ? r.rule + ": " + r.message : r.rule) + ")";
    if (r.evidence_key && r.rule && d.requested_by) return changes(d, ": ") + " (by " + d.requested_by + ", from " + r.rule + " advice)";
    return changes(d, ": ") + by(d);
  }
  function describe(kind, d) {
    d = d || {};
    if (kind === "knob_applied") return describeApplied(d);
    if (kind === "auto_staleness") return changes(d, ": ") + " (auto)";
    if (kind === "knob_requested") {
      const a = isObject(d.advice) ? d.advice : {};
      const who = a.rule && d.requested_by ? " (by " + d.requested_by + ", from " + a.rule + " advice)" : by(d);
      return Object.keys(d.knobs || {}).map(k => k + " = " + fmt(d.knobs[k])).join(", ") + who;
    }
    if (kind === "advice") return (d.rule || "pilot") + ": " + move(d) + (d.message ? " — " + d.message : "");
    if (kind === "advice_dismissed") return "dismissed " + (d.rule || "pilot") + " advice: " + move(d) + by(d);
    if (kind === "knob_rejected") return Object.keys(d.errors || {}).map(k => k + ": " + d.errors[k]).join("; ") + by(d);
    if (kind === "error" || kind === "warning") return d.message || pairs(d);
    if (kind === "alert") return (d.rule || "alert") + ": " + (d.message || pairs(d, ["rule"]));
    if (kind === "alert_cleared") return (d.rule || "alert") + " cleared";
    if (kind === "checkpoint") return d.path || pairs(d);
    if (kind === "imported") return "from " + d.source + " (by " + d.by + ")";
    if (kind === "forked") {
      const o = d.overrides || {};
      const changes = Object.keys(o).map(k => k + " = " + fmt(o[k])).join(", ");
      return "from run #" + d.parent + " at step " + d.step + (changes ? ": " + changes : "") + by(d);
    }
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
      autopilotOnOutcome(d.change_id);
      adviceOnEvent(m);
    } else if (m.kind === "knob_rejected") {
      markChange(d.change_id, "rejected", "rejected: " + describe(m.kind, d));
      autopilotOnOutcome(d.change_id);
      adviceOnEvent(m);
    } else if (m.kind === "knob_requested") {
      markChange(d.change_id, "pending", "pending: " + describe(m.kind, d), true);
      adviceOnEvent(m);
    } else if (m.kind === "advice" || m.kind === "advice_dismissed") {
      adviceOnEvent(m);
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

  // --- the pilot's advice (GET /api/runs/<id>/advice; docs/pilot.md) ------------------------------
  // Read on load and again when new steps arrive (at most every ADVICE_EVERY_MS). What became of
  // a piece of advice (Apply pending, applied at step N, rejected, dismissed) comes from the
  // run's events, so a reload or a second viewer shows the same. Every text is inserted as text.
  const ADVICE_EVERY_MS = 3000;
  const adv = {
    list: [], cursor: 0, steps: null, loads: 0,
    fetching: false, again: false, lastFetch: 0, timer: null,
    dismissed: new Set(),    // "rule|evidence_key" dismissed (advice_dismissed events, this page's clicks)
    requested: {},           // evidence_key -> {change_id, state: "pending" | "rejected", text}
    byChange: {},            // change_id -> evidence_key of the advice it applies
    applied: [],             // knob_applied events from advice: {key, step, cursor, text, message}
    messages: {},            // evidence_key -> the advice's message, as last read
    shown: null,             // the evidence figure highlighted: "evidence_key|index"
  };
  const adviceBox = document.getElementById("advice");
  const pairKey = (rule, key) => rule + "|" + key;
  function adviceMessage(text, isError) {
    const p = document.getElementById("advice-msg");
    p.textContent = text || "";
    p.hidden = !text;
    p.className = isError ? "error" : "muted";
  }
  function loadAdvice() {
    adv.fetching = true;
    adv.lastFetch = Date.now();
    fetch("/api/runs/" + RUN + "/advice", { credentials: "same-origin" })
      .then(r => r.json().then(j => ({ ok: r.ok, j: j })))
      .then(function (res) {
        if (!res.ok) { adviceMessage("The advice could not be read: " + errorText(res.j), true); return; }
        adv.list = Array.isArray(res.j.advice) ? res.j.advice : [];
        adv.cursor = res.j.cursor || 0;
        adv.steps = res.j.steps;
        adv.list.forEach(a => { if (a.message) adv.messages[a.evidence_key] = a.message; });
        adv.loads++;
        renderAdvice();
        adviceBox.setAttribute("data-loads", String(adv.loads));
      })
      .catch(() => adviceMessage("The advice could not be read (network).", true))
      .finally(function () {
        adv.fetching = false;
        if (adv.again) { adv.again = false; scheduleAdvice(); }
      });
  }
  function scheduleAdvice() {
    if (adv.fetching) { adv.again = true; return; }
    if (adv.timer) return;
    const wait = Math.max(0, adv.lastFetch + ADVICE_EVERY_MS - Date.now());
    adv.timer = setTimeout(function () { adv.timer = null; loadAdvice(); }, wait);
  }
  // an event that changes what became of a piece of advice
  function adviceOnEvent(m) {
    const d = m.data || {};
    if (m.kind === "knob_requested" && isObject(d.advice) && d.advice.evidence_key && d.change_id) {
      adv.byChange[d.change_id] = d.advice.evidence_key;
      if (!adv.applied.some(e => e.change_id === d.change_id))
        adv.requested[d.advice.evidence_key] = { change_id: d.change_id, state: "pending" };
    } else if (m.kind === "knob_applied") {
      const r = isObject(d.reason) ? d.reason : {};
      const key = r.evidence_key || r.undo_of || adv.byChange[d.change_id];
      if (key) {
        if (adv.requested[key] && adv.requested[key].change_id === d.change_id) delete adv.requested[key];
        if (r.message) adv.messages[key] = r.message;
        adv.applied.push({ key: key, change_id: d.change_id, step: m.step, cursor: m.cursor || 0,
                           undo: !!r.undo_of, text: describe(m.kind, d) });
        if (adv.applied.length > 20) adv.applied.shift();
      }
      scheduleAdvice();   // the knob moved: the advice reads the new value
    } else if (m.kind === "knob_rejected") {
      const key = adv.byChange[d.change_id];
      if (key) adv.requested[key] = { change_id: d.change_id, state: "rejected", text: "rejected: " + describe(m.kind, d) };
    } else if (m.kind === "advice_dismissed") {
      adv.dismissed.add(pairKey(d.rule, d.evidence_key));
    } else if (m.kind === "advice") {
      scheduleAdvice();
    }
    renderAdvice();
  }
  function canApply() { return page.can_control && state.allowed.indexOf("knobs") >= 0; }
  function figureText(f) {
    return f.name + " " + f.stat + " = " + fmt(f.value) + " (steps " + f.first_step + "–" + f.last_step + ")";
  }
  function showFigure(a, f, i, button) {
    const div = charts.highlight(f.name, f.first_step, f.last_step);
    adviceBox.querySelectorAll(".evidence button.shown").forEach(b => b.classList.remove("shown"));
    if (!div) {
      adv.shown = null;
      adviceMessage(f.name + " has no chart on this page: " + figureText(f), false);
      return;
    }
    adv.shown = a.evidence_key + "|" + i;
    button.classList.add("shown");
    adviceMessage("");
    div.scrollIntoView({ block: "nearest" });
  }
  function applyAdvice(a) {
    const knobs = {};
    knobs[a.knob] = a.proposed;
    const key = a.evidence_key;
    adv.requested[key] = { change_id: null, state: "pending" };
    renderAdvice();
    sendKnobs(knobs, { rule: a.rule, reason: a.reason, evidence_key: key }, function (m) {
      if (m.type === "knob_ack") {
        adv.byChange[m.change_id] = key;
        if (!adv.applied.some(e => e.change_id === m.change_id))
          adv.requested[key] = { change_id: m.change_id, state: "pending" };
        markChange(m.change_id, "pending", "pending: " + Object.keys(m.knobs).map(k => k + " = " + fmt(m.knobs[k])).join(", "));
      } else {
        adv.requested[key] = { change_id: null, state: "rejected", text: "not sent: " + errorText(m) };
      }
      renderAdvice();
    });
  }
  function dismissAdvice(a, button) {
    button.disabled = true;
    fetch("/api/runs/" + RUN + "/advice/dismiss", { method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRFToken": cookie("csrftoken") },
      body: JSON.stringify({ rule: a.rule, evidence_key: a.evidence_key }) })
      .then(r => r.json().then(function (j) {
        if (r.ok) { adv.dismissed.add(pairKey(a.rule, a.evidence_key)); adviceMessage(""); }
        else { adviceMessage("Not dismissed: " + errorText(j), true); scheduleAdvice(); }
        renderAdvice();
      }))
      .catch(function () { button.disabled = false; adviceMessage("Not dismissed (network).", true); });
  }
  function words(id) { return String(id || "").replace(/_/g, " "); }
  function adviceItem(a, st) {
    const li = el("li", { "data-key": a.evidence_key, "data-rule": a.rule, "data-state": st.state || "open" });
    const head = el("div", { class: "advice-head" });
    head.appendChild(el("span", { class: "advice-rule" }, a.rule));
    head.appendChild(el("span", { class: "muted" }, (a.confidence || "?") + " confidence"));
    li.appendChild(head);
    li.appendChild(el("div", { class: "advice-message" }, a.message));
    li.appendChild(el("div", { class: "advice-move" }, a.knob ? a.knob + ": " + fmt(a.current) + " → " + fmt(a.proposed)
                                                               : "no knob: " + words(a.reason)));
    if (a.expected) li.appendChild(el("div", { class: "advice-expected" }, "expected: " + a.expected));
    const ev = el("ul", { class: "evidence" });
    (a.evidence || []).forEach(function (f, i) {
      const b = el("button", { type: "button", class: "figure", "data-metric": f.name, "data-first": f.first_step,
                               "data-last": f.last_step, title: "show steps " + f.first_step + "–" + f.last_step + " on the chart" },
                   figureText(f));
      if (adv.shown === a.evidence_key + "|" + i) b.classList.add("shown");
      b.addEventListener("click", () => showFigure(a, f, i, b));
      ev.appendChild(el("li")).appendChild(b);
    });
    li.appendChild(ev);
    const row = el("div", { class: "advice-actions" });
    if (page.can_control && st.state !== "applied") {
      if (a.knob) {
        const apply = el("button", { type: "button", class: "advice-apply" }, "Apply");
        apply.disabled = !canApply() || st.state === "pending";
        apply.title = canApply() ? "set " + a.knob + " to " + fmt(a.proposed) + " at the next step boundary"
                                 : "the run does not take knob changes now";
        apply.addEventListener("click", () => applyAdvice(a));
        row.appendChild(apply);
      }
      const dismiss = el("button", { type: "button", class: "advice-dismiss" }, "Dismiss");
      dismiss.title = "hide this advice until its evidence changes";
      dismiss.addEventListener("click", () => dismissAdvice(a, dismiss));
      row.appendChild(dismiss);
    }
    if (st.text) row.appendChild(el("span", { class: "advice-state " + (st.state || "") }, st.text));
    li.appendChild(row);
    return li;
  }
  function appliedItem(e) {   // an applied piece of advice the pilot no longer gives
    const li = el("li", { "data-key": e.key, "data-state": "applied" });
    const head = el("div", { class: "advice-head" });
    head.appendChild(el("span", { class: "advice-state applied" }, (e.undo ? "undone" : "applied") + " at step " + e.step));
    li.appendChild(head);
    li.appendChild(el("div", { class: "advice-applied-text" }, e.text));
    const message = adv.messages[e.key];   // unless the change's own text says it (the autopilot's)
    if (message && !e.undo && e.text.indexOf(message) < 0) li.appendChild(el("div", { class: "advice-expected" }, message));
    return li;
  }
  function renderAdvice() {
    const ul = document.getElementById("advice-list");
    if (!ul) return;
    ul.textContent = "";
    const listed = new Set();
    adv.list.forEach(function (a) {
      if (a.dismissed || adv.dismissed.has(pairKey(a.rule, a.evidence_key))) return;
      // applied after this advice was read (its cursor): the advice is what was applied
      const done = adv.applied.filter(e => e.key === a.evidence_key && e.cursor > adv.cursor).pop();
      const req = adv.requested[a.evidence_key];
      const st = done ? { state: "applied", text: (done.undo ? "undone" : "applied") + " at step " + done.step }
        : req && req.state === "pending" ? { state: "pending", text: "pending: applies at the next step boundary" }
        : req && req.state === "rejected" ? { state: "rejected", text: req.text }
        : {};
      ul.appendChild(adviceItem(a, st));
      listed.add(a.evidence_key);
    });
    const recent = adv.applied.filter(e => !listed.has(e.key)).slice(-5).reverse();
    recent.forEach(e => ul.appendChild(appliedItem(e)));
    const shown = ul.children.length - recent.length;
    const empty = document.getElementById("advice-empty");
    const hidden = adv.list.length - shown;
    empty.hidden = shown > 0;
    empty.textContent = !adv.loads ? "Reading the run's metrics…"
      : adv.steps === null ? "No metrics yet: the pilot reads the last steps once there are some."
      : "No advice on steps " + adv.steps[0] + "–" + adv.steps[1] + (hidden > 0 ? " (" + hidden + " dismissed)" : "") + ".";
    document.getElementById("advice-steps").textContent = adv.steps ? "steps " + adv.steps[0] + "–" + adv.steps[1] : "";
  }

  // the autopilot: one checkbox per rule it may apply (the choices of the pilot.autopilot knob);
  // a change is an ordinary knob change of pilot.autopilot
  const autopilotSpec = page.knob_schema.find(k => k.name === "pilot.autopilot");
  let autopilotChange = null;   // the change_id of this page's pending change, or "sending"
  function autopilotRules() {
    const v = state.knobs["pilot.autopilot"];
    if (Array.isArray(v)) return v;
    return ((page.config || {}).pilot || {}).autopilot || [];
  }
  function renderAutopilot() {
    const box = document.getElementById("autopilot-rules");
    if (!box) return;
    if (!autopilotSpec) { document.getElementById("autopilot").hidden = true; return; }
    if (!box.children.length) {
      (autopilotSpec.choices || []).forEach(function (rule) {
        const label = el("label");
        const input = el("input", { type: "checkbox", name: "autopilot", value: rule });
        input.addEventListener("change", sendAutopilot);
        label.appendChild(input);
        label.appendChild(document.createTextNode(" " + rule));
        box.appendChild(label);
      });
    }
    const on = autopilotRules();
    box.querySelectorAll("input").forEach(function (inp) {
      if (!autopilotChange) inp.checked = on.indexOf(inp.value) >= 0;
      inp.disabled = !canApply() || !!autopilotChange;
    });
    document.getElementById("autopilot-state").textContent = autopilotChange ? "pending: applies at the next step boundary"
      : on.length ? "on for " + on.join(", ") : "off: advice only";
  }
  function sendAutopilot() {
    const rules = Array.from(document.querySelectorAll("#autopilot-rules input")).filter(i => i.checked).map(i => i.value);
    autopilotChange = "sending";
    renderAutopilot();
    sendKnobs({ "pilot.autopilot": rules }, null, function (m) {
      if (m.type === "knob_ack") {
        autopilotChange = m.change_id;
        markChange(m.change_id, "pending", "pending: pilot.autopilot = " + fmt(m.knobs["pilot.autopilot"]));
      } else {
        autopilotChange = null;
        adviceMessage("Autopilot not changed: " + errorText(m), true);
      }
      renderAutopilot();
    });
  }
  function autopilotOnOutcome(changeId) {
    if (changeId && changeId === autopilotChange) { autopilotChange = null; renderAutopilot(); }
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
    const range = k.type === "list" ? (k.choices ? "a list of " + k.choices.join(", ") : "a list")
      : k.choices ? "one of " + k.choices.join(", ") : k.type === "bool" ? "true / false"
      : "[" + (k.min === null ? "-∞" : k.min) + ", " + (k.max === null ? "∞" : k.max) + "]";
    name.appendChild(el("small", {}, range + " — " + k.help));
    tr.appendChild(name);
    tr.appendChild(el("td", { class: "current", "data-current": k.name }, ""));
    const td = el("td");
    let input;
    if (k.type === "list") {   // several values: comma-separated text (the server splits and checks it)
      input = el("input", { type: "text", name: k.name, "data-type": k.type, size: "8", placeholder: "a, b ([] = none)" });
    } else if (k.choices || k.type === "bool") {
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
      td.textContent = v === undefined ? "" : Array.isArray(v) ? (v.length ? v.join(", ") : "(none)") : fmt(v);
    });
    renderAutopilot();
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
    sendKnobs(knobs, null, onKnobReply);
  });
  // A knob change over the socket when it is open, else through the API; `advice`: the
  // {rule, reason, evidence_key} of the advice it applies (or null). `onReply` gets the
  // knob_ack or the error (the socket's reply is matched by its request_id).
  let requestSeq = 0;
  const replyTo = {};
  function sendKnobs(knobs, advice, onReply) {
    if (state.ws && state.ws.readyState === WebSocket.OPEN) {
      const id = "knobs-" + (++requestSeq);
      replyTo[id] = onReply;
      const msg = { type: "set_knobs", knobs: knobs, request_id: id };
      if (advice) msg.advice = advice;
      state.ws.send(JSON.stringify(msg));
    } else {
      fetch("/api/runs/" + RUN + "/knobs", { method: "POST", credentials: "same-origin",
        headers: { "Content-Type": "application/json", "X-CSRFToken": cookie("csrftoken") },
        body: JSON.stringify(advice ? { knobs: knobs, advice: advice } : knobs) })
        .then(r => r.json().then(j => onReply(r.ok ? Object.assign({ type: "knob_ack" }, j) : Object.assign({ type: "error" }, j))))
        .catch(() => onReply({ type: "error", message: "the change was not sent (network)" }));
    }
  }
  function knobReply(m) {   // a socket's knob_ack or error: to whoever sent that request
    const cb = m.request_id !== undefined && m.request_id !== null ? replyTo[m.request_id] : null;
    if (cb) { delete replyTo[m.request_id]; cb(m); } else onKnobReply(m);
  }
  function errorText(m) {
    const errs = Object.keys(m.errors || {}).map(k => k + ": " + m.errors[k]).join("; ");
    return (m.message || "refused") + (errs ? " — " + errs : "");
  }
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
    renderAutopilot();
    renderAdvice();
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
      if (m.type === "knob_ack" || m.type === "error") knobReply(m);
      else if (m.type === "stream") showStream(m.mode, m.message);
      else handle(m, true);
    };
    ws.onclose = function () {
      conn.textContent = "reconnecting…"; conn.removeAttribute("data-live");
      if (!state.closed) setTimeout(connect, 1000);
    };
  }

  loadAdvice();
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
