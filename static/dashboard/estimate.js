// The launch form's Estimate button (#estimate-submit): what the configured run would take, from
// POST /api/estimates with the form's preset, raw TOML, queue and filled fields (as the launch
// reads them). Past runs of the same shape answer at once (named); else a worker calibrates the
// run, and GET /api/estimates/<id> is asked every POLL_MS until it is done or failed
// (docs/cost.md). The answer goes in #launch-estimate, always as text.
(function () {
  "use strict";
  const POLL_MS = 2000;
  const MAX_POLLS = 600;   // 20 minutes: the server fails a calibration lost for 15
  const PREFIX = "cfg:";
  const form = document.getElementById("launch-form");
  const btn = document.getElementById("estimate-submit");
  const out = document.getElementById("launch-estimate");
  if (!form || !btn || !out) return;

  const cookie = RLCommon.cookie, duration = RLCommon.duration, sig = RLCommon.sig;   // common.js

  function request() {
    const data = new FormData(form);
    const overrides = {};
    for (const [k, v] of data.entries())
      if (k.startsWith(PREFIX) && String(v).trim() !== "") overrides[k.slice(PREFIX.length)] = String(v).trim();
    const toml = String(data.get("toml") || "");
    return { preset: String(data.get("preset") || "") || null, queue: String(data.get("queue") || "") || null,
             toml: toml.trim() ? toml : null, overrides: overrides };
  }

  function text(e) {
    const r = e.result;
    const hours = Object.keys(r.device_s).map(k => sig(r.device_s[k] / 3600) + " " + k + " device-hours").join(", ");
    let t = "Estimate: " + r.max_steps + " steps, about " + duration(r.seconds) + " (" + duration(r.low_s) +
      "–" + duration(r.high_s) + ") at " + r.pace_s.toFixed(2) + " s a step; " + hours;
    if (r.price !== null && r.price !== undefined)
      t += "; price about " + sig(r.price) + " (" + sig(r.price_low) + "–" + sig(r.price_high) + ")";
    if (r.source === "history")
      t += ". From " + r.runs.length + " past run" + (r.runs.length > 1 ? "s" : "") + " of the same shape: " +
        r.runs.map(x => "#" + x.id + " " + x.name).join(", ") + ".";
    else
      t += ". From a calibration: " + r.steps_measured + " steps of the run itself in " + r.calibration_s + " s.";
    return t;
  }

  function show(e) {
    out.hidden = false;
    out.classList.toggle("error", e.status === "failed");
    if (e.status === "done") out.textContent = text(e);
    else if (e.status === "failed") out.textContent = "No estimate: " + e.error;
    else out.textContent = "Estimating: no past run has this shape, so a worker on " + e.queue +
      " runs it for a short calibration (" + e.status + ")…";
    return e.status === "done" || e.status === "failed";
  }

  function stop(message) {
    out.classList.add("error");
    out.textContent = message;
    btn.disabled = false;
  }

  // until done or failed; an answer that is not the estimate, or no answer for MAX_POLLS, ends it
  function poll(url, n) {
    if (n >= MAX_POLLS) return stop("No estimate yet after " + Math.round(MAX_POLLS * POLL_MS / 60000) +
                                    " minutes: no worker has taken it. It stays on the server: " + url);
    fetch(url, { credentials: "same-origin" }).then(r => r.json().then(body => ({ ok: r.ok, body: body })))
      .then(function (res) {
        if (!res.ok || !res.body.status) return stop("No estimate: " + (res.body.message || "the server refused"));
        if (!show(res.body)) setTimeout(function () { poll(url, n + 1); }, POLL_MS);
        else btn.disabled = false;
      })
      .catch(function () { setTimeout(function () { poll(url, n + 1); }, POLL_MS); });
  }

  btn.addEventListener("click", function () {
    btn.disabled = true;
    out.hidden = false;
    out.classList.remove("error");
    out.textContent = "Estimating…";
    fetch("/api/estimates", {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRFToken": cookie("csrftoken") },
      body: JSON.stringify(request()),
    }).then(r => r.json().then(body => ({ ok: r.ok, body: body }))).then(function (res) {
      if (!res.ok) {
        const errs = res.body.errors || {};
        out.classList.add("error");
        out.textContent = "No estimate: " + (Object.keys(errs).length
          ? Object.keys(errs).map(k => k + ": " + errs[k]).join("; ") : res.body.message);
        btn.disabled = false;
      } else if (!show(res.body)) poll(res.body.url, 0);
      else btn.disabled = false;
    }).catch(function () { out.textContent = "No estimate: the server did not answer"; btn.disabled = false; });
  });
})();
