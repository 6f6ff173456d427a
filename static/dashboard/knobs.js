// The live-tuning panel of the run page (#tuning): the knobs grouped by technique / section, each
// with its current value and a field for a new one. A change goes over the run's socket when it
// is open, else through POST /api/runs/<id>/knobs, and is listed (#knob-changes) as pending, then
// applied or rejected as the run's events say (run.js calls markChange). The advice panel
// (advice.js) sends its changes through send() too.
//
// RLKnobs.create(ctx), ctx = {page, state, cookie(name), showMessage(text, isError)}, from run.js;
// returns {send, reply, markChange, renderValues, renderButton, renderAprilContext}. Every text is inserted as text.
(function () {
  "use strict";
  const el = RLCommon.el, fmt = RLCommon.fmt;   // static/dashboard/common.js, loaded first

  // Grouped by technique / section. The knobs that matter most for the techniques this run uses
  // come first (η, APRIL's early termination, GRESO's alpha), then the rest of the enabled
  // techniques, then the general sections, then the techniques the run does not use; all but the
  // first group are folded.
  const TECHNIQUES = {
    async: { label: "Asynchronous training (AReaL)", key: ["async.max_staleness"] },
    april: { label: "APRIL (active partial rollouts)", key: ["april.segment_max_tokens", "april.over_sampling_batch_size"] },
    greso: { label: "GRESO (selective rollouts)", key: ["greso.alpha"] },
  };
  const SECTIONS = { rollout: "Rollout and sampling", episode: "Episodes: turns and tools",
                     algo: "Algorithm (GRPO / DAPO)",
                     mismatch: "Training–inference mismatch (engine vs trainer)", optim: "Optimiser" };

  function create(ctx) {
    const page = ctx.page, state = ctx.state, RUN = page.id;
    const knobRows = document.getElementById("knob-rows");

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
        : k.choices ? "one of " + k.choices.join(", ") : k.type === "bool" ? "true / false" : k.type === "str" ? "text"
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
      // a multi-turn run (episode.max_turns > 1 at launch) has its episode knobs open; a
      // single-turn one cannot become multi-turn (the trainer refuses raising max_turns from 1)
      const launchTurns = Number(((page.config || {}).episode || {}).max_turns || 1);
      const notes = { episode: launchTurns > 1 ? "multi-turn episodes" : "single-turn run" };
      Object.keys(SECTIONS).forEach(sec => knobGroup(sec, SECTIONS[sec], notes[sec] || "", rest(sec),
                                                     !on.length || (sec === "episode" && launchTurns > 1)));
      Object.keys(bySection).filter(sec => !SECTIONS[sec] && !TECHNIQUES[sec])
        .forEach(sec => knobGroup(sec, sec, "", rest(sec), false));
      Object.keys(TECHNIQUES).filter(t => on.indexOf(t) < 0)
        .forEach(t => knobGroup(t, TECHNIQUES[t].label, "not used by this run", rest(t), false));
    })();

    // APRIL's rules of thumb beside the run's values, as context (nothing enforces them): the
    // server's line (webapp/dashboard/reports/advice.py april_context, from trainer/pilot/april.py's
    // figures, which the pilot's APRIL advice cites too), in the page and in each read of the run
    // (run.js hands it over: renderAprilContext(text))
    const aprilBox = techniqueEnabled("april") ? el("p", { class: "muted", id: "april-context" }, "") : null;
    if (aprilBox) (knobRows.querySelector('[data-group="key"]') || knobRows).appendChild(aprilBox);
    let aprilText = page.april_context || "";
    function renderAprilContext(text) {
      if (typeof text === "string") aprilText = text;
      if (aprilBox) aprilBox.textContent = aprilText;
    }

    // the "Current" column, from state.knobs
    function renderValues() {
      document.querySelectorAll("[data-current]").forEach(function (td) {
        const v = state.knobs[td.getAttribute("data-current")];
        td.textContent = v === undefined ? "" : Array.isArray(v) ? (v.length ? v.join(", ") : "(none)") : fmt(v);
      });
      renderAprilContext();
    }
    // "Apply changes": enabled while this user may change the run and it takes knob changes
    function renderButton() {
      document.getElementById("knob-apply").disabled = !page.can_control || state.allowed.indexOf("knobs") < 0;
    }
    // a change in #knob-changes: pending, then applied or rejected (which stay)
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
      if (!Object.keys(knobs).length) { ctx.showMessage("Enter a new value for at least one knob.", true); return; }
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
          headers: { "Content-Type": "application/json", "X-CSRFToken": ctx.cookie("csrftoken") },
          body: JSON.stringify(advice ? { knobs: knobs, advice: advice } : knobs) })
          .then(r => r.json().then(j => onReply(r.ok ? Object.assign({ type: "knob_ack" }, j) : Object.assign({ type: "error" }, j))))
          .catch(() => onReply({ type: "error", message: "the change was not sent (network)" }));
      }
    }
    function knobReply(m) {   // a socket's knob_ack or error: to whoever sent that request
      const cb = m.request_id !== undefined && m.request_id !== null ? replyTo[m.request_id] : null;
      if (cb) { delete replyTo[m.request_id]; cb(m); } else onKnobReply(m);
    }
    function onKnobReply(m) {
      if (m.type === "knob_ack") {
        markChange(m.change_id, "pending", "pending: " + Object.keys(m.knobs).map(k => k + " = " + fmt(m.knobs[k])).join(", "));
        knobRows.querySelectorAll("input, select").forEach(inp => { inp.value = ""; });
        ctx.showMessage("Change " + m.change_id + " sent; it applies at the next step boundary.");
      } else {
        const errs = Object.keys(m.errors || {}).map(k => k + ": " + m.errors[k]).join("; ");
        ctx.showMessage(m.message + (errs ? " — " + errs : ""), true);
      }
    }

    return { send: sendKnobs, reply: knobReply, markChange: markChange, renderValues: renderValues,
             renderButton: renderButton, renderAprilContext: renderAprilContext };
  }

  window.RLKnobs = { create: create };
})();
