// A small Markdown renderer that builds DOM nodes: text enters the page through
// createTextNode / textContent, so model output can never inject HTML or script. The one
// exception is a code block's highlighting: highlight.js (vendored, static/vendor/highlight)
// returns markup in which it has escaped every character of the code itself.
// Blocks: fenced code (a header with its language and a copy button), headings, lists,
// block quotes, paragraphs. Inline: `code`, **bold**, *italic*, [links](http...) (http and
// https only).
"use strict";

const Markdown = (() => {
  const el = (tag, cls) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    return e;
  };

  const INLINE = /(`[^`]+`)|(\*\*[^*]+\*\*)|(\*[^*\s][^*]*\*)|(\[[^\]]+\]\((https?:\/\/[^\s)]+)\))/;

  function inline(parent, text) {
    while (text) {
      const m = INLINE.exec(text);
      if (!m) {
        parent.appendChild(document.createTextNode(text));
        return;
      }
      if (m.index) parent.appendChild(document.createTextNode(text.slice(0, m.index)));
      const tok = m[0];
      if (m[1]) {
        const c = el("code");
        c.textContent = tok.slice(1, -1);
        parent.appendChild(c);
      } else if (m[2]) {
        const b = el("strong");
        inline(b, tok.slice(2, -2));
        parent.appendChild(b);
      } else if (m[3]) {
        const i = el("em");
        inline(i, tok.slice(1, -1));
        parent.appendChild(i);
      } else {
        const a = el("a");
        a.textContent = tok.slice(1, tok.indexOf("]("));
        a.setAttribute("href", m[5]);
        a.setAttribute("rel", "noopener noreferrer");
        a.setAttribute("target", "_blank");
        parent.appendChild(a);
      }
      text = text.slice(m.index + tok.length);
    }
  }

  // Longer blocks are not auto-detected: re-rendered at every streamed chunk, that would cost.
  const AUTO_LIMIT = 20000;

  function codeBlock(text, lang) {
    const box = el("div", "code");
    const head = el("div", "code-head");
    const name = el("span", "lang");
    const copy = el("button", "copy-code");
    copy.type = "button";
    copy.textContent = "Copy code";
    head.append(name, copy);
    const pre = el("pre");
    const code = el("code");
    pre.appendChild(code);
    box.append(head, pre);
    const hl = window.hljs;
    if (hl && lang && hl.getLanguage(lang)) {
      code.innerHTML = hl.highlight(text, { language: lang, ignoreIllegals: true }).value;
      code.dataset.lang = lang;
    } else if (hl && !lang && text.length <= AUTO_LIMIT && text.trim()) {
      const got = hl.highlightAuto(text);
      code.innerHTML = got.value;
      if (got.language) code.dataset.lang = got.language;
    } else {
      code.textContent = text;
      if (lang) code.dataset.lang = lang;
    }
    name.textContent = lang || code.dataset.lang || "text";
    code.classList.add("hljs");
    return box;
  }

  function render(text) {
    const root = document.createDocumentFragment();
    const lines = text.split("\n");
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      const fence = /^\s*```(.*)$/.exec(line);
      if (fence) {
        const body = [];
        i++;
        while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) body.push(lines[i++]);
        i++; // the closing fence (or the end of an unfinished block)
        root.appendChild(codeBlock(body.join("\n"), fence[1].trim().split(/\s+/)[0]));
        continue;
      }
      const h = /^(#{1,6})\s+(.*)$/.exec(line);
      if (h) {
        const e = el("h" + Math.min(h[1].length + 2, 6));
        inline(e, h[2]);
        root.appendChild(e);
        i++;
        continue;
      }
      if (/^\s*([-*+]|\d+[.)])\s+/.test(line)) {
        const ordered = /^\s*\d/.test(line);
        const list = el(ordered ? "ol" : "ul");
        while (i < lines.length && /^\s*([-*+]|\d+[.)])\s+/.test(lines[i])) {
          const li = el("li");
          inline(li, lines[i].replace(/^\s*([-*+]|\d+[.)])\s+/, ""));
          list.appendChild(li);
          i++;
        }
        root.appendChild(list);
        continue;
      }
      if (/^\s*>/.test(line)) {
        const q = el("blockquote");
        const body = [];
        while (i < lines.length && /^\s*>/.test(lines[i])) body.push(lines[i++].replace(/^\s*>\s?/, ""));
        q.appendChild(render(body.join("\n")));
        root.appendChild(q);
        continue;
      }
      if (!line.trim()) {
        i++;
        continue;
      }
      const p = el("p");
      const para = [lines[i++]]; // a line no block rule took is a paragraph's first line
      while (i < lines.length && lines[i].trim() && !/^\s*(```|#{1,6}\s|>|[-*+]\s|\d+[.)]\s)/.test(lines[i])) {
        para.push(lines[i++]);
      }
      para.forEach((t, k) => {
        if (k) p.appendChild(el("br"));
        inline(p, t);
      });
      root.appendChild(p);
    }
    return root;
  }

  return { render };
})();
