// The advice panel of the run page (#advice): the pilot's advice (GET /api/runs/<id>/advice;
// docs/pilot.md) with Apply and Dismiss, its evidence figures shaded on the charts, what became of
// each piece (pending, applied from step N, rejected, dismissed), and the autopilot's checkboxes.
//
// RLAdvice.create(ctx), ctx = {page, state, charts, knobs, cookie(name)}, from run.js (charts:
// RLCharts.create's, for the highlight; knobs: RLKnobs.create's, which sends the changes); returns
// {load, schedule, onEvent, onOutcome, render, renderAutopilot}. An event's text is the server's
// (the event's "text", formatting.describe_event). Every text is inserted as text.
(function () {
  "use strict";
  const el = RLCommon.el, fmt = RLCommon.fmt, sig = RLCommon.sig;   // static/dashboard/common.js
  // Read on load and again when new steps arrive (at most every ADVICE_EVERY_MS). What became of
  // a piece of advice (Apply pending, applied from step N, rejected, dismissed) comes from the
  // run's events, so a reload or a second viewer shows the same.
  const ADVICE_EVERY_MS = 3000;
  const pairKey = (rule, key) => rule + "|" + key;
  function isObject(v) { return v !== null && typeof v === "object" && !Array.isArray(v); }
  function errorText(m) {   // a refused request's reply as one line
    const errs = Object.keys(m.errors || {}).map(k => k + ": " + m.errors[k]).join("; ");
    return (m.message || "refused") + (errs ? " — " + errs : "");
  }
  function words(id) { return String(id || "").replace(/_/g, " "); }
  function figureText(f) {
    return f.name + " " + f.stat + " = " + fmt(f.value) + " (steps " + f.first_step + "–" + f.last_step + ")";
  }

  function create(ctx) {
    const page = ctx.page, state = ctx.state, charts = ctx.charts, knobs = ctx.knobs, RUN = page.id;
    const adv = {
      list: [], cursor: 0, steps: null, loads: 0,
      dismissed: new Set(),    // "rule|evidence_key" dismissed (advice_dismissed events, this page's clicks)
      requested: {},           // evidence_key -> {change_id, state: "pending" | "rejected", text}
      byChange: {},            // change_id -> evidence_key of the advice it applies
      applied: [],             // knob_applied events from advice: {key, step, cursor, text, message}
      messages: {},            // evidence_key -> the advice's message, as last read
      shown: null,             // the evidence figure highlighted: "evidence_key|index"
    };
    const adviceBox = document.getElementById("advice");
    function adviceMessage(text, isError) {
      const p = document.getElementById("advice-msg");
      p.textContent = text || "";
      p.hidden = !text;
      p.className = isError ? "error" : "muted";
    }
    function readAdvice() {
      return fetch("/api/runs/" + RUN + "/advice", { credentials: "same-origin" })
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
        .catch(() => adviceMessage("The advice could not be read (network).", true));
    }
    const reads = RLCommon.poller(ADVICE_EVERY_MS, readAdvice);   // common.js
    const loadAdvice = reads.load, scheduleAdvice = reads.schedule;
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
                             undo: !!r.undo_of, text: m.text });
          if (adv.applied.length > 20) adv.applied.shift();
        }
        scheduleAdvice();   // the knob moved: the advice reads the new value
      } else if (m.kind === "knob_rejected") {
        const key = adv.byChange[d.change_id];
        if (key) adv.requested[key] = { change_id: d.change_id, state: "rejected", text: "rejected: " + m.text };
      } else if (m.kind === "advice_dismissed") {
        adv.dismissed.add(pairKey(d.rule, d.evidence_key));
      } else if (m.kind === "advice") {
        scheduleAdvice();
      }
      renderAdvice();
    }
    function canApply() { return page.can_control && state.allowed.indexOf("knobs") >= 0; }
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
      const change = {};
      change[a.knob] = a.proposed;
      const key = a.evidence_key;
      adv.requested[key] = { change_id: null, state: "pending" };
      renderAdvice();
      knobs.send(change, { rule: a.rule, reason: a.reason, evidence_key: key }, function (m) {
        if (m.type === "knob_ack") {
          adv.byChange[m.change_id] = key;
          if (!adv.applied.some(e => e.change_id === m.change_id))
            adv.requested[key] = { change_id: m.change_id, state: "pending" };
          knobs.markChange(m.change_id, "pending", "pending: " + Object.keys(m.knobs).map(k => k + " = " + fmt(m.knobs[k])).join(", "));
        } else {
          adv.requested[key] = { change_id: null, state: "rejected", text: "not sent: " + errorText(m) };
        }
        renderAdvice();
      });
    }
    function dismissAdvice(a, button) {
      button.disabled = true;
      fetch("/api/runs/" + RUN + "/advice/dismiss", { method: "POST", credentials: "same-origin",
        headers: { "Content-Type": "application/json", "X-CSRFToken": ctx.cookie("csrftoken") },
        body: JSON.stringify({ rule: a.rule, evidence_key: a.evidence_key }) })
        .then(r => r.json().then(function (j) {
          if (r.ok) { adv.dismissed.add(pairKey(a.rule, a.evidence_key)); adviceMessage(""); }
          else { adviceMessage("Not dismissed: " + errorText(j), true); scheduleAdvice(); }
          renderAdvice();
        }))
        .catch(function () { button.disabled = false; adviceMessage("Not dismissed (network).", true); });
    }
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
      const c = a.cost_per_100_steps;   // what the drops it is about cost now (docs/cost.md)
      if (c) li.appendChild(el("div", { class: "advice-cost" }, "at stake: the " + c.reasons.join(", ") +
        " drops cost " + sig(c.device_s / 3600) + " device-hours per 100 steps at the present pace" +
        (c.price !== null && c.price !== undefined ? " (price " + sig(c.price) + ")" : "")));
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
      head.appendChild(el("span", { class: "advice-state applied" }, (e.undo ? "undone" : "applied") + " from step " + RLCommon.actsFrom(e.step)));
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
        const st = done ? { state: "applied", text: (done.undo ? "undone" : "applied") + " from step " + RLCommon.actsFrom(done.step) }
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
      knobs.send({ "pilot.autopilot": rules }, null, function (m) {
        if (m.type === "knob_ack") {
          autopilotChange = m.change_id;
          knobs.markChange(m.change_id, "pending", "pending: pilot.autopilot = " + fmt(m.knobs["pilot.autopilot"]));
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

    return { load: loadAdvice, schedule: scheduleAdvice, onEvent: adviceOnEvent, onOutcome: autopilotOnOutcome,
             render: function () { renderAutopilot(); renderAdvice(); }, renderAutopilot: renderAutopilot };
  }

  window.RLAdvice = { create: create };
})();
