// The chat page: conversations (store.js, conversations.js), answers (stream.js), files (files.js)
// and the panel (live.js, panels.js), wired to the DOM. It talks to this server only:
// /v1/chat/completions, /v1/stats, /v1/page/*. The API key stays in sessionStorage (this
// tab) unless "remember" puts it in localStorage; conversations live in IndexedDB; the
// theme choice and the open conversation's id in localStorage.
"use strict";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["system", "thinking", "effort", "temperature", "top_p", "max_tokens", "seed"];
const KEY = "dsv4stream.api_key";
const THEME = "dsv4stream.theme";
const CURRENT = "dsv4stream.current";
const LEGACY = "dsv4stream.chat.v1"; // the one-conversation page's localStorage record
const MAX_SAMPLES = 4000;

let convs = new Map(); // id -> conversation
let conv = null; // the one shown
let active = null; // the answer being generated: {conv, node, controller, got, progress, queued}
let info = null; // GET /v1/page/info
let server = { ready: false, queue: 0, phase: "connecting" };
let plotted = { samples: [], label: "" };
let editing = null; // id of the user turn being edited

// ---- small helpers ----------------------------------------------------------------------------

function make(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function button(text, cls, onClick, title) {
  const b = make("button", cls, text);
  b.type = "button";
  if (title) b.title = title;
  b.addEventListener("click", onClick);
  return b;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function copyText(text, btn) {
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
  const was = btn.textContent;
  btn.textContent = "Copied";
  setTimeout(() => (btn.textContent = was), 1200);
}

const fmt = (x, d = 1) => (typeof x === "number" && isFinite(x) ? x.toFixed(d) : "–");

// ---- saving -----------------------------------------------------------------------------------

let saving = Promise.resolve();
let saveTimer = null;

function save(c, soon = false) {
  if (soon) {
    if (!saveTimer) saveTimer = setTimeout(() => ((saveTimer = null), save(c)), 1000);
    return saving;
  }
  // a save now supersedes a pending one (only the streaming conversation has one): left to fire,
  // it would mark a finished answer's conversation newer than one started after it
  clearTimeout(saveTimer);
  saveTimer = null;
  c.updated = Date.now();
  convs.set(c.id, c);
  const copy = JSON.parse(JSON.stringify(c)); // a snapshot: the answer may still be growing
  saving = saving.then(() => Store.put(copy)).catch((e) => note(saveFailed(e), true));
  renderList();
  return saving;
}

// Images make conversations large: when the browser's storage is full the conversation stays
// in this tab (and is still sent whole) but is not kept across a reload.
function saveFailed(e) {
  if (e && (e.name === "QuotaExceededError" || /quota/i.test(e.message || ""))) {
    return "this browser's storage is full: the conversation is kept in this tab only; delete or export old conversations (images take the most room)";
  }
  return "could not save the conversation: " + (e && e.message);
}

function note(text, error = false) {
  const n = $("composer-note");
  n.textContent = text;
  n.classList.toggle("error", error);
}

// ---- settings of the conversation shown ---------------------------------------------------------

function effortControl() {
  const range = info && info.reasoning_effort;
  const old = $("effort");
  let ctl;
  if (range && range.kind === "range") {
    ctl = make("input");
    ctl.type = "number";
    ctl.min = range.min;
    ctl.max = range.max;
    ctl.step = 1;
    ctl.placeholder = `${range.min}-${range.max}, default ${range.default}`;
  } else {
    ctl = make("select");
    const values = range ? range.values : [];
    ctl.append(...values.map((v) => new Option(v === range.default ? `${v} (default)` : v, v)));
  }
  ctl.id = "effort";
  ctl.title = "Only in thinking mode: the checkpoint's own reasoning-effort levels";
  ctl.addEventListener("change", storeSettings);
  old.replaceWith(ctl);
}

function loadSettings() {
  const s = conv.settings;
  for (const k of SETTINGS) {
    const input = $(k);
    if (input.type === "checkbox") input.checked = !!s[k];
    else input.value = s[k] === undefined ? "" : s[k];
  }
  const effort = $("effort");
  if (effort.tagName === "SELECT" && !effort.value && info) effort.value = info.reasoning_effort.default;
}

function storeSettings() {
  for (const k of SETTINGS) {
    const input = $(k);
    conv.settings[k] = input.type === "checkbox" ? input.checked : input.value;
  }
  save(conv);
}

function loadKey() {
  const remembered = localStorage.getItem(KEY);
  $("api_key").value = sessionStorage.getItem(KEY) || remembered || "";
  $("remember_key").checked = remembered !== null;
  $("key-box").open = !!$("api_key").value;
}

function storeKey() {
  const key = $("api_key").value.trim();
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
  if ($("remember_key").checked && key) localStorage.setItem(KEY, key);
  else localStorage.removeItem(KEY);
}

// ---- messages -----------------------------------------------------------------------------------

function renderAll() {
  const list = $("messages");
  list.replaceChildren(...Store.path(conv).map(messageNode));
  list.scrollTop = list.scrollHeight;
}

function boxOf(node) {
  return $("messages").querySelector(`.msg[data-id="${node.id}"]`);
}

function messageNode(node) {
  const box = make("div", "msg " + node.role);
  box.dataset.id = node.id;
  if (node.role === "assistant") {
    const reasoning = make("details", "reasoning");
    reasoning.append(make("summary", "", "Thinking"), make("div", "reasoning-text"));
    const stats = make("div", "stats");
    stats.title = "Show this answer's plot";
    stats.addEventListener("click", () => showPlot(node));
    box.append(reasoning, make("div", "content"), make("div", "note"), stats, tools(node));
  } else {
    box.append(make("div", "files"), make("div", "content"), tools(node));
  }
  fill(box, node);
  return box;
}

function tools(node) {
  const bar = make("div", "tools");
  const [i, n] = Store.versions(conv, node);
  if (n > 1) {
    const v = make("span", "versions");
    v.append(
      button("‹", "prev", () => step(node, -1), "Previous version"),
      make("span", "count", `${i + 1}/${n}`),
      button("›", "next", () => step(node, 1), "Next version")
    );
    bar.append(v);
  }
  if (node.role === "user") bar.append(button("Edit", "edit", () => startEdit(node)));
  else {
    bar.append(button("Copy", "copy", (e) => copyText(node.content || "", e.currentTarget)));
    bar.append(button("Regenerate", "regenerate", () => regenerate(node)));
  }
  return bar;
}

function step(node, by) {
  Store.choose(conv, node, by);
  save(conv);
  renderAll();
}

function fill(box, node) {
  const body = box.querySelector(".content");
  if (node.role === "assistant") {
    body.replaceChildren(Markdown.render(node.content || ""));
    const r = box.querySelector(".reasoning");
    r.hidden = !node.reasoning;
    r.querySelector(".reasoning-text").textContent = node.reasoning || "";
    box.querySelector(".note").textContent = node.note || "";
    box.querySelector(".stats").textContent = statsLine(node.summary);
    if (node.summary) box.querySelector(".stats").dataset.reused = node.summary.cached_tokens;
    box.classList.toggle("stopped", !!node.stopped);
  } else {
    body.textContent = node.content;
    box.querySelector(".files").replaceChildren(
      ...(node.files || []).map((f) =>
        f.image ? Images.thumb(f) : make("span", "chip", `${f.name}${typeof f.tokens === "number" ? ` · ${f.tokens} tokens` : ""}`)
      )
    );
  }
}

function statsLine(s) {
  if (!s) return "";
  const parts = [
    `prompt ${s.prompt_tokens} tokens, ${s.cached_tokens} reused`,
    `prefill ${fmt(s.prefill_tokens_per_s)} tok/s`,
    `decode ${fmt(s.decode_tokens_per_s)} tok/s`,
    `first token ${fmt(s.time_to_first_token_s, 2)} s`,
    `expert hits ${s.expert_hit_rate === null ? "–" : fmt(100 * s.expert_hit_rate, 0) + "%"}`,
    `disk ${fmt(s.disk_mb, 1)} MB`,
  ];
  return parts.join(" · ");
}

function startEdit(node) {
  if (active) return;
  editing = node.id;
  const box = boxOf(node);
  const area = make("textarea", "edit");
  area.value = node.content;
  const row = make("div", "tools");
  row.append(
    button("Send", "save-edit", () => finishEdit(node, area.value)),
    button("Cancel", "cancel-edit", () => ((editing = null), renderAll()))
  );
  area.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      finishEdit(node, area.value);
    }
  });
  box.querySelector(".content").replaceWith(area);
  box.querySelector(".tools").replaceWith(row);
  area.focus();
}

function finishEdit(node, text) {
  editing = null;
  if (!text.trim() || active) return renderAll();
  const edited = Store.add(conv, node.parent, { role: "user", content: text, files: node.files });
  generate(conv, edited.id);
}

function regenerate(node) {
  if (active) return;
  generate(conv, node.parent);
}

// ---- one answer -----------------------------------------------------------------------------------

function requestBody(c, history) {
  const s = c.settings;
  const messages = history.map((n) => ({
    role: n.role,
    content: n.role === "user" ? Files.messageContent(n.files, n.content) : n.content || "",
  }));
  const body = {
    model: info ? info.model : $("model").textContent,
    messages: (s.system ? [{ role: "system", content: s.system }] : []).concat(messages),
    stream: true,
    stream_options: { include_usage: true },
    thinking: { type: s.thinking ? "enabled" : "disabled" },
    temperature: Number(s.temperature === "" ? 1 : s.temperature),
    top_p: Number(s.top_p || 1),
    max_tokens: Math.max(1, parseInt(s.max_tokens || "512", 10)),
  };
  if (s.thinking && s.effort !== "" && s.effort !== undefined) {
    body.reasoning_effort = info && info.reasoning_effort.kind === "range" ? Number(s.effort) : s.effort;
  }
  if (s.seed !== "" && s.seed !== undefined) body.seed = parseInt(s.seed, 10);
  return body;
}

async function send(text, files) {
  const parent = Store.last(conv);
  const user = Store.add(conv, parent.id, { role: "user", content: text, files });
  await generate(conv, user.id);
}

async function generate(c, parentId) {
  const node = Store.add(c, parentId, { role: "assistant", content: "", reasoning: "", note: "sending…", samples: [] });
  const history = Store.path(c).slice(0, -1);
  const a = { conv: c, node, controller: new AbortController(), got: 0, progress: null, queued: null };
  active = a;
  save(c);
  if (c === conv) renderAll();
  setBusy(true);
  showPlot(node);
  const redraw = () => c === conv && boxOf(node) && fill(boxOf(node), node);
  try {
    await Stream.chat(requestBody(c, history), headers(), a.controller.signal, {
      queued(n) {
        a.queued = n;
        node.note = n ? `waiting in the server's queue: ${n} request${n > 1 ? "s" : ""} ahead of this one` : "reading the prompt…";
        redraw();
        banner($("status").textContent);
      },
      progress(done, total) {
        a.progress = [done, total];
        node.note = `reading the prompt: ${done} of ${total} tokens`;
        redraw();
      },
      sample(s) {
        node.samples.push(s);
        if (node.samples.length > MAX_SAMPLES) node.samples.splice(0, node.samples.length - MAX_SAMPLES);
        if (plotted.node === node) drawPlot();
      },
      summary(s) {
        node.summary = s;
      },
      delta(reasoning, content) {
        node.reasoning += reasoning;
        node.content += content;
        a.got += 1;
        node.note = "";
        const list = $("messages");
        const atEnd = list.scrollHeight - list.scrollTop - list.clientHeight < 60;
        redraw();
        if (atEnd && c === conv) list.scrollTop = list.scrollHeight;
        const box = c === conv && boxOf(node);
        if (box) box.dataset.chunks = String(a.got);
        save(c, true);
      },
      finish(reason) {
        node.note = reason === "length" ? "stopped at the max tokens of this conversation's settings" : "";
      },
      usage() {},
    });
  } catch (e) {
    if (e.name === "AbortError") {
      node.stopped = true;
      if (a.got) node.note = `stopped by you after ${a.got} chunk${a.got > 1 ? "s" : ""} of text`;
      else if (a.progress) node.note = `stopped by you while the server read the prompt (${a.progress[0]} of ${a.progress[1]} tokens)`;
      else if (a.queued) node.note = "stopped by you while the request waited in the server's queue";
      else node.note = "stopped by you before the first token";
    } else {
      node.note = "error: " + e.message;
    }
  } finally {
    if (active === a) active = null;
    if (node.note === "sending…" || node.note === "reading the prompt…") node.note = "";
    redraw();
    setBusy(false);
    await save(c);
    if (plotted.node === node) drawPlot();
    pollExperts();
  }
}

function setBusy(on) {
  $("send").disabled = on || !server.ready;
  $("stop").disabled = !on;
}

// ---- the composer ------------------------------------------------------------------------------------

function renderFiles() {
  $("attachments").replaceChildren(
    ...Files.list.map((f, i) => {
      const chip = make("span", "chip");
      if (f.image) {
        chip.append(Images.thumb(f), make("span", "name", f.name), button("×", "remove", () => Files.remove(i), "Remove"));
        return chip;
      }
      const n = f.tokens === null ? "counting tokens…" : f.tokens === "?" ? "tokens: unknown" : `${f.tokens} tokens`;
      chip.append(make("span", "name", `${f.name} · ${n}`), button("×", "remove", () => Files.remove(i), "Remove"));
      chip.dataset.tokens = f.tokens === null ? "" : String(f.tokens);
      return chip;
    })
  );
}

async function addFiles(files) {
  const refused = await Files.add([...files]);
  note(refused.join("; "), refused.length > 0);
}

function submit() {
  const text = $("input").value.trim();
  if ((!text && !Files.list.length) || active || !server.ready) return;
  $("input").value = "";
  note("");
  send(text, Files.take());
}

function wire() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    submit();
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      submit();
    } else if (e.key === "ArrowUp" && !$("input").value) {
      const mine = Store.path(conv).filter((n) => n.role === "user").pop();
      if (mine) {
        e.preventDefault();
        startEdit(mine);
      }
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key !== "Escape") return;
    if (active) active.controller.abort();
    else if (editing) (editing = null), renderAll();
    closeDrawers();
  });
  $("stop").addEventListener("click", () => active && active.controller.abort());
  $("attach").addEventListener("click", () => $("attach-file").click());
  $("attach-file").addEventListener("change", async (e) => {
    await addFiles(e.target.files);
    e.target.value = "";
  });
  $("input").addEventListener("paste", (e) => {
    const files = e.clipboardData && e.clipboardData.files;
    if (files && files.length) {
      e.preventDefault();
      addFiles(files);
    }
  });
  const chat = $("chat");
  chat.addEventListener("dragover", (e) => {
    e.preventDefault();
    $("composer").classList.add("dragging");
  });
  chat.addEventListener("dragleave", () => $("composer").classList.remove("dragging"));
  chat.addEventListener("drop", (e) => {
    e.preventDefault();
    $("composer").classList.remove("dragging");
    if (e.dataTransfer && e.dataTransfer.files.length) addFiles(e.dataTransfer.files);
  });
  $("messages").addEventListener("click", (e) => {
    const b = e.target.closest(".copy-code");
    if (b) copyText(b.closest(".code").querySelector("code").textContent, b);
  });
  for (const k of SETTINGS) if (k !== "effort") $(k).addEventListener("change", storeSettings);
  $("api_key").addEventListener("change", storeKey);
  $("remember_key").addEventListener("change", storeKey);
  $("new-conv").addEventListener("click", newConversation);
  $("conv-search").addEventListener("input", renderList);
  $("export").addEventListener("click", exportAll);
  $("import").addEventListener("click", () => $("import-file").click());
  $("import-file").addEventListener("change", async (e) => {
    if (e.target.files[0]) await importFile(e.target.files[0]);
    e.target.value = "";
  });
  $("theme").addEventListener("change", () => {
    localStorage.setItem(THEME, $("theme").value);
    applyTheme();
  });
  dark.addEventListener("change", applyTheme);
  $("open-convs").addEventListener("click", () => toggleDrawer("convs"));
  $("open-panel").addEventListener("click", () => toggleDrawer("panel"));
  $("scrim").addEventListener("click", closeDrawers);
  window.addEventListener("resize", () => {
    drawPlot();
    if (lastExperts) Experts.draw($("experts-canvas"), lastExperts, $("experts-text"));
  });
  Files.setup({ onChange: renderFiles, headers });
}

async function start() {
  wire();
  applyTheme();
  loadKey();
  effortControl();
  try {
    await Store.open();
    await migrateLegacy();
    for (const c of await Store.all()) convs.set(c.id, c);
  } catch (e) {
    note("this browser does not keep conversations (IndexedDB: " + e.message + "); they last until a reload", true);
  }
  const sorted = [...convs.values()].sort((a, b) => b.updated - a.updated);
  show(convs.get(localStorage.getItem(CURRENT)) || sorted[0] || Store.create());
  poll();
  pollExperts();
}

start();
