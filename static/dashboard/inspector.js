// The rollout inspector (live page and report page): the samples table with its filters, read
// from GET /api/runs/<id>/samples; a sample opened whole (GET .../samples/<sid>) with its tokens
// shaded by the policy version that produced them (or by log-probability) and the other members
// of its group beside it. RLInspector.create(panel, {run}) returns {open(filters), onFrame(m)}:
// the charts call open() on a click, the live page hands it the socket's "samples" frames.
//
// A multi-turn episode (its row has `turns`) is shown turn by turn: the model's turns shaded per
// token as above, the environment's messages (tool results, feedback: version -1, never trained)
// set apart and marked "not trained".
//
// Everything the model wrote is text: it is inserted with textContent, never as HTML.
(function () {
  "use strict";

  const el = RLCommon.el;   // static/dashboard/common.js, loaded first
  function num(v, digits) { return v === null || v === undefined ? "—" : RLCommon.fmt(v, digits); }
  // one colour per policy version (cycled), light enough to read text on
  const PALETTE = ["#bfdbfe", "#fde68a", "#bbf7d0", "#fbcfe8", "#ddd6fe", "#fed7aa", "#a5f3fc", "#e5e7eb",
                   "#fecaca", "#d9f99d"];
  function versionColour(v) { return PALETTE[((v % PALETTE.length) + PALETTE.length) % PALETTE.length]; }
  // an episode's environment tokens (tool results, feedback) carry this version: no policy sampled them
  const ENV_VERSION = -1;
  const ENV_LABEL = "environment (not trained)";
  function versionLabel(v) { return v === ENV_VERSION ? ENV_LABEL : "policy version " + v; }
  function isEpisode(s) { return Array.isArray(s.turns) && s.turns.length > 0; }
  function plural(n, word) { return n + " " + word + (n === 1 ? "" : "s"); }
  // "3 turns · 2 tool calls" (the table, a group member); "" for a single-turn sample
  function turnsBadge(ep) {
    if (!ep || !ep.turns) return "";
    return plural(ep.turns, "turn") + " · " + plural(ep.tool_calls || 0, "tool call") +
      (ep.tool_errors ? " (" + ep.tool_errors + " failed)" : "");
  }
  // log-probability -> white (certain) .. red (surprising), saturating at -5
  function logprobColour(lp) {
    if (lp === null || lp === undefined || typeof lp !== "number") return "#f3f4f6";
    const t = Math.max(0, Math.min(1, -lp / 5));
    const g = Math.round(255 - 150 * t), b = Math.round(255 - 170 * t);
    return "rgb(255," + g + "," + b + ")";
  }

  const FILTERS = ["min_step", "max_step", "min_len", "max_len", "min_reward", "max_reward", "finish",
                   "reward_status", "q", "order"];
  const DEFAULT_ORDER = "-step";
  const LIMIT = 50;
  // a live page prepends new rows only up to this many; past it they wait behind the "N new
  // samples — show" button, so a long run's page does not grow without end
  const LIVE_ROWS_MAX = 300;

  function create(panel, opts) {
    const run = opts.run;
    const form = panel.querySelector("#samples-filters");
    const tbody = panel.querySelector("#samples-table tbody");
    const more = panel.querySelector("#samples-more");
    const detail = panel.querySelector("#sample-detail");
    const errorBox = panel.querySelector("#samples-error");
    const countBox = panel.querySelector("#samples-count");
    const newBtn = panel.querySelector("#samples-new");
    let cursor = null, shown = new Set(), loading = 0, pendingNew = 0, openId = null;

    function params() {
      const p = {};
      FILTERS.forEach(function (name) {
        const inp = form.elements[name];
        if (inp && String(inp.value).trim() !== "") p[name] = String(inp.value).trim();
      });
      if (!p.order) p.order = DEFAULT_ORDER;
      return p;
    }
    function setParams(p) {
      FILTERS.forEach(function (name) {
        const inp = form.elements[name];
        if (inp) inp.value = p[name] !== undefined && p[name] !== null ? String(p[name]) : "";
      });
      if (!form.elements.order.value) form.elements.order.value = DEFAULT_ORDER;
    }
    function url(p, after) {
      const q = new URLSearchParams(Object.assign({}, p, { limit: String(LIMIT), fields: "summary" }));
      if (after) q.set("after", after);
      return "/api/runs/" + run + "/samples?" + q.toString();
    }
    function showError(text) {
      errorBox.textContent = text || "";
      errorBox.hidden = !text;
    }
    function describeFilters(p) {
      const parts = [];
      if (p.min_step && p.min_step === p.max_step) parts.push("step " + p.min_step);
      else if (p.min_step || p.max_step) parts.push("steps " + (p.min_step || "…") + "–" + (p.max_step || "…"));
      if (p.min_len || p.max_len) parts.push("length " + (p.min_len || "0") + "–" + (p.max_len || "…"));
      if (p.min_reward || p.max_reward) parts.push("reward " + (p.min_reward || "…") + "–" + (p.max_reward || "…"));
      ["finish", "reward_status", "group"].forEach(k => { if (p[k]) parts.push(k.replace("_", " ") + " " + p[k]); });
      if (p.q) parts.push("text “" + p.q + "”");
      return parts.join(", ");
    }

    function row(s) {
      const tr = el("tr", { "data-sample": String(s.id), "data-step": String(s.step), "data-length": String(s.length),
                            tabindex: "0", class: "sample-row" + (s.reward_status !== "ok" ? " bad-reward" : "") });
      [s.step, s.group, s.index, s.length, num(s.reward), s.finish, s.why].forEach(function (v, i) {
        const td = tr.appendChild(el("td", i < 5 ? { class: "num" } : {}, v));
        if (i === 5) td.appendChild(el("small", { class: "turns-badge muted" }, turnsBadge(s.episode) ? " · " + turnsBadge(s.episode) : ""));
      });
      tr.appendChild(el("td", { class: "status-" + s.reward_status }, s.reward_status));
      tr.appendChild(el("td", { class: "preview" }, s.preview === undefined ? "" : s.preview));
      if (s.id === openId) tr.classList.add("open");
      tr.addEventListener("click", () => openSample(s.id));
      tr.addEventListener("keydown", ev => { if (ev.key === "Enter") openSample(s.id); });
      return tr;
    }
    function addRows(rows, atTop) {
      const frag = document.createDocumentFragment();
      rows.forEach(function (s) {
        if (shown.has(s.id)) return;
        shown.add(s.id);
        frag.appendChild(row(s));
      });
      if (atTop) tbody.insertBefore(frag, tbody.firstChild); else tbody.appendChild(frag);
      countBox.textContent = shown.size + (cursor ? "+" : "") + " shown" + (describeFilters(params()) ? " · " + describeFilters(params()) : "");
      panel.setAttribute("data-rows", String(shown.size));
    }
    function load(reset) {
      const p = params();
      if (reset) {
        cursor = null; shown = new Set(); pendingNew = 0;
        tbody.textContent = "";
        newBtn.hidden = true;
      }
      const token = ++loading;
      panel.setAttribute("data-loading", "1");
      return fetch(url(p, reset ? null : cursor), { credentials: "same-origin" })
        .then(r => r.json().then(j => ({ ok: r.ok, j: j })))
        .then(function (res) {
          if (token !== loading) return;   // a newer query is on its way
          panel.removeAttribute("data-loading");
          if (!res.ok) {
            const errs = Object.keys(res.j.errors || {}).map(k => k + ": " + res.j.errors[k]).join("; ");
            showError((res.j.message || "error") + (errs ? " — " + errs : ""));
            return;
          }
          showError("");
          cursor = res.j.cursor;
          addRows(res.j.samples, false);
          more.hidden = !cursor;
          if (!shown.size) {
            const tr = el("tr", { class: "empty" });
            tr.appendChild(el("td", { colspan: "9", class: "muted" }, describeFilters(p) ? "No sample matches." :
              "No sample was recorded yet (the trainer records a few per step: run.log_samples)."));
            tbody.appendChild(tr);
          }
          panel.setAttribute("data-loaded", String(token));
        })
        .catch(function (e) { if (token === loading) { panel.removeAttribute("data-loading"); showError(String(e)); } });
    }

    // --- a new step's samples over the socket: shown at once when the table is the live view
    function matches(s, p) {
      const n = k => (p[k] !== undefined ? Number(p[k]) : null);
      if (p.q) return false;   // text search: the server decides
      if (p.step && s.step !== n("step")) return false;
      if (p.group && s.group !== n("group")) return false;
      if (p.min_step && s.step < n("min_step")) return false;
      if (p.max_step && s.step > n("max_step")) return false;
      if (p.min_len && s.length < n("min_len")) return false;
      if (p.max_len && s.length > n("max_len")) return false;
      if ((p.min_reward || p.max_reward) && (s.reward === null || typeof s.reward !== "number")) return false;
      if (p.min_reward && s.reward < n("min_reward")) return false;
      if (p.max_reward && s.reward > n("max_reward")) return false;
      if (p.finish && s.finish !== p.finish) return false;
      if (p.reward_status && s.reward_status !== p.reward_status) return false;
      return true;
    }
    // the socket's summaries carry no text: one read of the step's previews fills the new rows
    function fillPreviews(step, ids) {
      const q = new URLSearchParams({ min_step: String(step), max_step: String(step), fields: "summary",
                                      limit: "500" });
      fetch("/api/runs/" + run + "/samples?" + q.toString(), { credentials: "same-origin" })
        .then(r => r.ok ? r.json() : { samples: [] })
        .then(function (j) {
          const want = new Set(ids);
          (j.samples || []).forEach(function (s) {
            if (!want.has(s.id)) return;
            const td = tbody.querySelector('tr[data-sample="' + s.id + '"] td.preview');
            if (td) td.textContent = s.preview || "";
            const badge = tbody.querySelector('tr[data-sample="' + s.id + '"] .turns-badge');
            if (badge && turnsBadge(s.episode)) badge.textContent = " · " + turnsBadge(s.episode);
          });
        })
        .catch(() => {});
    }
    function onFrame(m) {
      const p = params();
      const rows = (m.samples || []).filter(s => !shown.has(s.id));
      if (!rows.length) return;
      if (p.order === "-step" && !p.q && shown.size < LIVE_ROWS_MAX) {
        const fit = rows.filter(s => matches(s, p));
        if (fit.length) {
          const empty = tbody.querySelector("tr.empty");
          if (empty) empty.remove();
          addRows(fit.slice().sort((a, b) => a.group - b.group || a.index - b.index), true);
          fillPreviews(m.step, fit.map(s => s.id));
        }
        return;
      }
      pendingNew += rows.length;
      newBtn.textContent = pendingNew + " new sample" + (pendingNew === 1 ? "" : "s") + " — show";
      newBtn.hidden = false;
    }

    // --- one sample, whole --------------------------------------------------------------------
    function meta(dl, label, value) {   // one <div> per pair (a grid cell), as HTML allows in a <dl>
      const pair = el("div", { "data-field": label });
      pair.appendChild(el("dt", {}, label));
      pair.appendChild(el("dd", {}, value));
      dl.appendChild(pair);
    }
    // one token: its text, shaded by log-probability in that mode (an environment token has
    // none: no policy sampled it)
    function tokenSpan(s, i, v, mode) {
      const lp = (s.logprobs || [])[i];
      const env = v === ENV_VERSION;
      const t = el("span", { class: "tok", "data-logprob": env || lp === null || lp === undefined ? "" : String(lp),
                             title: "token " + i + " · " + (env ? ENV_LABEL : "version " + v + " · log p " + num(lp, 3)) },
                   (s.tokens || [])[i]);
      if (mode === "logprob" && !env) t.style.background = logprobColour(lp);
      return t;
    }
    function segSpan(v, n, k, mode) {
      const span = el("span", { class: "seg" + (v === ENV_VERSION ? " env" : ""), "data-version": String(v),
                                "data-segment": String(k), title: versionLabel(v) + " · " + n + " tokens" });
      if (mode === "version" && v !== null && v !== ENV_VERSION) span.style.background = versionColour(v);
      return span;
    }
    // an episode, turn by turn: a block per turn (the model's, or the environment's message),
    // its tokens in runs of one version (one span per run, shaded as a segment)
    function episodeView(s, mode) {
      const box = el("div", { class: "completion episode-view shade-" + mode, "data-mode": mode });
      const tokens = s.tokens || [];
      const version = [];
      (s.segments || []).forEach(seg => { for (let j = 0; j < seg[1]; j++) version.push(seg[0]); });
      let modelTurn = 0, k = 0;
      s.turns.forEach(function (turn, n) {
        const tool = turn.role === "tool";
        if (!tool) modelTurn += 1;
        const block = el("div", { class: "turn turn-" + (tool ? "tool" : "model"), "data-role": turn.role,
                                  "data-turn": String(n), "data-trained": turn.trained ? "true" : "false" });
        const head = el("div", { class: "turn-head" });
        head.appendChild(el("span", { class: "turn-role" }, tool ? "Tool message" : "Model turn " + modelTurn));
        head.appendChild(el("span", { class: "turn-size muted" }, " · " + plural(turn.end - turn.start, "token")));
        head.appendChild(el("span", { class: "turn-trained " + (turn.trained ? "trained" : "not-trained") },
                            turn.trained ? "trained" : "not trained" + (tool ? " · written by the environment" : "")));
        block.appendChild(head);
        const body = el("div", { class: "turn-body" });
        const runs = [];   // [span, version]
        for (let i = turn.start; i < turn.end && i < tokens.length; i++) {
          const v = i < version.length ? version[i] : (tool ? ENV_VERSION : null);
          if (!runs.length || v !== runs[runs.length - 1][1]) runs.push([body.appendChild(segSpan(v, 0, k++, mode)), v]);
          runs[runs.length - 1][0].appendChild(tokenSpan(s, i, v, mode));
        }
        runs.forEach(([sp, v]) => { sp.title = versionLabel(v) + " · " + plural(sp.children.length, "token"); });
        block.appendChild(body);
        box.appendChild(block);
      });
      return box;
    }
    // the response's tokens, one span each, inside one span per version segment
    function completionView(s, mode) {
      if (isEpisode(s) && (s.tokens || []).length) return episodeView(s, mode);
      const box = el("div", { class: "completion shade-" + mode, "data-mode": mode });
      const tokens = s.tokens || [];
      const segs = (s.segments && s.segments.length) ? s.segments : [[null, tokens.length]];
      if (!tokens.length) {   // no token pieces recorded: the text, shaded by its first version
        const seg = el("span", { class: "seg", "data-version": String(segs[0][0]) }, s.completion || "");
        if (mode === "version" && segs[0][0] !== null) seg.style.background = versionColour(segs[0][0]);
        box.appendChild(seg);
        return box;
      }
      let i = 0;
      segs.forEach(function (seg, k) {
        const v = seg[0];
        const span = segSpan(v, seg[1], k, mode);
        for (let j = 0; j < seg[1] && i < tokens.length; j++, i++) span.appendChild(tokenSpan(s, i, v, mode));
        box.appendChild(span);
      });
      if (i < tokens.length) {   // segments that do not cover every token: the rest, unshaded
        const rest = el("span", { class: "seg", "data-version": "?" });
        for (; i < tokens.length; i++) rest.appendChild(el("span", { class: "tok" }, tokens[i]));
        box.appendChild(rest);
      }
      return box;
    }
    function legend(s, mode) {
      const box = el("div", { class: "sample-legend" });
      if (mode === "logprob") {
        box.appendChild(el("span", {}, "log-probability of each token: "));
        [0, -1, -2.5, -5].forEach(function (lp) {
          const sw = el("span", { class: "swatch" }, lp === -5 ? "≤ −5" : String(lp));
          sw.style.background = logprobColour(lp);
          box.appendChild(sw);
        });
        if ((s.segments || []).some(seg => seg[0] === ENV_VERSION)) {   // no policy sampled them
          box.appendChild(el("span", { class: "swatch env", "data-legend-version": String(ENV_VERSION) },
                             ENV_LABEL + ": no log-probability"));
        }
        return box;
      }
      // the policy's segments and versions; the environment's tokens (an episode's tool
      // messages) apart: no policy wrote them
      const totals = new Map();
      let envTokens = 0;
      (s.segments || []).forEach(function (seg) {
        if (seg[0] === ENV_VERSION) envTokens += seg[1];
        else totals.set(seg[0], (totals.get(seg[0]) || 0) + seg[1]);
      });
      const policySegs = (s.segments || []).filter(seg => seg[0] !== ENV_VERSION).length;
      box.appendChild(el("span", {}, plural(policySegs, "segment") + " by " + plural(totals.size, "policy version") + ": "));
      Array.from(totals.keys()).sort((a, b) => a - b).forEach(function (v) {
        const sw = el("span", { class: "swatch", "data-legend-version": String(v) }, "v" + v + " · " + totals.get(v) + " tok");
        sw.style.background = versionColour(v);
        box.appendChild(sw);
      });
      if (envTokens) {
        box.appendChild(el("span", { class: "swatch env", "data-legend-version": String(ENV_VERSION) },
                           ENV_LABEL + " · " + envTokens + " tok"));
      }
      if (s.finish === "partial") box.appendChild(el("span", { class: "muted" }, " · parked and resumed across steps (APRIL)"));
      if (s.staleness) box.appendChild(el("span", { class: "muted" }, " · " + s.staleness + " version" + (s.staleness === 1 ? "" : "s") + " behind at training"));
      return box;
    }
    function rewarded(s) { return typeof s.reward === "number" && s.reward > 0; }
    function memberCard(m) {
      const card = el("div", { class: "member " + (rewarded(m) ? "got-reward" : "no-reward"), "data-sample": String(m.id),
                               "data-index": String(m.index), tabindex: "0" });
      const head = el("div", { class: "member-head" });
      head.appendChild(el("b", {}, "#" + m.index));
      head.appendChild(el("span", { class: "reward-mark" }, rewarded(m) ? "✓ reward " + num(m.reward) : "✗ reward " + num(m.reward)));
      head.appendChild(el("span", { class: "muted" }, m.length + " tok · " + m.finish + (m.reward_status !== "ok" ? " · " + m.reward_status : "") +
                          (turnsBadge(m.episode) ? " · " + turnsBadge(m.episode) : "")));
      card.appendChild(head);
      const text = m.completion || "";
      card.appendChild(el("div", { class: "member-text" }, text.length > 600 ? text.slice(0, 600) + "…" : text));
      card.addEventListener("click", () => openSample(m.id));
      return card;
    }
    function renderDetail(data, mode) {
      const s = data.sample;
      detail.textContent = "";
      detail.hidden = false;
      detail.setAttribute("data-sample", String(s.id));
      const head = el("div", { class: "row detail-head" });
      head.appendChild(el("h3", {}, "Step " + s.step + " · group " + s.group + " · #" + s.index + " (" + s.why + ")"));
      head.appendChild(el("span", { class: "spacer" }));
      const toggle = el("button", { type: "button", id: "shade-toggle", "data-mode": mode },
                        mode === "version" ? "Shade by log-probability" : "Shade by policy version");
      toggle.addEventListener("click", () => renderDetail(data, mode === "version" ? "logprob" : "version"));
      head.appendChild(toggle);
      const close = el("button", { type: "button", id: "sample-close" }, "Close");
      close.addEventListener("click", function () { detail.hidden = true; openId = null; markOpen(); });
      head.appendChild(close);
      detail.appendChild(head);
      const grid = el("div", { class: "detail-grid" });
      const main = el("div", { class: "detail-main" });
      const dl = el("dl", { class: "sample-meta" });
      meta(dl, "reward", num(s.reward) + (rewarded(s) ? " ✓" : ""));
      meta(dl, "score", num(s.score));
      meta(dl, "penalty", num(s.penalty));
      meta(dl, "advantage", num(s.advantage));
      meta(dl, "length", s.length + " tokens");
      meta(dl, "finish", s.finish);
      meta(dl, "staleness", String(s.staleness));
      if (s.episode && s.episode.turns) {
        const ep = s.episode;
        meta(dl, "episode", plural(ep.turns, "model turn") + " · " + plural(ep.tool_calls || 0, "tool call") +
             (ep.tool_errors ? " (" + ep.tool_errors + " failed)" : "") + " · " + num(ep.tool_s || 0, 3) + " s in tools" +
             (ep.end ? " · " + (ep.end_text || ep.end) : ""));   // the server's words (rows/samples.py)
      }
      meta(dl, "TIS weight", num(s.tis_weight));
      meta(dl, "reward status", s.reward_status + (s.reward_error ? ": " + s.reward_error : ""));
      main.appendChild(dl);
      main.appendChild(el("h4", {}, "Prompt"));
      main.appendChild(el("pre", { class: "sample-prompt" }, s.prompt));
      main.appendChild(el("h4", {}, isEpisode(s) ? "Episode, turn by turn" : "Completion"));
      main.appendChild(legend(s, mode));
      main.appendChild(completionView(s, mode));
      grid.appendChild(main);
      const side = el("div", { class: "detail-group" });
      side.appendChild(el("h4", {}, "Its group (" + (data.group.length + 1) + " recorded; " +
                          (data.group.filter(rewarded).length + (rewarded(s) ? 1 : 0)) + " got reward)"));
      if (!data.group.length) side.appendChild(el("p", { class: "muted" }, "No other member of this group was recorded."));
      data.group.forEach(m => side.appendChild(memberCard(m)));
      grid.appendChild(side);
      detail.appendChild(grid);
    }
    function markOpen() {
      tbody.querySelectorAll("tr.open").forEach(tr => tr.classList.remove("open"));
      if (openId !== null) {
        const tr = tbody.querySelector('tr[data-sample="' + openId + '"]');
        if (tr) tr.classList.add("open");
      }
    }
    function openSample(id) {
      openId = id;
      markOpen();
      return fetch("/api/runs/" + run + "/samples/" + encodeURIComponent(id), { credentials: "same-origin" })
        .then(r => r.json().then(j => ({ ok: r.ok, j: j })))
        .then(function (res) {
          if (!res.ok) { showError(res.j.message || "could not open the sample"); return; }
          if (openId !== id) return;
          renderDetail(res.j, "version");
          detail.scrollIntoView({ block: "nearest" });
        });
    }

    // --- the controls ------------------------------------------------------------------------
    form.addEventListener("submit", function (ev) { ev.preventDefault(); load(true); });
    ["finish", "reward_status", "order"].forEach(n => form.elements[n].addEventListener("change", () => load(true)));
    panel.querySelector("#samples-longest").addEventListener("click", function () {
      form.elements.order.value = "-length"; load(true);
    });
    panel.querySelector("#samples-worst").addEventListener("click", function () {
      form.elements.order.value = "reward"; load(true);
    });
    panel.querySelector("#samples-reset").addEventListener("click", function () { setParams({}); load(true); });
    more.addEventListener("click", () => load(false));
    newBtn.addEventListener("click", () => load(true));

    // from a chart: {step, min_len?, max_len?}; the other filters are cleared
    function open(pick) {
      const p = { min_step: pick.step, max_step: pick.step, order: "step" };
      if (pick.min_len !== undefined) p.min_len = pick.min_len;
      if (pick.max_len !== undefined) p.max_len = pick.max_len;
      if (pick.min_len !== undefined || pick.max_len !== undefined) p.order = "-length";
      setParams(p);
      panel.scrollIntoView({ block: "start" });
      return load(true);
    }

    setParams({});
    load(true);
    return { open: open, onFrame: onFrame, openSample: openSample, reload: () => load(true) };
  }

  window.RLInspector = { create: create, versionColour: versionColour, logprobColour: logprobColour };
})();
