// Draws every Plotly figure embedded in the page as JSON (see research/charts.py).
(function () {
  "use strict";
  function draw(el) {
    const source = document.getElementById(el.dataset.figure);
    if (!source || el.dataset.drawn) return;
    const figure = JSON.parse(source.textContent);
    el.dataset.drawn = "1";
    // With `responsive`, a window resize refits the figure to its element: an element
    // without a height of its own fell back to its CSS min-height while the figure kept
    // its own, and the chart spilled over the next card.
    if (figure.layout && figure.layout.height) el.style.height = figure.layout.height + "px";
    Plotly.newPlot(el, figure.data, figure.layout, { responsive: true, displaylogo: false });
    // Figures whose points link somewhere carry the URL first in each point's customdata.
    if (el.dataset.links !== undefined) {
      el.on("plotly_click", function (click) {
        const point = click.points && click.points[0];
        const url = point && point.customdata && point.customdata[0];
        if (typeof url === "string" && url.charAt(0) === "/") window.location.href = url;
      });
    }
  }
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-figure]").forEach(draw);
  });
  // A fragment htmx swapped in (a part of the page asked for again) draws its own.
  document.addEventListener("htmx:afterSettle", function (event) {
    if (window.Plotly) event.target.querySelectorAll("[data-figure]").forEach(draw);
  });
})();
