"use strict";
// The Tophat console: chat through /v1/chat/completions (streamed), the mesh from /console/mesh and the plots
// from /console/history, polled once a second. The API key, when the mesh has one, is asked once and kept in
// sessionStorage (this tab only); every data call sends it.
(function () {
  const KEY = "tophat-api-key";
  const REFRESH_MS = 1000;
  const $ = (id) => document.getElementById(id);
  const state = { messages: [], requests: [], load: [], sinceRequests: 0, sinceLoad: 0, windowS: 600, verifier: null, busy: false };
  let timer = null;

  function headers(extra) {
    const key = sessionStorage.getItem(KEY);
    return Object.assign(key ? { Authorization: `Bearer ${key}` } : {}, extra || {});
  }

  async function getJson(path) {
    const response = await fetch(path, { headers: headers(), cache: "no-store" });
    if (response.status === 401) throw Object.assign(new Error("the API key was refused"), { auth: true });
    if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
    return response.json();
  }

  const dash = "—";
  const num = (v, digits) => (v === null || v === undefined ? dash : Number(v).toFixed(digits));
  const ago = (s) => (s === null || s === undefined ? dash : s < 1 ? "now" : `${Math.round(s)} s ago`);

  function cell(row, text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    row.appendChild(td);
  }

  function renderDevices(devices) {
    const body = $("devices").querySelector("tbody");
    body.replaceChildren();
    for (const d of devices) {
      const tr = document.createElement("tr");
      tr.dataset.device = d.device_id || d.url;
      cell(tr, d.device_id || d.url);
      cell(tr, d.speed_class || dash);
      cell(tr, d.mode || dash);
      cell(tr, num(d.rtt_ms, 1), "num");
      cell(tr, num(d.up_mbps, 1), "num");
      cell(tr, num(d.down_mbps, 1), "num");
      const sessions = d.sessions === null ? dash : `${d.sessions}${d.max_sessions !== null ? " / " + d.max_sessions : ""}`;
      cell(tr, sessions, "num");
      cell(tr, num(d.mean_accept_length, 2), "num");
      cell(tr, d.draft_shape ? `${d.draft_shape}${d.draft_shape_source ? " (" + d.draft_shape_source + ")" : ""}` : dash);
      cell(tr, d.ready ? "ready" : "not ready", d.ready ? "yes" : "no");
      cell(tr, ago(d.last_seen_s));
      if (d.last_error) tr.title = d.last_error;
      body.appendChild(tr);
    }
    $("device-count").textContent = `(${devices.length})`;
  }

  function renderVerifiers(verifiers) {
    const body = $("verifiers").querySelector("tbody");
    body.replaceChildren();
    if (!verifiers.length) {
      const tr = document.createElement("tr");
      cell(tr, "no verifier step reported to the state monitor yet");
      tr.firstChild.colSpan = 8;
      body.appendChild(tr);
    }
    for (const v of verifiers) {
      const tr = document.createElement("tr");
      tr.dataset.verifier = v.name;
      cell(tr, v.name);
      cell(tr, v.runs_on || dash);
      cell(tr, num(v.sessions, 0), "num");
      cell(tr, num(v.rows_per_step, 1), "num");
      cell(tr, num(v.step_ms, 2), "num");
      cell(tr, num(v.g_at_mu_ms, 2), "num");
      cell(tr, num(v.steps, 0), "num");
      cell(tr, ago(v.last_seen_s));
      body.appendChild(tr);
    }
    state.verifier = verifiers[0] || null;
  }

  function byDevice(points, field) {
    const groups = new Map();
    for (const p of points) {
      if (p[field] === null) continue;
      const name = p.device_id || "?";
      if (!groups.has(name)) groups.set(name, []);
      groups.get(name).push([p.t, p[field]]);
    }
    return [...groups].map(([name, pts]) => ({ name, points: pts }));
  }

  function shapeRank(shape) {
    if (shape === "none") return 0;
    if (shape === "chain") return 1;
    const nodes = /^tree(\d+)$/.exec(shape);
    return nodes ? 1 + Number(nodes[1]) : 1;
  }

  function renderPlots(now) {
    const ms = (points, field) => points.map((p) => Object.assign({}, p, { [field]: p[field] === null ? null : p[field] * 1e3 }));
    TophatPlot.draw($("plot-ttft"), byDevice(ms(state.requests, "ttft_s"), "ttft_s"), { time: now });
    TophatPlot.draw($("plot-tbt"), byDevice(ms(state.requests, "tbt_s"), "tbt_s"), { time: now });
    TophatPlot.draw($("plot-accept"), byDevice(state.requests, "accept_length"), { time: now });
    TophatPlot.draw($("plot-load"), [
      { name: "rows / step", points: state.load.map((p) => [p.t, p.rows_per_step]) },
      { name: "sessions", points: state.load.map((p) => [p.t, p.sessions]) },
    ], { time: now, step: true });
    const shapes = [...new Set(state.load.flatMap((p) => Object.values(p.shapes)))].sort((a, b) => shapeRank(a) - shapeRank(b));
    const devices = [...new Set(state.load.flatMap((p) => Object.keys(p.shapes)))].sort();
    TophatPlot.draw($("plot-shape"), devices.map((d) => ({
      name: d,
      points: state.load.filter((p) => d in p.shapes).map((p) => [p.t, shapes.indexOf(p.shapes[d])]),
    })), { time: now, step: true, yLabels: shapes.length ? shapes : ["—"] });
    const g = state.verifier ? state.verifier.g_points : [];
    TophatPlot.draw($("plot-g"), [{ name: "g(μ) ms", points: g }], {});
  }

  async function refresh() {
    if (state.refreshing) return;  // a slow answer is not piled on: the next tick asks again
    state.refreshing = true;
    try {
      const [mesh, history] = await Promise.all([getJson("/console/mesh"), getJson(`/console/history?since=${Math.min(state.sinceRequests, state.sinceLoad)}`)]);
      renderDevices(mesh.devices);
      renderVerifiers(mesh.verifiers);
      state.windowS = history.window_s;
      const fresh = (points, last) => points.filter((p) => p.t > last);  // each series has its own cursor
      const oldest = history.now - state.windowS;
      state.requests = state.requests.concat(fresh(history.requests, state.sinceRequests)).filter((p) => p.t > oldest);
      state.load = state.load.concat(fresh(history.load, state.sinceLoad)).filter((p) => p.t > oldest);
      state.sinceRequests = Math.max(state.sinceRequests, ...history.requests.map((p) => p.t));
      state.sinceLoad = Math.max(state.sinceLoad, ...history.load.map((p) => p.t));
      renderPlots(history.now);
      $("status").textContent = `live · state monitor: ${mesh.monitor} · ${new Date().toLocaleTimeString()}`;
      $("status").className = "muted";
    } catch (error) {
      if (error.auth) return askKey(sessionStorage.getItem(KEY) ? "That key was refused." : "");
      $("status").textContent = `not reachable: ${error.message}`;
      $("status").className = "error";
    } finally {
      state.refreshing = false;
    }
  }

  function start() {
    $("forget-key").hidden = !sessionStorage.getItem(KEY);
    if (!timer) timer = setInterval(refresh, REFRESH_MS);
    refresh();
  }

  function askKey(message) {
    clearInterval(timer);
    timer = null;
    $("key-error").textContent = message;
    $("key-error").hidden = !message;
    if (!$("key-dialog").open) $("key-dialog").showModal();
  }

  function addMessage(role, text) {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    const who = document.createElement("div");
    who.className = "who";
    who.textContent = role === "user" ? "you" : "tophat";
    const body = document.createElement("div");
    body.className = "text";
    body.textContent = text;
    const stats = document.createElement("div");
    stats.className = "stats";
    div.append(who, body, stats);
    $("messages").appendChild(div);
    $("messages").scrollTop = $("messages").scrollHeight;
    return { div, body, stats };
  }

  function describe(t) {
    const parts = [];
    if (t.ttft_s !== null && t.ttft_s !== undefined) parts.push(`TTFT ${(t.ttft_s * 1e3).toFixed(0)} ms`);
    if (t.tbt_s !== null && t.tbt_s !== undefined) parts.push(`TBT ${(t.tbt_s * 1e3).toFixed(1)} ms`);
    if (t.mean_accept_length !== null && t.mean_accept_length !== undefined) parts.push(`accept ${Number(t.mean_accept_length).toFixed(2)}`);
    const mode = t.device_stats && t.device_stats.mode;
    parts.push(`mode ${mode || dash}`);
    if (t.device_id) parts.push(`device ${t.device_id}`);
    if (t.completion_tokens !== undefined) parts.push(`${t.completion_tokens} tokens`);
    return parts.join(" · ");
  }

  async function send(text) {
    const mode = $("opt-mode").value;
    state.messages.push({ role: "user", content: text });
    addMessage("user", text);
    const answer = addMessage("assistant", "");
    answer.div.dataset.state = "streaming";
    const body = {
      model: "tophat", messages: state.messages, stream: true,
      temperature: Number($("opt-temperature").value), max_tokens: Number($("opt-max-tokens").value),
    };
    if (mode) body.tophat = { mode };
    let content = "";
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body),
      });
      if (!response.ok) {
        const error = await response.json().catch(() => ({}));
        if (response.status === 401) askKey("That key was refused.");
        throw new Error((error.error && error.error.message) || `HTTP ${response.status}`);
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
            const chunk = JSON.parse(line.slice(6));
            if (chunk.error) throw new Error(chunk.error.message);
            const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
            if (delta && delta.content) {
              content += delta.content;
              answer.body.textContent = content;
            }
            if (chunk.tophat) answer.stats.textContent = describe(chunk.tophat);
          }
        }
      }
      state.messages.push({ role: "assistant", content });
      answer.div.dataset.state = "done";
    } catch (error) {
      answer.stats.textContent = `error: ${error.message}`;
      answer.stats.className = "stats error";
      answer.div.dataset.state = "error";
      state.messages.pop();
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY, $("key-input").value.trim());
      $("key-input").value = "";
      $("key-dialog").close();
      start();
    });
    $("forget-key").addEventListener("click", () => { sessionStorage.removeItem(KEY); askKey(""); });
    $("chat-form").addEventListener("submit", async (event) => {
      event.preventDefault();
      const text = $("chat-input").value.trim();
      if (!text || state.busy) return;
      state.busy = true;
      $("chat-send").disabled = true;
      $("chat-input").value = "";
      await send(text);
      state.busy = false;
      $("chat-send").disabled = false;
    });
    $("chat-clear").addEventListener("click", () => { state.messages = []; $("messages").replaceChildren(); });
    start();
  });
})();
