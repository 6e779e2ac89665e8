// One streamed answer from this server's /v1/chat/completions. Besides OpenAI's chunks the
// stream carries SSE comment lines that only this page reads (other clients skip them):
//   ": prefill DONE/TOTAL"             after each prefill segment
//   ': dsv4 {"queued": N}'             N requests ahead of this one (0: it is being served)
//   ': dsv4 {"sample": {...}}'         t, phase, tok_s, read_mb_s, hit_rate (per segment / token)
//   ': dsv4 {"summary": {...}}'        the answer's figures, just before the last chunk
"use strict";

const Stream = (() => {
  // `on`: { queued(n), progress(done, total), sample(s), summary(s), delta(reasoning, content), finish(reason), usage(u) }
  async function chat(body, headers, signal, on) {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers, body: JSON.stringify(body), signal });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      const msg = (err.error && err.error.message) || r.statusText || "HTTP " + r.status;
      throw new Error(r.status === 401 ? msg + " (set the API key in the panel)" : msg);
    }
    const reader = r.body.getReader();
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
        for (const line of event.split("\n")) handle(line, on);
      }
    }
  }

  function handle(line, on) {
    if (line.startsWith(": prefill ")) {
      const [done, total] = line.slice(10).split("/").map(Number);
      on.progress(done, total);
      return;
    }
    if (line.startsWith(": dsv4 ")) {
      const ev = JSON.parse(line.slice(7));
      if ("queued" in ev) on.queued(ev.queued);
      if (ev.sample) on.sample(ev.sample);
      if (ev.summary) on.summary(ev.summary);
      return;
    }
    if (!line.startsWith("data: ") || line === "data: [DONE]") return;
    const chunk = JSON.parse(line.slice(6));
    if (chunk.error) throw new Error(chunk.error.message);
    const choice = chunk.choices && chunk.choices[0];
    if (!choice) {
      if (chunk.usage) on.usage(chunk.usage);
      return;
    }
    const d = choice.delta || {};
    if (d.reasoning_content || d.content) on.delta(d.reasoning_content || "", d.content || "");
    if (choice.finish_reason) on.finish(choice.finish_reason);
  }

  return { chat };
})();
