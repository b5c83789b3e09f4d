// "Copy" buttons on the cluster page: <button data-copy="ID" hidden> copies the text of
// the element with that id. Without this script the buttons stay hidden and the text is
// selected and copied by hand; nothing else depends on it.
"use strict";
(function () {
  function selectText(target) {
    var range = document.createRange();
    range.selectNodeContents(target);
    var selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
  }

  function copyBySelection(target) {
    selectText(target);
    try {
      return document.execCommand("copy");
    } catch (err) {
      return false;
    }
  }

  document.querySelectorAll("button[data-copy]").forEach(function (button) {
    var target = document.getElementById(button.getAttribute("data-copy"));
    if (!target) {
      return;
    }
    var label = button.textContent;
    var said = document.createElement("span");  // what a screen reader hears
    said.setAttribute("role", "status");
    said.className = "copied";
    button.after(said);
    button.hidden = false;

    function done(ok) {
      said.textContent = ok ? "Copied." : "Not copied: the text is selected, copy it by hand.";
      button.textContent = ok ? "Copied" : label;
      if (!ok) {
        selectText(target);
      }
      window.setTimeout(function () {
        button.textContent = label;
        said.textContent = "";
      }, 4000);
    }

    button.addEventListener("click", function () {
      var text = target.textContent;
      if (navigator.clipboard && window.isSecureContext) {
        navigator.clipboard.writeText(text).then(function () {
          done(true);
        }, function () {
          done(copyBySelection(target));
        });
      } else {
        done(copyBySelection(target));
      }
    });
  });
})();
