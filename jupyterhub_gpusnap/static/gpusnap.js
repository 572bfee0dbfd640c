// gpusnap pages: local times, live countdowns, and the actions (REST API with the page's cookie + xsrf).
(function () {
  "use strict";
  const meta = (name) => (document.querySelector(`meta[name="${name}"]`) || {}).content || "";
  const prefix = meta("gpusnap-prefix");
  const xsrf = meta("gpusnap-xsrf");
  const message = document.getElementById("gpusnap-message");

  function say(text, isError) {
    message.textContent = text;
    message.className = isError ? "error" : "";
  }

  function clock(iso) {
    const t = new Date(iso);
    if (isNaN(t)) return null;
    const hm = t.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", hourCycle: "h23" });
    return t.toDateString() === new Date().toDateString() ? hm : `${t.toLocaleDateString([], { weekday: "short", day: "numeric", month: "short" })} ${hm}`;
  }

  function countdown(iso) {
    const s = Math.max(0, Math.round((Date.parse(iso) - Date.now()) / 1000));
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = String(s % 60).padStart(2, "0");
    return h ? `${h}:${String(m).padStart(2, "0")}:${sec}` : `${m}:${sec}`;
  }

  document.querySelectorAll("time[datetime]").forEach((el) => {
    const text = clock(el.getAttribute("datetime"));
    if (text) { el.title = el.textContent; el.textContent = text; }
  });
  function tick() {
    document.querySelectorAll("[data-countdown]").forEach((el) => { el.textContent = countdown(el.dataset.countdown); });
  }
  tick();
  setInterval(tick, 1000);

  function apiPath(key, action) {
    const [user, name] = [key.slice(0, key.indexOf("/")), key.slice(key.indexOf("/") + 1)];
    return `${prefix}api/servers/${encodeURIComponent(user)}${name ? "/" + encodeURIComponent(name) : ""}/${action}`;
  }

  async function act(key, action, body) {
    say(`${action} ${key}…`);
    const resp = await fetch(apiPath(key, action), {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-XSRFToken": xsrf },
      body: JSON.stringify(body || {}),
    });
    const data = await resp.json().catch(() => ({}));
    if (!resp.ok) {
      say(`Could not ${action} ${key}: ${data.message || resp.status}`, true);
      return;
    }
    say(`${key}: ${action} done.`);
    setTimeout(() => location.reload(), 600);
  }

  document.querySelectorAll("button[data-action]").forEach((btn) => {
    btn.addEventListener("click", () => {
      if (btn.dataset.confirm && !window.confirm(btn.dataset.confirm)) return;
      act(btn.dataset.server, btn.dataset.action, btn.dataset.body ? JSON.parse(btn.dataset.body) : {});
    });
  });
  document.querySelectorAll("form.keep-form").forEach((form) => {
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      act(form.dataset.server, "keep", { seconds: Number(form.elements.seconds.value) });
    });
  });
  // refresh the numbers every 30 s, unless the reader is using a control
  setInterval(() => {
    const a = document.activeElement;
    if (!a || a === document.body) location.reload();
  }, 30000);
})();
