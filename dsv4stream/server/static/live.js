// The panel's live side: polling /v1/stats (server state, banner, totals), the page info
// (/v1/page/info: model, reasoning efforts, sizes), the answer's plot and the expert cache
// picture (/v1/page/experts), the theme and the drawers. Shares app.js's state and helpers.
"use strict";
// ---- the panel -------------------------------------------------------------------------------------

function showPlot(node) {
  plotted = { node, samples: node ? node.samples || [] : [] };
  drawPlot();
}

function drawPlot() {
  Plot.draw($("plot-canvas"), plotted.samples);
}

let lastExperts = null;

async function pollExperts() {
  try {
    const r = await fetch("/v1/page/experts", { headers: headers() });
    if (!r.ok) return;
    lastExperts = await r.json();
    Experts.draw($("experts-canvas"), lastExperts, $("experts-text"));
  } catch (e) {
    /* the stats poll reports the server as offline */
  }
}

async function loadInfo() {
  try {
    const r = await fetch("/v1/page/info", { headers: headers() });
    if (!r.ok) return;
    info = await r.json();
    $("model").textContent = info.model;
    Files.setLimit(info.max_body_bytes);
    Files.setImages(info.images);
    $("attach").title = info.images ? "Attach a text file or an image (or drop / paste one)" : "Attach a text file (or drop / paste one)";
    effortControl();
    if (conv) loadSettings();
  } catch (e) {
    /* retried by the next poll */
  }
}

async function poll() {
  let status = "connected";
  try {
    const r = await fetch("/v1/stats", { headers: headers() });
    if (r.ok) showStats(await r.json());
    else if (r.status === 401) status = "needs the API key";
    else status = "stats: HTTP " + r.status;
    server.auth = r.status !== 401;
  } catch (e) {
    status = "offline";
    server.ready = false;
  }
  if (server.ready && (!info || !info.ready)) await loadInfo(); // before "connected": the settings need it
  $("status").textContent = status;
  banner(status);
  setBusy(!!active);
  if (active) pollExperts();
  setTimeout(poll, active ? 400 : 1000);
}

function banner(status) {
  let text = "";
  if (status === "offline") text = "The server does not answer: is `dsv4 serve` still running?";
  else if (status === "needs the API key") {
    text = "This server needs an API key: set it under API key in the panel.";
    $("key-box").open = true;
  }
  else if (server.phase === "loading") text = "The server is loading the model. Sending is possible once it is ready.";
  else if (active && active.queued) text = `The server is busy: ${active.queued} request(s) ahead of yours.`;
  else if (!active && server.queue > 0 && server.full) text = `The server is busy with ${server.queue} request(s); a message sent now waits its turn.`;
  else if (!active && server.queue > 0) text = `The server is answering ${server.queue} request(s); a message sent now joins them.`;
  $("banner").textContent = text;
  $("banner").hidden = !text;
}

function showStats(s) {
  $("model").textContent = s.model || "";
  server.phase = s.phase;
  server.ready = s.phase !== "loading";
  $("stat-phase").textContent = s.phase;
  if (s.phase === "loading") return;
  // requests in the server's hands: where /v1/stats says "running", "queue" counts only those waiting
  server.queue = "running" in s ? s.queue + (s.running ? 1 : 0) : s.queue;
  $("stat-queue").textContent = s.queue;
  const b = s.batch;
  server.full = !b || b.running >= b.max_batch;
  if (b) {
    const rates = b.requests.filter((r) => r.completion_tokens > 1).map((r) => `${fmt(r.decode_tokens_per_s)}`);
    $("stat-batch").textContent = `${b.running} of ${b.max_batch} running` + (rates.length ? ` (${rates.join(", ")} tok/s each)` : "")
      + (b.passes ? `; ${fmt(b.mean_rows, 2)} per pass` : "");
  }
  $("stat-served").textContent = s.requests_served;
  $("stat-prefill").textContent = `${fmt(s.prefill_tokens_per_s)} tok/s`;
  $("stat-decode").textContent = `${fmt(s.decode_tokens_per_s)} tok/s`;
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
}

// ---- theme and drawers --------------------------------------------------------------------------------

const dark = window.matchMedia("(prefers-color-scheme: dark)");

function applyTheme() {
  const choice = localStorage.getItem(THEME) || "system";
  $("theme").value = choice;
  document.documentElement.dataset.theme = choice === "system" ? (dark.matches ? "dark" : "light") : choice;
  drawPlot();
  if (lastExperts) Experts.draw($("experts-canvas"), lastExperts, $("experts-text"));
}

function toggleDrawer(id) {
  const open = !$(id).classList.contains("open");
  closeDrawers();
  $(id).classList.toggle("open", open);
  $("scrim").hidden = !open;
}

function closeDrawers() {
  for (const id of ["convs", "panel"]) $(id).classList.remove("open");
  $("scrim").hidden = true;
}
