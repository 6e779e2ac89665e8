// Images for the next message (V4.1 checkpoints with a vision tower; /v1/page/info says
// `images`): a file is read as a data: URI, accepted only when its first bytes are those of a
// PNG, JPEG, WebP or GIF (the name and the browser's type are not trusted), and sent as an
// OpenAI image_url part before the message's text. The data: URI is kept with the conversation
// (IndexedDB, store.js) as sent, so a later turn resends the same image and the server's
// prefix cache reuses its state; the thumbnail is that data URI shown small (CSS), set as an
// <img>'s src and never written into HTML. `safe` is the one gate every shown image passes.
"use strict";

const Images = (() => {
  const TYPES = { png: "image/png", jpeg: "image/jpeg", webp: "image/webp", gif: "image/gif" };
  const URI = /^data:image\/(png|jpeg|webp|gif);base64,[A-Za-z0-9+/]+={0,2}$/;

  // The image type of the first bytes, or null.
  function sniff(b) {
    const at = (i, s) => [...s].every((c, k) => b[i + k] === c.charCodeAt(0));
    if (b[0] === 0x89 && at(1, "PNG\r\n\x1a\n")) return "png";
    if (b[0] === 0xff && b[1] === 0xd8 && b[2] === 0xff) return "jpeg";
    if (at(0, "RIFF") && at(8, "WEBP")) return "webp";
    if (at(0, "GIF87a") || at(0, "GIF89a")) return "gif";
    return null;
  }

  function base64(bytes) {
    let s = "";
    for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
    return btoa(s);
  }

  // {name, image: data URI} of a file, or an Error saying why not.
  async function read(file, maxBytes) {
    if (file.size > maxBytes) return new Error(`${file.name}: ${(file.size / 1e6).toFixed(1)} MB is more than this server takes in one request`);
    const bytes = new Uint8Array(await file.arrayBuffer());
    const kind = sniff(bytes);
    if (!kind) return new Error(`${file.name || "the image"}: not a PNG, JPEG, WebP or GIF image`);
    return { name: file.name || `pasted.${kind}`, image: `data:${TYPES[kind]};base64,${base64(bytes)}` };
  }

  // The data URI when it is one of the four image types in base64, else "" (never shown).
  const safe = (uri) => (typeof uri === "string" && URI.test(uri) ? uri : "");

  // A thumbnail: an <img> whose src is the checked data URI.
  function thumb(f) {
    const img = document.createElement("img");
    img.className = "thumb";
    img.alt = f.name || "image";
    img.title = f.name || "image";
    img.src = safe(f.image);
    return img;
  }

  return { read, safe, thumb, sniff };
})();
