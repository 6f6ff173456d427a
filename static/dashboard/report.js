// The report page: every chart of the live page, drawn once from the run's rows (no socket).
(function () {
  "use strict";
  const page = JSON.parse(document.getElementById("report-page").textContent);
  fetch("/api/runs/" + page.id + "/metrics", { credentials: "same-origin" })
    .then(r => r.json())
    .then(function (data) {
      const state = RLCharts.stateFromSnapshot(data, page.config, page.knobs);
      RLCharts.create(document.getElementById("charts"), state).draw();
      if (!Object.keys(state.series).length && !Object.keys(state.hists).length)
        document.getElementById("no-metrics").hidden = false;
      document.body.setAttribute("data-charts-drawn", "1");
    });
})();
