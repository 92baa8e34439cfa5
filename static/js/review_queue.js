// Keeps the review queue's count in the navigation live, and the queue page's list too.
// The server only says how many wait (it asks the database each time it is told the
// queue changed); the list is fetched again as an htmx fragment with the page's filters.
(function () {
  "use strict";
  let retries = 0;
  let shown = null;

  function refreshList() {
    const list = document.getElementById("queue-list");
    if (!list || !window.htmx) return;
    htmx.ajax("GET", location.pathname + location.search, { target: "#queue-list", swap: "outerHTML" });
  }

  function connect(badge) {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(scheme + "://" + location.host + badge.dataset.wsPath);
    socket.onopen = function () { retries = 0; badge.dataset.state = "live"; };
    socket.onmessage = function (message) {
      const frame = JSON.parse(message.data);
      if (frame.type !== "queue.count") return;
      badge.textContent = String(frame.count);
      badge.dataset.count = String(frame.count);
      // The first frame only confirms what the page was rendered with, unless it differs.
      if (shown !== null || String(frame.count) !== badge.dataset.rendered) refreshList();
      shown = frame.count;
    };
    socket.onclose = function () {
      badge.dataset.state = "reconnecting";
      setTimeout(function () { connect(badge); }, Math.min(10000, 250 * Math.pow(2, retries++)));
    };
  }

  document.addEventListener("DOMContentLoaded", function () {
    const badge = document.getElementById("review-count");
    if (!badge) return;
    badge.dataset.rendered = badge.textContent.trim();
    connect(badge);
  });
})();
