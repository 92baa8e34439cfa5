// htmx swaps no 429 (base.html's htmx-config): show the server's sentence ("Too many
// theses filed: … Try again in …") above the page, and leave the form as it was typed.
(function () {
  "use strict";
  document.addEventListener("htmx:responseError", function (event) {
    const xhr = event.detail.xhr;
    if (!xhr || xhr.status !== 429) return;
    const main = document.querySelector("main");
    let list = main.querySelector("ul.messages");
    if (!list) {
      list = document.createElement("ul");
      list.className = "messages";
      main.prepend(list);
    }
    const item = document.createElement("li");
    item.textContent = xhr.responseText;
    list.replaceChildren(item);
  });
})();
