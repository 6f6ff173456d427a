// The live run page: charts (Plotly, served from static/), live updates over the WebSocket,
// the live-tuning panel, stop/pause/resume/kill and the event log. Everything a user typed is
// inserted with textContent, never as HTML.
(function () {
  "use strict";
  const page = JSON.parse(document.getElementById("run-page").textContent);
  const RUN = page.id;
  const state = { series: {}, hists: {}, cursor: 0, status: page.status, step: page.step,
                  knobs: Object.assign({}, page.knobs), annotations: [], ws: null, closed: false };
  const MAX_LOCAL = 4000;

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
  function findEta() {
    const cfg = page.config || {};
    for (const sec in cfg) for (const k in cfg[sec])
      if (/^(eta|max_staleness|staleness(_bound)?)$/.test(k)) {
        const name = sec + "." + k;
        return { key: name, value: state.knobs[name] !== undefined ? state.knobs[name] : cfg[sec][k] };
      }
    return null;
  }

  // --- charts --------------------------------------------------------------------------------
  const hasGpu = () => !!state.series["system/gpu_util"];
  const CHARTS = [
    { id: "system", title: () => hasGpu() ? "GPU utilisation (%) and memory (GB)" : "CPU utilisation (%) and RAM (GB) — no GPU",
      keys: () => hasGpu() ? ["system/gpu_util", "system/gpu_mem_gb"] : ["system/cpu_util", "system/ram_gb"], y2: 1 },
    { id: "reward", title: "Reward and accuracy", keys: ["reward/mean", "reward/accuracy", "eval/accuracy"] },
    { id: "kl", title: "KL to the reference (k3)", keys: ["actor/kl"] },
    { id: "len-hist", type: "hist", name: "rollout/response_len", title: "Rollout length (latest step)" },
    { id: "len-heat", type: "heat", name: "rollout/response_len", title: "Rollout length: steps × length bins" },
    { id: "resp-len", title: "Response length (tokens)", keys: ["rollout/response_len/mean", "rollout/response_len/p50",
      "rollout/response_len/p90", "rollout/response_len/max"] },
    { id: "staleness", title: "Staleness: mean and max against η", keys: ["async/staleness/mean", "async/staleness/max"], eta: true },
    { id: "staleness-hist", type: "hist", name: "async/staleness", title: "Staleness histogram (latest step)" },
    { id: "throughput", title: "Throughput (tokens/s): generated and trained", keys: ["perf/gen_tokens_per_s", "perf/trained_tokens_per_s"] },
    { id: "zero-var", title: "Zero-variance group ratio", keys: ["rollout/zero_var_ratio", "rollout/zero_var_ratio/all_correct",
      "rollout/zero_var_ratio/all_wrong"] },
    { id: "greso", title: "GRESO: skip rate, p_easy, p_hard", keys: ["greso/skip_rate", "greso/p_easy", "greso/p_hard"] },
    { id: "april", title: "APRIL: buffer size and off-policy token ratio", keys: ["april/buffer_size", "april/offpolicy_token_ratio"], y2: 1 },
    { id: "timing", title: "Step timings (s)", prefix: "timing/" },
    { id: "actor", title: "Clip ratio, importance weight, grad norm", keys: ["actor/clip_ratio", "actor/importance_weight",
      "actor/behave_imp_weight", "actor/grad_norm"] },
  ];
  const chartsEl = document.getElementById("charts");
  CHARTS.forEach(function (c) {
    c.div = el("div", { id: "chart-" + c.id, class: "chart empty", "data-npoints": "0" });
    chartsEl.appendChild(c.div);
  });
  function keysOf(c) {
    if (c.prefix) return Object.keys(state.series).filter(k => k.startsWith(c.prefix)).sort();
    return typeof c.keys === "function" ? c.keys() : c.keys;
  }
  function layoutFor(c, title, withAnnotations) {
    const lay = { title: { text: title, font: { size: 13 } }, margin: { l: 48, r: 40, t: 32, b: 32 },
                  showlegend: true, legend: { orientation: "h", y: -0.2, font: { size: 10 } },
                  xaxis: {}, uirevision: c.id };
    if (c.y2) lay.yaxis2 = { overlaying: "y", side: "right", showgrid: false };
    if (withAnnotations) {
      const anns = state.annotations.slice(-30);
      lay.shapes = anns.map(a => ({ type: "line", x0: a.step, x1: a.step, yref: "paper", y0: 0, y1: 1,
                                    line: { color: "#9333ea", width: 1, dash: "dot" } }));
      lay.annotations = anns.map(a => ({ x: a.step, yref: "paper", y: 1, text: "⚙", hovertext: a.text,
                                         showarrow: false, font: { color: "#9333ea" } }));
    }
    return lay;
  }
  function drawChart(c) {
    const title = typeof c.title === "function" ? c.title() : c.title;
    let traces = [], npoints = 0, lay;
    if (c.type === "hist" || c.type === "heat") {
      const hs = state.hists[c.name] || [];
      if (!hs.length) return;
      const last = hs[hs.length - 1];
      const centers = last.edges.slice(0, -1).map((e, i) => (e + last.edges[i + 1]) / 2);
      if (c.type === "hist") {
        traces = [{ type: "bar", x: centers, y: last.counts, name: "step " + last.step }];
        lay = layoutFor(c, title + " — step " + last.step, false);
        lay.xaxis = { title: { text: c.name.endsWith("staleness") ? "staleness (versions)" : "tokens" } };
        lay.bargap = 0.05;
      } else {
        const rows = hs.filter(h => h.edges.length === last.edges.length).slice(-300);
        traces = [{ type: "heatmap", x: centers, y: rows.map(h => h.step), z: rows.map(h => h.counts),
                    colorscale: "Viridis" }];
        lay = layoutFor(c, title, false);
        lay.xaxis = { title: { text: "length (tokens)" } };
        lay.yaxis = { title: { text: "step" } };
        lay.showlegend = false;
      }
      npoints = hs.length;
    } else {
      keysOf(c).forEach(function (k, i) {
        const s = state.series[k];
        if (!s || !s.steps.length) return;
        npoints += s.steps.length;
        traces.push({ type: "scattergl", mode: s.steps.length < 60 ? "lines+markers" : "lines",
                      name: k, x: s.steps, y: s.values, yaxis: c.y2 && i === 1 ? "y2" : "y",
                      marker: { size: 4 } });
      });
      if (!traces.length) return;
      lay = layoutFor(c, title, true);
      if (c.eta) {
        const eta = findEta();
        if (eta !== null && typeof eta.value === "number") {
          lay.shapes.push({ type: "line", xref: "paper", x0: 0, x1: 1, y0: eta.value, y1: eta.value,
                            line: { color: "#dc2626", dash: "dash" } });
          lay.annotations.push({ xref: "paper", x: 1, y: eta.value, text: "η = " + eta.value, showarrow: false,
                                 font: { color: "#dc2626" } });
        }
      }
    }
    c.div.classList.remove("empty");
    Plotly.react(c.div, traces, lay, { displaylogo: false, responsive: true });
    c.div.setAttribute("data-npoints", String(npoints));
  }
  function addChartsForNewHistograms() { // e.g. an APRIL buffer-age histogram: a chart of its own
    Object.keys(state.hists).forEach(function (name) {
      if (CHARTS.some(c => c.name === name)) return;
      const c = { id: "hist-" + name.replace(/[^A-Za-z0-9]+/g, "-"), type: "hist", name: name,
                  title: name + " (latest step)" };
      c.div = el("div", { id: "chart-" + c.id, class: "chart empty", "data-npoints": "0" });
      chartsEl.appendChild(c.div);
      CHARTS.push(c);
    });
  }
  let drawTimer = null;
  function scheduleDraw() {
    if (drawTimer) return;
    drawTimer = setTimeout(function () {
      drawTimer = null;
      addChartsForNewHistograms();
      CHARTS.forEach(function (c) { try { drawChart(c); } catch (e) { console.error(c.id, e); } });
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
  function setStatus(status) {
    state.status = status;
    const e = document.getElementById("run-status");
    e.textContent = status;
    e.className = "status s-" + status;
    updateButtons();
  }
  function rewind(step) {
    for (const k in state.series) {
      const s = state.series[k];
      let n = s.steps.length;
      while (n > 0 && s.steps[n - 1] > step) n--;
      s.steps.length = n; s.values.length = n;
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
      setStatus(m.status);
      logEvent(m.step, "status", m.status + (m.message ? " — " + m.message : ""));
      if (m.message) { const e = document.getElementById("run-error"); e.textContent = m.message; e.hidden = false; }
    } else if (m.type === "event") {
      onEvent(m);
    }
    scheduleDraw();
  }

  function describe(kind, d) {
    if (kind === "knob_applied") return Object.keys(d.changes || {}).map(k => k + ": " + fmt(d.changes[k].old) + " → " + fmt(d.changes[k].new)).join(", ") + " (by " + d.requested_by + ")";
    if (kind === "knob_requested") return Object.keys(d.knobs || {}).map(k => k + " = " + fmt(d.knobs[k])).join(", ") + " (by " + d.requested_by + ")";
    if (kind === "knob_rejected") return Object.keys(d.errors || {}).map(k => k + ": " + d.errors[k]).join("; ");
    if (kind === "error" || kind === "warning") return d.message || "";
    if (kind === "checkpoint") return d.path || "";
    const keys = Object.keys(d || {});
    return keys.slice(0, 8).map(k => k + "=" + (typeof d[k] === "object" ? JSON.stringify(d[k]) : fmt(d[k]))).join(" ");
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
    }
  }

  // --- tuning panel -----------------------------------------------------------------------------
  const knobRows = document.getElementById("knob-rows");
  page.knob_schema.forEach(function (k) {
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
    knobRows.appendChild(tr);
  });
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
  const ALLOWED = { pause: ["running"], resume: ["paused", "stopped", "failed", "interrupted"],
                    stop: ["queued", "running", "paused"], kill: ["queued", "running", "paused", "stopping"] };
  function updateButtons() {
    document.querySelectorAll("button[data-action]").forEach(function (b) {
      b.disabled = !page.can_control || ALLOWED[b.dataset.action].indexOf(state.status) < 0;
    });
    document.getElementById("knob-apply").disabled = !page.can_control ||
      ["queued", "running", "paused"].indexOf(state.status) < 0;
  }
  document.querySelectorAll("button[data-action]").forEach(function (b) {
    b.addEventListener("click", function () {
      const action = b.dataset.action;
      if (action === "kill" && !window.confirm("Kill this run now? Work since the last checkpoint is lost.")) return;
      fetch("/api/runs/" + RUN + "/" + action, { method: "POST", credentials: "same-origin",
        headers: { "X-CSRFToken": cookie("csrftoken"), "Content-Type": "application/json" }, body: "{}" })
        .then(r => r.json().then(j => {
          if (r.ok) { showMessage(action + " requested"); if (j.status) setStatus(j.status); }
          else showMessage(j.message || ("HTTP " + r.status), true);
        }));
    });
  });
  updateButtons();

  // --- the WebSocket ------------------------------------------------------------------------------
  function connect() {
    const proto = location.protocol === "https:" ? "wss://" : "ws://";
    const ws = new WebSocket(proto + location.host + "/ws/runs/" + RUN + "/?after=" + state.cursor);
    state.ws = ws;
    const conn = document.getElementById("conn");
    ws.onopen = function () { conn.textContent = "live"; conn.setAttribute("data-live", "1"); };
    ws.onmessage = function (ev) {
      let m;
      try { m = JSON.parse(ev.data); } catch (e) { return; }
      if (m.type === "knob_ack" || m.type === "error") onKnobReply(m);
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
          setStatus(m.status);
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
