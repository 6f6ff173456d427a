// The report page: every chart of the live page, drawn once from the run's rows (no socket), and
// the samples panel.
(function () {
  "use strict";
  const page = JSON.parse(document.getElementById("report-page").textContent);
  // the rollout inspector (static/dashboard/inspector.js); a click on a chart opens that step's samples
  const samplesBox = document.getElementById("samples-panel");
  const inspector = samplesBox && window.RLInspector ? RLInspector.create(samplesBox, { run: page.id }) : null;
  fetch("/api/runs/" + page.id + "/metrics", { credentials: "same-origin" })
    .then(r => r.json())
    .then(function (data) {
      const state = RLCharts.stateFromSnapshot(data, page.config, page.knobs);
      RLCharts.create(document.getElementById("charts"), state, { onPick: inspector ? inspector.open : null }).draw();
      if (!Object.keys(state.series).length && !Object.keys(state.hists).length)
        document.getElementById("no-metrics").hidden = false;
      document.body.setAttribute("data-charts-drawn", "1");
    });
})();
