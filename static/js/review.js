// The review page's decision form answers refusals with the form and its reasons
// (403: not yours to decide, 409: the candidate or main moved on, 422: fix the input);
// htmx does not swap error responses by default, so let it for that form.
(function () {
  "use strict";
  document.addEventListener("htmx:beforeSwap", function (event) {
    const status = event.detail.xhr.status;
    const target = event.detail.target;
    if (target && target.id === "decision" && [403, 409, 422].indexOf(status) !== -1) {
      event.detail.shouldSwap = true;
      event.detail.isError = false;
    }
  });
})();
