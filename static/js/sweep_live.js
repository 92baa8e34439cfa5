// Follows a sweep over its websocket (CONTRACTS §6).
// On every (re)connect it sends the last seq it has applied and the server replays what
// came after; frames are applied strictly in seq order and never twice. The page itself
// was rendered at data-last-seq, so anything it already shows is skipped here too.
(function () {
  "use strict";
  const live = document.getElementById("live");
  if (!live) return;
  const connection = document.getElementById("connection");
  let lastSeq = Number(live.dataset.lastSeq || 0);
  let retries = 0;
  let plotted = null; // candidate numbers already on the chart

  function setConnection(state) {
    connection.textContent = state;
    connection.dataset.state = state;
  }

  function chart() {
    const el = document.getElementById("sweep-chart");
    return el && el.data ? el : null;
  }

  function plottedNumbers(el) {
    if (plotted === null) {
      plotted = new Set();
      el.data.forEach(function (trace) { (trace.x || []).forEach(function (n) { plotted.add(n); }); });
    }
    return plotted;
  }

  // Results that came before the chart's figure did: it is fetched after the page, and
  // may have been read before them. Added once it is drawn (a number it has is skipped).
  const waiting = [];
  const chartElement = document.getElementById("sweep-chart");
  if (chartElement) {
    chartElement.addEventListener("figure:drawn", function () {
      waiting.splice(0).forEach(extendChart);
    });
  }

  function extendChart(payload) {
    const el = chart();
    if (!el) {
      waiting.push(payload);
      return;
    }
    const seen = plottedNumbers(el);
    if (seen.has(payload.number)) return;
    const xs = [], ys = [], indices = [];
    payload.workloads.forEach(function (w, i) {
      if (w.speedup !== null && w.speedup !== undefined && i < el.data.length) {
        xs.push([payload.number]); ys.push([w.speedup]); indices.push(i);
      }
    });
    seen.add(payload.number);
    if (indices.length) {
      Plotly.extendTraces(el, { x: xs, y: ys }, indices);
      // The "no result yet" note of an empty chart (research/charts.py) has had its day.
      if ((el.layout.annotations || []).length) Plotly.relayout(el, { annotations: [] });
    }
  }

  function apply(frame) {
    const holder = document.createElement("template");
    holder.innerHTML = frame.html || "";
    if (frame.type === "candidate.result") {
      // A row the server already rendered into the page is not added again.
      if (document.getElementById("candidate-" + frame.payload.number)) {
        holder.content.querySelectorAll("template").forEach(function (t) { t.remove(); });
      }
      extendChart(frame.payload);
    }
    // This page's own pause, resume or cancel is still waiting for its answer, which
    // brings the controls itself: swapped in first, the frame's copy would take the place
    // of the controls the answer goes into, and the answer (a refusal's reason with it)
    // would land in controls no longer on the page.
    if (document.querySelector("#sweep-controls .htmx-request")) {
      holder.content.querySelectorAll("#sweep-controls").forEach(function (el) { el.remove(); });
    }
    if (holder.innerHTML.trim()) {
      htmx.swap(document.body, holder.innerHTML, { swapStyle: "none" });
    }
    // "No worker serves this queue" speaks of candidates that wait for one: once the
    // sweep is paused, cancelled or finished none does (the page, reloaded, drops it too).
    if (/^sweep\.(paused|cancelled|finished)$/.test(frame.type)) {
      const unserved = document.getElementById("no-worker");
      if (unserved) unserved.remove();
    }
    if (frame.type === "sweep.finished") {
      const activity = document.getElementById("sweep-activity");
      const reason = frame.payload.stop_reason;
      if (activity) activity.textContent = reason ? "Stopped: " + reason : "Sweep finished.";
    }
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(scheme + "://" + location.host + live.dataset.wsPath);
    socket.onopen = function () {
      retries = 0;
      setConnection("live");
      socket.send(JSON.stringify({ after: lastSeq }));
    };
    socket.onmessage = function (message) {
      const frame = JSON.parse(message.data);
      if (typeof frame.seq !== "number" || frame.seq <= lastSeq) return;
      if (frame.seq !== lastSeq + 1) {
        socket.close(); // out of order: reconnect and let the server replay from lastSeq
        return;
      }
      apply(frame);
      lastSeq = frame.seq;
      live.dataset.lastSeq = String(lastSeq);
    };
    socket.onclose = function () {
      setConnection("reconnecting");
      const delay = Math.min(10000, 250 * Math.pow(2, retries++));
      setTimeout(connect, delay);
    };
  }

  document.addEventListener("DOMContentLoaded", connect);
})();
