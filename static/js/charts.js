// Draws every Plotly figure of the page (see research/charts.py): embedded in it as JSON
// (data-figure names the element that holds it), or fetched after it (data-figure-url).
// An element says "figure:drawn" once its figure is on it.
(function () {
  "use strict";
  function draw(el) {
    const source = document.getElementById(el.dataset.figure);
    if (!source || el.dataset.drawn) return;
    el.dataset.drawn = "1";
    plot(el, JSON.parse(source.textContent));
  }

  function fetchAndDraw(el) {
    if (el.dataset.drawn) return;
    el.dataset.drawn = "1";
    fetch(el.dataset.figureUrl, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (response) {
        if (!response.ok) throw new Error(response.status + " " + response.statusText);
        return response.json();
      })
      .then(function (figure) { plot(el, figure); })
      .catch(function (error) {
        el.textContent = "The chart could not be loaded (" + error.message + "); reload the page to try again.";
        el.classList.add("error");
      });
  }

  function plot(el, figure) {
    // With `responsive`, a window resize refits the figure to its element: an element
    // without a height of its own fell back to its CSS min-height while the figure kept
    // its own, and the chart spilled over the next card.
    if (figure.layout && figure.layout.height) el.style.height = figure.layout.height + "px";
    const drawn = Plotly.newPlot(el, figure.data, figure.layout, { responsive: true, displaylogo: false });
    // Figures whose points link somewhere carry the URL first in each point's customdata.
    if (el.dataset.links !== undefined) {
      el.on("plotly_click", function (click) {
        const point = click.points && click.points[0];
        const url = point && point.customdata && point.customdata[0];
        if (typeof url === "string" && url.charAt(0) === "/") window.location.href = url;
      });
    }
    drawn.then(function () { el.dispatchEvent(new CustomEvent("figure:drawn")); });
  }
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-figure]").forEach(draw);
    document.querySelectorAll("[data-figure-url]").forEach(fetchAndDraw);
  });
  // A fragment htmx swapped in (a part of the page asked for again) draws its own.
  document.addEventListener("htmx:afterSettle", function (event) {
    if (window.Plotly) event.target.querySelectorAll("[data-figure]").forEach(draw);
  });
})();
