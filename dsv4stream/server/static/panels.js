// The panel's pictures, drawn on canvases with the theme's colours:
// - Plot.draw: one answer's samples over time (x: seconds since the request started;
//   left y: tokens/s; right y: disk read MB/s; prefill shaded);
// - Experts.draw: the expert cache, one row per layer and one cell per slot that layer
//   holds, hot (among the last token's experts) first, then cold (kept from earlier).
"use strict";

const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

// A canvas sized to its box in device pixels; returns its 2D context in CSS pixels.
function fitCanvas(c) {
  const dpr = window.devicePixelRatio || 1;
  const w = Math.max(120, Math.round(c.clientWidth || 300));
  const h = Math.round(c.clientHeight || c.height);
  if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
    c.width = Math.round(w * dpr);
    c.height = Math.round(h * dpr);
  }
  const g = c.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  g.font = "10px system-ui, sans-serif";
  return { g, w, h };
}

// Round axis ticks: 0 .. a "nice" top at or above `max`.
function ticks(max, count = 4) {
  if (!(max > 0)) return [0, 1];
  const raw = max / count;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  const out = [];
  for (let v = 0; v <= max + step * 0.999; v += step) out.push(+v.toPrecision(6));
  return out;
}

const label = (v) => (v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1).replace(/\.0$/, "") : +v.toPrecision(2) + "");

const Plot = {
  // `samples`: [{t, phase, tok_s, read_mb_s, hit_rate}] of one answer
  draw(canvas, samples) {
    const { g, w, h } = fitCanvas(canvas);
    const L = 30, R = 30, T = 6, B = 16; // room for the tick labels
    const pw = w - L - R, ph = h - T - B;
    const tMax = Math.max(1, ...samples.map((s) => s.t));
    const xs = ticks(tMax, 5), ys = ticks(Math.max(0, ...samples.map((s) => s.tok_s)));
    const rs = ticks(Math.max(0, ...samples.map((s) => s.read_mb_s)));
    const X = (t) => L + (t / xs[xs.length - 1]) * pw;
    const Y = (v, top) => T + ph - (v / top) * ph;
    const prefillEnd = samples.filter((s) => s.phase === "prefill").reduce((m, s) => Math.max(m, s.t), 0);
    if (prefillEnd > 0) {
      g.fillStyle = css("--pre");
      g.fillRect(L, T, X(prefillEnd) - L, ph);
    }
    g.strokeStyle = css("--grid");
    g.fillStyle = css("--muted");
    g.lineWidth = 1;
    g.textAlign = "center";
    for (const t of xs) {
      g.beginPath();
      g.moveTo(X(t) + 0.5, T);
      g.lineTo(X(t) + 0.5, T + ph);
      g.stroke();
      g.fillText(label(t), X(t), h - 4);
    }
    const yTop = ys[ys.length - 1], rTop = rs[rs.length - 1];
    ys.forEach((v) => {
      g.beginPath();
      g.moveTo(L, Y(v, yTop) + 0.5);
      g.lineTo(L + pw, Y(v, yTop) + 0.5);
      g.stroke();
    });
    g.textAlign = "right";
    g.fillStyle = css("--tok");
    ys.forEach((v) => g.fillText(label(v), L - 3, Y(v, yTop) + 3));
    g.textAlign = "left";
    g.fillStyle = css("--read");
    rs.forEach((v) => g.fillText(label(v), L + pw + 3, Y(v, rTop) + 3));
    g.strokeStyle = css("--muted");
    g.strokeRect(L + 0.5, T + 0.5, pw, ph);
    const line = (color, key, top) => {
      g.strokeStyle = color;
      g.fillStyle = color;
      g.lineWidth = 1.5;
      g.beginPath();
      samples.forEach((s, i) => (i ? g.lineTo(X(s.t), Y(s[key], top)) : g.moveTo(X(s.t), Y(s[key], top))));
      g.stroke();
      if (samples.length < 60) samples.forEach((s) => g.fillRect(X(s.t) - 1.5, Y(s[key], top) - 1.5, 3, 3));
    };
    if (samples.length) {
      line(css("--read"), "read_mb_s", rTop);
      line(css("--tok"), "tok_s", yTop);
    } else {
      g.fillStyle = css("--muted");
      g.textAlign = "center";
      g.fillText("no answer yet", L + pw / 2, T + ph / 2);
    }
    canvas.dataset.points = String(samples.length);
    canvas.setAttribute(
      "aria-label",
      `tokens/s (left axis, up to ${label(yTop)}) and disk read MB/s (right axis, up to ${label(rTop)})` +
        ` over ${label(tMax)} s since the request started; ${samples.length} samples`
    );
  },
};

const Experts = {
  rows: [],
  // `data`: GET /v1/page/experts
  draw(canvas, data, caption) {
    const rowH = Math.max(3, Math.min(14, Math.floor(220 / Math.max(1, data.layers))));
    canvas.style.height = rowH * data.layers + 4 + "px";
    const { g, w } = fitCanvas(canvas);
    const rows = Array.from({ length: data.layers }, () => ({ hot: [], cold: [] }));
    data.resident.forEach(([layer, expert], rank) => {
      rows[layer][rank < data.per_token ? "hot" : "cold"].push(expert);
    });
    this.rows = rows;
    const widest = Math.max(1, ...rows.map((r) => r.hot.length + r.cold.length));
    const L = 24;
    const cw = (w - L - 4) / widest;
    const gap = cw >= 4 ? 1 : 0;
    g.fillStyle = css("--muted");
    g.textAlign = "right";
    const every = Math.ceil(12 / rowH);
    rows.forEach((r, layer) => {
      const y = 2 + layer * rowH;
      if (layer % every === 0) g.fillText(String(layer), L - 4, y + Math.min(rowH, 10));
      g.fillStyle = css("--empty");
      g.fillRect(L, y, w - L - 4, rowH - (rowH > 4 ? 1 : 0));
      [...r.hot.map(() => "--hot"), ...r.cold.map(() => "--cold")].forEach((color, i) => {
        g.fillStyle = css(color);
        g.fillRect(L + i * cw, y, Math.max(1, cw - gap), rowH - (rowH > 4 ? 1 : 0));
      });
      g.fillStyle = css("--muted");
    });
    const used = data.resident.length;
    const hot = rows.reduce((n, r) => n + r.hot.length, 0);
    caption.textContent =
      `${used} of ${data.slots} slots hold experts (${hot} hot, ${used - hot} cold) across ${data.layers} layers` +
      ` of ${data.experts} experts; the rows are layers 0-${data.layers - 1}, top to bottom.`;
    canvas.dataset.used = String(used);
    canvas.dataset.hot = String(hot);
    canvas.setAttribute("aria-label", caption.textContent);
    canvas.onmousemove = (e) => {
      const layer = Math.floor((e.offsetY - 2) / rowH);
      const r = rows[layer];
      canvas.title = r ? `layer ${layer}: ${r.hot.length} hot (${r.hot.join(", ") || "none"}), ${r.cold.length} cold` : "";
    };
  },
};
