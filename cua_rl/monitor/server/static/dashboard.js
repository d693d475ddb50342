// cua-rl dashboard: charts (uPlot) and live refresh without a reload.
//
// Charts read their data from <script type="application/json" id="chart-data">. While the page
// is live (body[data-live="1"]) it polls its own URL with "X-Live: 1", swaps in each element
// marked data-live whose HTML changed, and hands the charts their new data.
(function () {
  "use strict";
  var COLOURS = ["#2f6fde", "#e37400", "#1e8e3e", "#a142f4", "#c5221f", "#12b5cb"];
  var charts = {};

  function readData(doc) {
    var el = doc.getElementById("chart-data");
    if (!el) return null;
    try { return JSON.parse(el.textContent); } catch (e) { return null; }
  }

  function seriesData(c) {
    return [c.x].concat(c.series.map(function (s) { return s[1]; }));
  }

  function drawChart(c) {
    var box = document.getElementById("chart-" + c.id);
    if (!box || typeof uPlot === "undefined") return;
    var plot = box.querySelector(".plot");
    var width = Math.max(plot.clientWidth || 400, 280);
    var opts = {
      width: width,
      height: 190,
      legend: { show: true },
      scales: { x: { time: false }, y: c.range ? { range: c.range } : {} },
      // Steps are whole numbers: no tick between two of them.
      axes: [{ label: "step", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000] }, {}],
      series: [{ label: "step" }].concat(c.series.map(function (s, i) {
        return {
          label: s[0],
          stroke: COLOURS[i % COLOURS.length],
          width: 2,
          dash: /std|baseline/.test(s[0]) ? [5, 4] : undefined,
          points: { show: true, size: 6 },
          spanGaps: true,
        };
      })),
    };
    plot.innerHTML = "";
    charts[c.id] = { plot: new uPlot(opts, seriesData(c), plot), n: c.series.length };
    box.setAttribute("data-points", String(c.x.length));
  }

  function updateCharts(list) {
    if (!list) return;
    list.forEach(function (c) {
      var have = charts[c.id];
      var box = document.getElementById("chart-" + c.id);
      if (have && have.n === c.series.length) {
        have.plot.setData(seriesData(c));
        if (box) box.setAttribute("data-points", String(c.x.length));
      } else {
        drawChart(c);
      }
    });
  }

  function swapLive(doc) {
    var changed = 0;
    doc.querySelectorAll("[data-live][id]").forEach(function (fresh) {
      var old = document.getElementById(fresh.id);
      if (old && old.innerHTML !== fresh.innerHTML) {
        old.innerHTML = fresh.innerHTML;
        changed++;
      }
    });
    return changed;
  }

  function poll() {
    var body = document.body;
    var every = parseInt(body.getAttribute("data-refresh-ms") || "3000", 10);
    fetch(window.location.pathname + window.location.search, {
      headers: { "X-Live": "1" },
      credentials: "same-origin",
      cache: "no-store",
    }).then(function (resp) {
      if (resp.status === 401) { body.setAttribute("data-live", "0"); return null; }
      return resp.ok ? resp.text() : null;
    }).then(function (text) {
      if (text) {
        var doc = new DOMParser().parseFromString(text, "text/html");
        swapLive(doc);
        updateCharts(readData(doc));
        var live = doc.body.getAttribute("data-live");
        body.setAttribute("data-live", live);
        body.setAttribute("data-refreshed", String(Date.now()));
      }
    }).catch(function () { /* the server may be restarting: try again later */ })
      .then(function () {
        if (body.getAttribute("data-live") === "1") window.setTimeout(poll, every);
      });
  }

  document.addEventListener("DOMContentLoaded", function () {
    var data = readData(document);
    if (data) data.forEach(drawChart);
    var body = document.body;
    if (body.getAttribute("data-live") === "1") {
      window.setTimeout(poll, parseInt(body.getAttribute("data-refresh-ms") || "3000", 10));
    }
    var resize;
    window.addEventListener("resize", function () {
      window.clearTimeout(resize);
      resize = window.setTimeout(function () {
        var d = readData(document);
        if (d) d.forEach(drawChart);
      }, 200);
    });
  });
})();
