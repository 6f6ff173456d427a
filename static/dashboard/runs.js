// The launch form: fill the raw TOML editor with the selected preset's full config, and show
// the preset's values as placeholders.
(function () {
  "use strict";
  const presets = JSON.parse(document.getElementById("preset-toml").textContent);
  const btn = document.getElementById("load-preset-toml");
  const sel = document.getElementById("id_preset");
  const area = document.getElementById("id_toml");
  if (btn) {
    btn.addEventListener("click", function () {
      const preset = presets[sel.value];
      area.value = preset ? preset.toml : "";
    });
  }
  // the preset's values by dotted key, as the server read them (no TOML parsing here)
  function placeholders() {
    const vals = presets[sel.value] ? presets[sel.value].values : {};
    document.querySelectorAll("input[data-key]").forEach(function (inp) {
      if (vals[inp.dataset.key] !== undefined) inp.placeholder = vals[inp.dataset.key];
    });
  }
  sel.addEventListener("change", placeholders);
  placeholders();
})();

// The runs list: refresh status, progress, key figures and cost every few seconds.
(function () {
  "use strict";
  const table = document.getElementById("runs-table");
  if (!table) return;
  const FIG = ["reward/accuracy", "reward/mean", "rollout/response_len/mean", "perf/gen_tokens_per_s"];
  // a figure: 3 significant digits, whole from 100 up (RLCommon.fmt, common.js); blank when missing
  const fmt = v => typeof v === "number" ? RLCommon.fmt(v, 3) : "";
  function refresh() {
    fetch("/api/runs?limit=200", { credentials: "same-origin" }).then(r => r.ok ? r.json() : null).then(function (data) {
      if (!data) return;
      data.runs.forEach(function (run) {
        const tr = table.querySelector('tr[data-run="' + run.id + '"]');
        if (!tr) return;
        const cells = tr.children;
        const badge = cells[3].querySelector(".status");
        badge.textContent = run.status;
        badge.className = "status s-" + run.status;
        const prog = cells[4];
        prog.querySelector("progress").value = run.step;
        prog.lastChild.textContent = " " + run.step + "/" + run.max_steps;
        const latest = (run.summary && run.summary.latest) || {};
        FIG.forEach(function (k, i) { cells[5 + i].textContent = fmt(latest[k]); });
        const paid = run.cost || {};   // device-hours so far and their price at the run's rates
        cells[5 + FIG.length].textContent = fmt(paid.device_hours);
        cells[6 + FIG.length].textContent = fmt(paid.price);
      });
    }).catch(function () {});
  }
  setInterval(refresh, 5000);
})();

