// The chat page: talks to this server's own /v1/chat/completions (streaming) and
// /v1/stats. The conversation and the settings live in localStorage. Model text is
// rendered by Markdown.render, which only creates text nodes.
"use strict";

const STORE = "dsv4stream.chat.v1";
const $ = (id) => document.getElementById(id);
const SETTINGS = ["system", "thinking", "temperature", "top_p", "max_tokens", "seed", "api_key"];

let state = { messages: [], settings: {} };
let controller = null; // the request in flight, for the stop button
let busy = false;

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || "{}");
    state.messages = Array.isArray(saved.messages) ? saved.messages : [];
    state.settings = saved.settings || {};
  } catch (e) {
    state = { messages: [], settings: {} };
  }
  for (const k of SETTINGS) {
    const input = $(k);
    if (!(k in state.settings)) continue;
    if (input.type === "checkbox") input.checked = !!state.settings[k];
    else input.value = state.settings[k];
  }
}

function save() {
  for (const k of SETTINGS) {
    const input = $(k);
    state.settings[k] = input.type === "checkbox" ? input.checked : input.value;
  }
  localStorage.setItem(STORE, JSON.stringify(state));
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// ---- messages -------------------------------------------------------------------------------

function make(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text) e.textContent = text;
  return e;
}

function messageNode(m, index) {
  const box = make("div", "msg " + m.role);
  box.dataset.index = index;
  if (m.role === "assistant") {
    const reasoning = make("details", "reasoning");
    reasoning.append(make("summary", "", "Thinking"), make("div", "reasoning-text"));
    const copy = make("button", "copy", "Copy");
    copy.type = "button";
    copy.addEventListener("click", () => copyText(state.messages[index].content || "", copy));
    box.append(reasoning, make("div", "note"), make("div", "content"), copy);
  } else {
    box.append(make("div", "content"));
  }
  fill(box, m);
  return box;
}

function fill(box, m) {
  const body = box.querySelector(".content");
  body.replaceChildren(m.role === "assistant" ? Markdown.render(m.content || "") : document.createTextNode(m.content));
  if (m.role === "assistant") {
    const r = box.querySelector(".reasoning");
    r.hidden = !m.reasoning;
    r.querySelector(".reasoning-text").textContent = m.reasoning || "";
    box.querySelector(".note").textContent = m.note || "";
    box.classList.toggle("stopped", !!m.stopped);
  }
}

function renderAll() {
  const list = $("messages");
  list.replaceChildren(...state.messages.map(messageNode));
  list.scrollTop = list.scrollHeight;
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch (e) {
    const t = document.createElement("textarea");
    t.value = text;
    document.body.appendChild(t);
    t.select();
    document.execCommand("copy");
    t.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => (button.textContent = "Copy"), 1200);
}

// ---- one answer, streamed -------------------------------------------------------------------

function requestBody() {
  const s = state.settings;
  const history = state.messages.filter((m) => !m.pending).map((m) => ({ role: m.role, content: m.content || "" }));
  const body = {
    model: $("model").textContent,
    messages: (s.system ? [{ role: "system", content: s.system }] : []).concat(history),
    stream: true,
    stream_options: { include_usage: true },
    thinking: { type: s.thinking ? "enabled" : "disabled" },
    temperature: Number(s.temperature || 1),
    top_p: Number(s.top_p || 1),
    max_tokens: Math.max(1, parseInt(s.max_tokens || "512", 10)),
  };
  if (s.seed !== "" && s.seed !== undefined) body.seed = parseInt(s.seed, 10);
  return body;
}

async function send(text) {
  save();
  state.messages.push({ role: "user", content: text });
  const body = requestBody();
  const reply = { role: "assistant", content: "", reasoning: "", pending: true, note: "waiting…" };
  state.messages.push(reply);
  renderAll();
  const box = $("messages").lastElementChild;
  box.dataset.chunks = "0";
  setBusy(true);
  controller = new AbortController();
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || r.statusText);
    }
    await readStream(r.body, reply, box);
  } catch (e) {
    if (e.name === "AbortError") {
      reply.stopped = true;
      reply.note = "stopped";
    } else {
      reply.note = "error: " + e.message;
    }
  } finally {
    delete reply.pending;
    if (reply.note === "waiting…") reply.note = "";
    fill(box, reply);
    controller = null;
    setBusy(false);
    save();
  }
}

async function readStream(stream, reply, box) {
  const reader = stream.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) handleLine(line, reply, box);
    }
  }
}

function handleLine(line, reply, box) {
  if (line.startsWith(": prefill ")) {
    const [done, total] = line.slice(10).split("/").map(Number);
    reply.note = `reading the prompt: ${done} of ${total} tokens`;
    box.querySelector(".note").textContent = reply.note;
    return;
  }
  if (!line.startsWith("data: ") || line === "data: [DONE]") return;
  const chunk = JSON.parse(line.slice(6));
  if (chunk.error) throw new Error(chunk.error.message);
  const choice = chunk.choices && chunk.choices[0];
  if (!choice) {
    if (chunk.usage) reply.usage = chunk.usage;
    return;
  }
  const d = choice.delta || {};
  if (d.reasoning_content || d.content) {
    reply.reasoning += d.reasoning_content || "";
    reply.content += d.content || "";
    reply.note = "";
    box.dataset.chunks = String(Number(box.dataset.chunks) + 1);
    fill(box, reply);
    $("messages").scrollTop = $("messages").scrollHeight;
  }
  if (choice.finish_reason === "length") reply.note = "(stopped at max tokens)";
}

function setBusy(on) {
  busy = on;
  $("send").disabled = on;
  $("stop").disabled = !on;
}

// ---- live panel -----------------------------------------------------------------------------

const fmt = (x, d = 1) => (typeof x === "number" ? x.toFixed(d) : "–");

async function poll() {
  try {
    const r = await fetch("/v1/stats", { headers: headers() });
    if (r.ok) showStats(await r.json());
    $("status").textContent = r.ok ? "connected" : "stats: " + r.status;
  } catch (e) {
    $("status").textContent = "offline";
  }
  setTimeout(poll, busy ? 300 : 1000);
}

function showStats(s) {
  $("model").textContent = s.model || "";
  $("stat-phase").textContent = s.phase;
  if (s.phase === "loading") return;
  const last = s.last_request || {};
  $("stat-queue").textContent = s.queue;
  $("stat-served").textContent = s.requests_served;
  $("stat-prefill").textContent = `${fmt(s.prefill_tokens_per_s)} tok/s`;
  $("stat-decode").textContent = `${fmt(s.decode_tokens_per_s)} tok/s`;
  $("stat-ttft").textContent = last.time_to_first_token_s !== undefined ? `${fmt(last.time_to_first_token_s, 2)} s` : "–";
  $("stat-cached").textContent = last.prompt_tokens ? `${last.cached_tokens} of ${last.prompt_tokens}` : "–";
  $("stat-hit").textContent = `${fmt(100 * s.expert_hit_rate)}% of ${s.expert_requests}`;
  $("stat-read").textContent = `${fmt(s.gb_read, 3)} GB at ${fmt(s.read_gbps, 2)} GB/s`;
  $("stat-trunk").textContent = `${s.trunk.pinned_layers} pinned, ${s.trunk.streamed_layers} streamed`;
  $("stat-rss").textContent = `${fmt(s.peak_rss_gb, 2)} of ${fmt(s.budget_gb, 2)} GB`;
  const p = s.prefill;
  $("progress").hidden = !(p && s.phase === "prefill");
  if (p) {
    const frac = p.total ? p.done / p.total : 0;
    $("progress-fill").style.width = `${(100 * frac).toFixed(1)}%`;
    const layer = p.layer >= 0 ? `, layer ${p.layer + 1} of ${p.layers}` : "";
    $("progress-text").textContent = `prefill ${p.done} of ${p.total} tokens (${p.cached} cached)${layer}`;
  }
  drawChart(s.history || []);
}

function drawChart(history) {
  const c = $("chart");
  const g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  g.strokeStyle = "#8884";
  g.strokeRect(0.5, 0.5, c.width - 1, c.height - 1);
  const pts = history.slice(-200);
  if (pts.length < 2) return;
  const maxRead = Math.max(1e-6, ...pts.map((p) => p.read_gbps));
  const x = (i) => (i / (pts.length - 1)) * (c.width - 2) + 1;
  const line = (color, y) => {
    g.strokeStyle = color;
    g.beginPath();
    pts.forEach((p, i) => (i ? g.lineTo(x(i), y(p)) : g.moveTo(x(i), y(p))));
    g.stroke();
  };
  line("#2a7", (p) => c.height - 2 - p.hit_rate * (c.height - 4));
  line("#37d", (p) => c.height - 2 - (p.read_gbps / maxRead) * (c.height - 4));
  g.fillStyle = "#888";
  g.fillText(`${maxRead.toFixed(2)} GB/s`, 4, 12);
}

// ---- wiring ---------------------------------------------------------------------------------

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("input").value.trim();
  if (!text || busy) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => {
  state.messages = [];
  save();
  renderAll();
});
for (const k of SETTINGS) $(k).addEventListener("change", save);

load();
state.messages = state.messages.filter((m) => !m.pending);
renderAll();
poll();
