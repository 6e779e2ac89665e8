// Files added to the next message (attach button, drop, paste): each is read in the
// browser. Text files: refused when not text, their token count asked from this server
// (POST /v1/page/tokens) before anything is sent; a message's text files go before its text,
// each as a fenced block under its name. Images (images.js): taken when the server's model
// reads them (V4.1 with a vision tower), refused otherwise; they go as image_url parts.
"use strict";

const Files = (() => {
  const list = []; // {name, text, tokens: number | null | "?"} or {name, image: data URI}
  let onChange = () => {};
  let headers = () => ({ "Content-Type": "application/json" });
  let maxBytes = 8e6;
  let images = false; // the server's model reads images

  function setup(opts) {
    onChange = opts.onChange;
    headers = opts.headers;
  }

  const setLimit = (n) => (maxBytes = n || maxBytes);
  const setImages = (on) => (images = !!on);

  function isImage(f) {
    return (f.type || "").startsWith("image/") || /\.(png|jpe?g|gif|webp|bmp|tiff?|heic|avif|svgz)$/i.test(f.name || "");
  }

  // Decoded as UTF-8; a NUL byte or a run of undecodable bytes means it is not text.
  function looksBinary(text) {
    if (text.includes("\u0000")) return true;
    const bad = (text.match(/\uFFFD/g) || []).length;
    return bad > 8 && bad > text.length / 200;
  }

  // Adds the files it can; returns the messages for the ones it refused.
  async function add(files) {
    const refused = [];
    for (const f of files) {
      if (isImage(f)) {
        if (!images) {
          refused.push(`${f.name}: images cannot be sent, this model reads text only (a DeepSeek-V4.1 checkpoint with a vision tower reads them)`);
          continue;
        }
        const got = await Images.read(f, (maxBytes * 3) / 4 - 4096); // base64 grows it by 4/3
        if (got instanceof Error) refused.push(got.message);
        else list.push(got), onChange();
        continue;
      }
      if (f.size > maxBytes / 2) {
        refused.push(`${f.name}: ${(f.size / 1e6).toFixed(1)} MB is more than this server takes in one request`);
        continue;
      }
      const text = await f.text();
      if (looksBinary(text)) {
        refused.push(`${f.name}: not a text file`);
        continue;
      }
      const item = { name: f.name || "pasted.txt", text, tokens: null };
      list.push(item);
      onChange();
      count(item);
    }
    return refused;
  }

  async function count(item) {
    try {
      const r = await fetch("/v1/page/tokens", { method: "POST", headers: headers(), body: JSON.stringify({ text: item.text }) });
      item.tokens = r.ok ? (await r.json()).tokens : "?";
    } catch (e) {
      item.tokens = "?";
    }
    onChange();
  }

  function remove(i) {
    list.splice(i, 1);
    onChange();
  }

  function take() {
    const out = list.map((f) => (f.image ? { name: f.name, image: f.image } : { name: f.name, text: f.text, tokens: f.tokens }));
    list.length = 0;
    onChange();
    return out;
  }

  // What the model reads for a user turn with files.
  function messageText(files, text) {
    const blocks = (files || []).filter((f) => !f.image).map((f) => {
      const runs = f.text.match(/`{3,}/g) || [];
      const fence = "`".repeat(Math.max(3, ...runs.map((r) => r.length + 1))); // longer than any inside
      return `${f.name}:\n${fence}\n${f.text.replace(/\n$/, "")}\n${fence}`;
    });
    return [...blocks, text].filter((s) => s).join("\n\n");
  }

  // A user turn's content: its text (with the text files), or with images the OpenAI parts,
  // the images first (as `dsv4 run --chat --image` puts them), each a checked data URI.
  function messageContent(files, text) {
    const shown = (files || []).filter((f) => f.image && Images.safe(f.image));
    const body = messageText(files, text);
    if (!shown.length) return body;
    const parts = shown.map((f) => ({ type: "image_url", image_url: { url: f.image } }));
    return body ? [...parts, { type: "text", text: body }] : parts;
  }

  return { setup, setLimit, setImages, add, remove, take, list, messageText, messageContent, isImage };
})();
