// The Mercurio web console: reads the admin API of the listener that serves it
// (docs/console.md). Credentials stay in this page's memory; nothing is fetched elsewhere.
"use strict";

(function () {
  const params = new URLSearchParams(location.search);
  // Seconds between samples of /api/v1/stats (?interval=N, 0.2 to 60; default 2).
  const interval = Math.min(60, Math.max(0.2, Number(params.get("interval")) || 2));
  const HOUR = 3600;
  const maxSamples = Math.ceil(HOUR / interval) + 1;

  // The page's state, readable from outside (the browser test reads the graphs' data here).
  const state = {
    auth: null,
    who: "",
    view: "overview",
    status: null,
    samples: [], // {t: seconds, s: the /api/v1/stats answer}
    series: { connections: [], received: [], sent: [], queuedBytes: [], storageBytes: [], dropped: [] },
    clients: [],
    sort: { key: "client_id", desc: false },
    timer: null,
    // The message viewer: the MQTT credentials (a Basic login's), the socket, what it saw.
    mqtt: null,
    watch: { socket: null, state: "", messages: [], topics: {}, topicCount: 0 },
  };
  window.mercurioConsole = state;

  const $ = (id) => document.getElementById(id);

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v);
    }
    for (const c of children) e.append(c instanceof Node ? c : String(c));
    return e;
  }

  function say(text) {
    $("message").textContent = text;
  }

  class AuthError extends Error {}

  async function api(method, path, body) {
    const init = { method, headers: { Authorization: state.auth }, cache: "no-store" };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const r = await fetch(path, init);
    let data = null;
    try {
      data = await r.json();
    } catch (e) {
      data = null;
    }
    if (r.status === 401 || r.status === 403) {
      throw new AuthError(r.status === 403 ? "This user is not an admin." : "Wrong user, password or token.");
    }
    if (!r.ok) {
      throw new Error((data && data.error) || `${method} ${path}: HTTP ${r.status}`);
    }
    return data;
  }

  // ---- login ----

  async function login(ev) {
    ev.preventDefault();
    const user = $("user").value, password = $("password").value, token = $("token").value.trim();
    if (token) {
      state.auth = "Bearer " + token;
      state.who = "token";
      state.mqtt = null;
    } else {
      // UTF-8, then base64 (btoa takes bytes as a binary string).
      const bytes = new TextEncoder().encode(user + ":" + password);
      state.auth = "Basic " + btoa(String.fromCharCode(...bytes));
      state.who = user;
      state.mqtt = { user, password };
    }
    $("login-error").textContent = "";
    try {
      state.status = await api("GET", "/api/v1/status");
    } catch (e) {
      state.auth = null;
      state.mqtt = null;
      $("login-error").textContent = e.message;
      return;
    }
    $("password").value = "";
    $("token").value = "";
    $("login").hidden = true;
    $("nav").hidden = false;
    $("logout").hidden = false;
    $("who").textContent = state.who === "token" ? "signed in with the token" : "signed in as " + state.who;
    show("overview");
    sample();
    state.timer = setInterval(sample, interval * 1000);
  }

  function logout(reason) {
    clearInterval(state.timer);
    state.timer = null;
    stopWatch();
    state.auth = null;
    state.mqtt = null;
    state.watch.messages = [];
    state.watch.topics = {};
    state.watch.topicCount = 0;
    $("messages-table").tBodies[0].replaceChildren();
    $("topic-tree").replaceChildren();
    state.status = null;
    state.samples = [];
    for (const k of Object.keys(state.series)) state.series[k] = [];
    state.clients = [];
    for (const v of document.querySelectorAll(".view")) v.hidden = true;
    $("clients-table").tBodies[0].replaceChildren();
    $("sessions-table").tBodies[0].replaceChildren();
    $("bridges-table").tBodies[0].replaceChildren();
    $("facts").replaceChildren();
    $("client-detail").hidden = true;
    $("nav").hidden = true;
    $("logout").hidden = true;
    $("who").textContent = "";
    $("login").hidden = false;
    $("login-error").textContent = typeof reason === "string" ? reason : "";
  }

  function failed(e) {
    if (e instanceof AuthError) logout(e.message);
    else say(e.message);
  }

  // ---- views ----

  function show(view) {
    state.view = view;
    for (const v of document.querySelectorAll(".view")) v.hidden = v.id !== view;
    for (const b of document.querySelectorAll("nav button")) b.classList.toggle("active", b.dataset.view === view);
    say("");
    if (view === "clients") loadClients();
    if (view === "sessions") loadSessions();
    if (view === "bridges") loadBridges();
    if (view === "overview") drawAll();
    if (view === "messages") renderMessages(true);
  }

  // ---- overview: samples and graphs ----

  async function sample() {
    if (!state.auth) return;
    let s, status;
    try {
      [s, status] = await Promise.all([api("GET", "/api/v1/stats"), api("GET", "/api/v1/status")]);
    } catch (e) {
      failed(e);
      return;
    }
    const t = performance.now() / 1000;
    const prev = state.samples[state.samples.length - 1];
    state.samples.push({ t, s });
    state.status = status;
    const push = (name, v) => {
      const a = state.series[name];
      a.push({ t, v });
      while (a.length && a[0].t < t - HOUR) a.shift();
    };
    const dropped = (x) => Object.values(x.dropped).reduce((a, b) => a + b, 0);
    push("connections", s.clients_connected);
    push("queuedBytes", s.queued_bytes);
    push("storageBytes", s.storage.pending_bytes);
    if (prev) {
      const dt = Math.max(0.001, t - prev.t);
      const rate = (now, before) => Math.max(0, (now - before) / dt);
      push("received", rate(s.messages_received, prev.s.messages_received));
      push("sent", rate(s.messages_sent, prev.s.messages_sent));
      push("dropped", rate(dropped(s), dropped(prev.s)));
    }
    while (state.samples.length > maxSamples) state.samples.shift();
    facts(s, status);
    if (state.view === "overview") drawAll();
  }

  function duration(secs) {
    const d = Math.floor(secs / 86400), h = Math.floor(secs / 3600) % 24, m = Math.floor(secs / 60) % 60;
    return d ? `${d} d ${h} h` : h ? `${h} h ${m} min` : `${m} min ${secs % 60} s`;
  }

  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : String(Math.round(n))) + " " + units[i];
  }

  function facts(s, status) {
    const storage = status.storage || {};
    const items = [
      ["Version", status.version],
      ["Uptime", duration(status.uptime_secs)],
      ["Clients", `${s.clients_connected} (max ${s.clients_maximum})`],
      ["Sessions", `${s.sessions} (${s.sessions_disconnected} offline)`],
      ["Subscriptions", s.subscriptions],
      ["Retained", s.retained_messages],
      ["Queued", `${s.queued_messages} msgs, ${bytes(s.queued_bytes)}`],
      [`Storage (${storage.backend})`, storage.state, s.storage.unwritable || String(storage.state).startsWith("degraded")],
      ["Role", status.role || "serving"],
      ["Bridges", `${s.bridges_connected} of ${s.bridges} connected`, s.bridges_connected < s.bridges],
      ["Log level", status.log_level],
    ];
    $("facts").replaceChildren(...items.map(([label, value, bad]) =>
      el("div", { class: bad ? "fact bad" : "fact" }, el("div", { class: "label" }, label), el("div", { class: "value" }, value))));
  }

  function drawAll() {
    const s = state.series;
    draw($("chart-connections"), [{ data: s.connections, color: "#2459c7", label: "connected" }], num, true);
    draw($("chart-messages"), [
      { data: s.received, color: "#2459c7", label: "in" },
      { data: s.sent, color: "#1f7a3f", label: "out" },
    ], perSecond);
    draw($("chart-queued"), [
      { data: s.queuedBytes, color: "#8a4fd0", label: "queued" },
      { data: s.storageBytes, color: "#c77c1e", label: "storage" },
    ], bytes, true);
    draw($("chart-dropped"), [{ data: s.dropped, color: "#c0362c", label: "dropped" }], perSecond);
    $("interval").textContent = String(interval);
  }

  function num(v) {
    return Number.isInteger(v) ? String(v) : v.toFixed(Math.abs(v) < 10 ? 2 : 0);
  }

  function perSecond(v) {
    return num(Math.abs(v) < 10 ? Math.round(v * 100) / 100 : Math.round(v)) + "/s";
  }

  // The top of a y axis and its step: 1, 2 or 5 times a power of ten, four steps at most
  // (whole steps for counts and bytes).
  function axis(max, whole) {
    if (!(max > 0)) return { top: whole ? 4 : 1, step: whole ? 1 : 0.25 };
    let step = Math.pow(10, Math.floor(Math.log10(max / 4)));
    for (const m of [1, 2, 5, 10]) {
      if (max / (step * m) <= 4) { step *= m; break; }
    }
    if (whole) step = Math.max(1, Math.round(step));
    return { top: Math.ceil(max / step) * step, step };
  }

  function ago(secs) {
    return secs >= 60 ? `-${Math.round(secs / 60)} min` : `-${Math.round(secs)} s`;
  }

  // A line chart: x from the first sample (at most an hour ago, at least a minute) to now,
  // y from 0 to a round value above the largest one.
  function draw(canvas, lines, fmt, whole) {
    const ratio = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height;
    canvas.width = Math.round(w * ratio);
    canvas.height = Math.round(h * ratio);
    const g = canvas.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, w, h);
    const left = 70, right = 8, top = 22, bottom = 20;
    const now = performance.now() / 1000;
    const first = state.samples.length ? state.samples[0].t : now;
    const span = Math.min(HOUR, Math.max(60, now - first));
    let max = 0;
    for (const l of lines) for (const p of l.data) max = Math.max(max, p.v);
    const { top: yTop, step } = axis(max, whole);
    const x = (t) => left + (w - left - right) * (1 - (now - t) / span);
    const y = (v) => top + (h - top - bottom) * (1 - v / yTop);
    g.font = "11px system-ui, sans-serif";
    g.strokeStyle = "#e4e7ec";
    g.fillStyle = "#667085";
    g.lineWidth = 1;
    for (let v = 0; v <= yTop + step / 2; v += step) {
      const yy = Math.round(y(v)) + 0.5;
      g.beginPath(); g.moveTo(left, yy); g.lineTo(w - right, yy); g.stroke();
      g.fillText(fmt(v), 4, yy + 4);
    }
    g.fillText(ago(span), left, h - 4);
    g.fillText(ago(span / 2), (left + w - right) / 2 - 18, h - 4);
    g.fillText("now", w - right - 22, h - 4);
    let lx = left + 4;
    for (const l of lines) {
      g.save();
      g.beginPath();
      g.rect(left, 0, w - left - right, h);
      g.clip();
      g.strokeStyle = l.color;
      g.lineWidth = 1.5;
      g.beginPath();
      l.data.forEach((p, i) => (i ? g.lineTo(x(p.t), y(p.v)) : g.moveTo(x(p.t), y(p.v))));
      g.stroke();
      if (l.data.length === 1) {
        g.fillStyle = l.color;
        g.fillRect(x(l.data[0].t) - 1.5, y(l.data[0].v) - 1.5, 3, 3);
      }
      g.restore();
      const last = l.data.length ? l.data[l.data.length - 1].v : 0;
      const text = `${l.label} ${fmt(last)}`;
      g.fillStyle = l.color;
      g.fillText(text, lx, 12);
      lx += g.measureText(text).width + 16;
    }
  }

  // ---- clients ----

  async function loadClients() {
    try {
      state.clients = (await api("GET", "/api/v1/clients")).clients;
    } catch (e) {
      failed(e);
      return;
    }
    renderClients();
  }

  function renderClients() {
    const filter = $("client-filter").value.toLowerCase();
    const connectedOnly = $("connected-only").checked;
    const { key, desc } = state.sort;
    const rows = state.clients
      .filter((c) => c.client_id.toLowerCase().includes(filter) && (!connectedOnly || c.connected))
      .sort((a, b) => {
        const x = a[key], y = b[key];
        const c = typeof x === "string" ? x.localeCompare(y) : Number(x) - Number(y);
        return desc ? -c : c;
      });
    for (const th of $("clients-table").tHead.rows[0].cells) {
      th.classList.toggle("sorted", th.dataset.key === key);
      th.classList.toggle("desc", th.dataset.key === key && desc);
    }
    $("clients-count").textContent = `${rows.length} of ${state.clients.length}`;
    $("clients-table").tBodies[0].replaceChildren(...rows.map((c) => {
      const actions = el("td", {},
        el("button", { type: "button", class: "show", onclick: () => showClient(c.client_id) }, "Show"), " ");
      if (c.connected) actions.append(confirmButton("Disconnect", () => disconnect(c.client_id)));
      const tr = el("tr", { "data-client": c.client_id },
        el("td", {}, c.client_id),
        el("td", {}, el("span", { class: c.connected ? "yes" : "no" }, c.connected ? "yes" : "no")),
        el("td", { class: "num" }, { 3: "3.1", 4: "3.1.1", 5: "5.0" }[c.protocol_level] || c.protocol_level),
        el("td", { class: "num" }, c.subscriptions),
        el("td", { class: "num" }, c.queued),
        el("td", { class: "num" }, c.inflight),
        actions);
      return tr;
    }));
  }

  // A button that asks for a second click before acting.
  function confirmButton(label, action) {
    const b = el("button", { type: "button", class: "danger" }, label);
    b.addEventListener("click", () => {
      if (!b.classList.contains("confirm")) {
        b.classList.add("confirm");
        b.textContent = "Confirm " + label.toLowerCase();
        setTimeout(() => { b.classList.remove("confirm"); b.textContent = label; }, 5000);
        return;
      }
      b.disabled = true;
      action();
    });
    return b;
  }

  async function showClient(id) {
    try {
      const d = await api("GET", "/api/v1/clients/" + encodeURIComponent(id));
      const box = $("client-detail");
      box.replaceChildren(el("h3", {}, id), el("pre", {}, JSON.stringify(d, null, 2)));
      box.hidden = false;
    } catch (e) {
      failed(e);
    }
  }

  async function disconnect(id) {
    try {
      await api("POST", "/api/v1/clients/" + encodeURIComponent(id) + "/disconnect");
      say(`Disconnected ${id}.`);
    } catch (e) {
      failed(e);
    }
    loadClients();
  }

  // ---- sessions ----

  async function loadSessions() {
    let clients;
    try {
      clients = (await api("GET", "/api/v1/clients")).clients.filter((c) => !c.connected);
    } catch (e) {
      failed(e);
      return;
    }
    $("sessions-table").tBodies[0].replaceChildren(...clients.map((c) => el("tr", {},
      el("td", {}, c.client_id),
      el("td", { class: "num" }, { 3: "3.1", 4: "3.1.1", 5: "5.0" }[c.protocol_level] || c.protocol_level),
      el("td", { class: "num" }, c.subscriptions),
      el("td", { class: "num" }, c.queued),
      el("td", {}, confirmButton("Delete", () => deleteSession(c.client_id))))));
    if (!clients.length) say("No session is kept for a disconnected client.");
  }

  async function deleteSession(id) {
    try {
      await api("DELETE", "/api/v1/sessions/" + encodeURIComponent(id));
      say(`Deleted the session of ${id}.`);
    } catch (e) {
      failed(e);
    }
    loadSessions();
  }

  // ---- bridges ----

  async function loadBridges() {
    let bridges;
    try {
      bridges = (await api("GET", "/api/v1/bridges")).bridges;
    } catch (e) {
      failed(e);
      return;
    }
    $("bridges-table").tBodies[0].replaceChildren(...bridges.map((b) => el("tr", {},
      el("td", {}, b.name),
      el("td", {}, el("span", { class: b.connected ? "yes" : "no" }, b.connected ? "yes" : "no")),
      el("td", {}, b.address || (b.addresses || []).join(", ")),
      el("td", { class: "num" }, b.forwarded_out),
      el("td", { class: "num" }, b.forwarded_in),
      el("td", { class: "num" }, b.queued),
      el("td", { class: "num" }, b.dropped),
      el("td", { class: "num" }, b.reconnects),
      el("td", {}, b.last_error || ""))));
    if (!bridges.length) say("No bridge is configured.");
  }

  // ---- messages: a small MQTT 3.1.1 client over WebSocket ----

  const MAX_MESSAGES = 200, MAX_TOPICS = 2000, MAX_SHOWN_PAYLOAD = 300;

  function mqttString(text) {
    const b = new TextEncoder().encode(text);
    return [b.length >> 8, b.length & 255, ...b];
  }

  function mqttPacket(first, body) {
    const len = [];
    let n = body.length;
    do {
      let byte = n % 128;
      n = Math.floor(n / 128);
      if (n > 0) byte |= 128;
      len.push(byte);
    } while (n > 0);
    return new Uint8Array([first, ...len, ...body]);
  }

  function setWatch(text) {
    state.watch.state = text;
    $("watch-state").textContent = text;
  }

  function startWatch() {
    stopWatch();
    if (!state.mqtt) {
      setWatch("Log in with a user name to watch messages (the token is no MQTT user).");
      return;
    }
    const filter = $("watch-filter").value.trim() || "#";
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const socket = new WebSocket(`${scheme}//${location.host}/`, "mqtt");
    socket.binaryType = "arraybuffer";
    state.watch.socket = socket;
    let buf = new Uint8Array(0), ping = null;
    setWatch("connecting...");
    socket.onopen = () => {
      const id = "console-" + Math.random().toString(36).slice(2, 10);
      const body = [...mqttString("MQTT"), 4, 0x80 | 0x40 | 0x02, 0, 60,
        ...mqttString(id), ...mqttString(state.mqtt.user), ...mqttString(state.mqtt.password)];
      socket.send(mqttPacket(0x10, body));
    };
    socket.onmessage = (ev) => {
      const more = new Uint8Array(ev.data), joined = new Uint8Array(buf.length + more.length);
      joined.set(buf);
      joined.set(more, buf.length);
      buf = joined;
      for (;;) {
        let len = 0, mul = 1, i = 1;
        for (; i < buf.length && i < 5; i++) {
          len += (buf[i] & 127) * mul;
          mul *= 128;
          if (!(buf[i] & 128)) break;
        }
        if (i >= buf.length || buf.length < i + 1 + len) break;
        const first = buf[0], body = buf.subarray(i + 1, i + 1 + len);
        buf = buf.slice(i + 1 + len);
        packet(first, body);
      }
    };
    function packet(first, body) {
      const type = first >> 4;
      if (type === 2) {
        if (body[1] !== 0) {
          setWatch(`refused by the broker (CONNACK ${body[1]})`);
          socket.close();
          return;
        }
        socket.send(mqttPacket(0x82, [0, 1, ...mqttString(filter), 0]));
        ping = setInterval(() => socket.readyState === 1 && socket.send(new Uint8Array([0xc0, 0])), 30000);
      } else if (type === 9) {
        setWatch(body[2] >= 0x80 ? `subscription to ${filter} refused (not authorized)` : `watching ${filter}`);
      } else if (type === 3) {
        const qos = (first >> 1) & 3, tlen = (body[0] << 8) | body[1];
        const topic = new TextDecoder().decode(body.subarray(2, 2 + tlen));
        const payload = body.subarray(2 + tlen + (qos ? 2 : 0));
        received(topic, qos, (first & 1) === 1, payload);
      }
    }
    socket.onclose = () => {
      clearInterval(ping);
      if (state.watch.socket === socket) {
        state.watch.socket = null;
        if (!state.watch.state.startsWith("refused") && !state.watch.state.startsWith("subscription")) setWatch("stopped");
        $("watch-start").disabled = false;
        $("watch-stop").disabled = true;
      }
    };
    $("watch-start").disabled = true;
    $("watch-stop").disabled = false;
  }

  function stopWatch() {
    const socket = state.watch.socket;
    if (!socket) return;
    state.watch.socket = null;
    if (socket.readyState === 1) socket.send(new Uint8Array([0xe0, 0]));
    socket.close();
    setWatch("stopped");
    $("watch-start").disabled = false;
    $("watch-stop").disabled = true;
  }

  function received(topic, qos, retained, payload) {
    const w = state.watch;
    const text = new TextDecoder("utf-8", { fatal: false }).decode(payload.subarray(0, MAX_SHOWN_PAYLOAD));
    w.messages.unshift({ at: new Date(), topic, qos, retained, payload: text + (payload.length > MAX_SHOWN_PAYLOAD ? "..." : "") });
    w.messages.length = Math.min(w.messages.length, MAX_MESSAGES);
    // The topic tree: one node per level, with the messages seen under it.
    let node = w.topics, fresh = false;
    for (const level of topic.split("/")) {
      if (!node[level]) {
        if (w.topicCount >= MAX_TOPICS) break;
        node[level] = { count: 0, children: {} };
        w.topicCount++;
        fresh = true;
      }
      node[level].count++;
      node = node[level].children;
    }
    w.treeChanged = w.treeChanged || fresh;
    // Drawn at most four times a second, however fast messages come.
    if (state.view === "messages" && !w.renderTimer) {
      w.renderTimer = setTimeout(() => {
        w.renderTimer = null;
        const tree = w.treeChanged;
        w.treeChanged = false;
        if (state.view === "messages") renderMessages(tree);
      }, 250);
    }
  }

  function renderMessages(treeToo) {
    $("messages-table").tBodies[0].replaceChildren(...state.watch.messages.map((m) => el("tr", {},
      el("td", {}, m.at.toLocaleTimeString()),
      el("td", {}, m.topic),
      el("td", { class: "num" }, m.qos),
      el("td", {}, m.retained ? "yes" : ""),
      el("td", { class: "payload" }, m.payload))));
    if (treeToo !== false) {
      const tree = (nodes) => Object.keys(nodes).sort().map((k) => el("li", {},
        k === "" ? "(empty)" : k, el("span", { class: "count" }, nodes[k].count),
        ...(Object.keys(nodes[k].children).length ? [el("ul", { class: "tree" }, ...tree(nodes[k].children))] : [])));
      $("topic-tree").replaceChildren(...tree(state.watch.topics));
    }
  }

  // ---- wiring ----

  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", login);
    $("logout").addEventListener("click", () => logout(""));
    for (const b of document.querySelectorAll("nav button")) b.addEventListener("click", () => show(b.dataset.view));
    $("client-filter").addEventListener("input", renderClients);
    $("connected-only").addEventListener("change", renderClients);
    $("clients-refresh").addEventListener("click", loadClients);
    $("watch-start").addEventListener("click", startWatch);
    $("watch-stop").addEventListener("click", stopWatch);
    for (const th of $("clients-table").tHead.rows[0].cells) {
      if (!th.dataset.key) continue;
      th.addEventListener("click", () => {
        const key = th.dataset.key;
        state.sort = { key, desc: state.sort.key === key ? !state.sort.desc : false };
        renderClients();
      });
    }
    window.addEventListener("resize", () => state.view === "overview" && drawAll());
  });
})();
