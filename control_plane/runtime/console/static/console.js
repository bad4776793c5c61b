// meshfn console: live panels over server-sent events. The server renders every panel (HTML,
// escaped there); this script only swaps them in, says whether the view is live, and marks
// everything stale the moment the stream stops (a lost control plane never looks current).
"use strict";

(() => {
  const WATCHDOG_MS = 3000; // the server ticks every second
  const RETRY_MS = 1000;
  const banner = document.getElementById("connection");
  let source = null;
  let lastMessage = 0;
  let lastLive = null;
  let retryTimer = null;

  function sections() {
    return document.querySelectorAll("section.panel");
  }

  function setState(state, text) {
    banner.dataset.state = state;
    document.body.dataset.connection = state;
    if (banner.textContent !== text) banner.textContent = text;
  }

  function markStale() {
    for (const section of sections()) {
      section.classList.add("stale");
      section.querySelector(".panel-body").setAttribute("aria-busy", "true");
      section.querySelector(".stale-note").hidden = false;
    }
  }

  function markFresh(section) {
    section.classList.remove("stale");
    section.querySelector(".panel-body").removeAttribute("aria-busy");
    section.querySelector(".stale-note").hidden = true;
  }

  function clock(date) {
    return date.toLocaleTimeString([], { hour12: false });
  }

  function lost() {
    if (banner.dataset.state !== "lost") {
      const since = lastLive ? ` at ${clock(lastLive)}` : "";
      setState("lost", `Lost the connection to the control plane${since}; retrying. The panels show the last data received, not the current state.`);
    }
    markStale();
  }

  function onPanel(event) {
    lastMessage = Date.now();
    const update = JSON.parse(event.data);
    const body = document.getElementById(`panel-${update.id}`);
    if (!body) return;
    body.innerHTML = update.html; // rendered and escaped by the server
    markFresh(body.closest("section.panel"));
  }

  function onTick(event) {
    lastMessage = Date.now();
    const tick = JSON.parse(event.data);
    lastLive = new Date(tick.at * 1000);
    setState("live", `Live: configuration ${tick.generation}, updated ${clock(lastLive)}`);
  }

  function connect() {
    clearTimeout(retryTimer);
    if (source) source.close();
    lastMessage = Date.now();
    source = new EventSource(`/ui/events${window.location.search}`);
    source.addEventListener("panel", onPanel);
    source.addEventListener("tick", onTick);
    source.addEventListener("error", () => {
      lost();
      // EventSource retries by itself after a network error; a refused request (HTTP error)
      // closes it for good, so retry here, unless the refusal is a signed-out session (expired,
      // or signed out elsewhere): then show the login form instead of retrying for ever.
      if (source.readyState !== EventSource.CLOSED) return;
      fetch("/ui", { method: "HEAD", credentials: "same-origin", cache: "no-store" })
        .then((reply) => {
          if (reply.status === 401) window.location.reload();
          else retryTimer = setTimeout(connect, RETRY_MS);
        })
        .catch(() => { retryTimer = setTimeout(connect, RETRY_MS); });
    });
  }

  // A stream can also stall without an error (a stopped process holds the socket open).
  setInterval(() => {
    if (source && Date.now() - lastMessage > WATCHDOG_MS) {
      lost();
      connect();
    }
  }, 1000);

  // Moving to a panel from the navigation puts the keyboard focus on its heading.
  window.addEventListener("hashchange", () => {
    const heading = document.getElementById(`${window.location.hash.slice(1)}-title`);
    if (heading) heading.focus();
  });

  setState("connecting", "Connecting to live updates...");
  connect();
})();
