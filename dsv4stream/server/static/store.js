// Conversations, kept in this browser's IndexedDB (database "dsv4stream", store
// "conversations", one record per conversation) and nowhere else.
//
// A conversation is a tree of turns, so that an edited question or a regenerated answer
// keeps the versions it replaces: `nodes` maps an id to
//   { id, parent, role: "user" | "assistant", content, reasoning?, children: [ids], sel }
// where `sel` is the index of the child shown. The root is the node "root" (no role).
// The conversation shown is the path from the root following each `sel`. Settings (system
// prompt, thinking, effort, sampling) belong to the conversation. The export format is
// { format: "dsv4stream-conversations", version: 1, conversations: [...] }.
"use strict";

const Store = (() => {
  const DB = "dsv4stream";
  const TABLE = "conversations";
  const FORMAT = "dsv4stream-conversations";
  const DEFAULTS = { system: "", thinking: false, effort: "", temperature: "1", top_p: "1", max_tokens: "512", seed: "" };
  let db = null;

  function open() {
    return new Promise((resolve, reject) => {
      const req = indexedDB.open(DB, 1);
      req.onupgradeneeded = () => req.result.createObjectStore(TABLE, { keyPath: "id" });
      req.onsuccess = () => {
        db = req.result;
        resolve();
      };
      req.onerror = () => reject(req.error);
    });
  }

  function tx(mode, work) {
    return new Promise((resolve, reject) => {
      const t = db.transaction(TABLE, mode);
      const result = work(t.objectStore(TABLE));
      t.oncomplete = () => resolve(result && "result" in result ? result.result : undefined);
      t.onerror = () => reject(t.error);
      t.onabort = () => reject(t.error || new Error("the browser refused to store the conversation"));
    });
  }

  const all = () => tx("readonly", (s) => s.getAll());
  const put = (conv) => tx("readwrite", (s) => s.put(conv));
  const remove = (id) => tx("readwrite", (s) => s.delete(id));

  function newId() {
    return Date.now().toString(36) + "-" + Math.random().toString(36).slice(2, 10);
  }

  function create(settings) {
    const now = Date.now();
    return {
      id: newId(),
      title: "",
      created: now,
      updated: now,
      settings: { ...DEFAULTS, ...(settings || {}) },
      nodes: { root: { id: "root", parent: null, children: [], sel: 0 } },
    };
  }

  // ---- the tree ---------------------------------------------------------------------------

  function path(conv) {
    const out = [];
    let node = conv.nodes.root;
    while (node.children.length) {
      node = conv.nodes[node.children[Math.min(node.sel, node.children.length - 1)]];
      out.push(node);
    }
    return out;
  }

  function last(conv) {
    const p = path(conv);
    return p.length ? p[p.length - 1] : conv.nodes.root;
  }

  // A new child of `parentId`, shown in place of its siblings.
  function add(conv, parentId, fields) {
    const parent = conv.nodes[parentId];
    const node = { id: newId(), parent: parentId, children: [], sel: 0, content: "", ...fields };
    conv.nodes[node.id] = node;
    parent.children.push(node.id);
    parent.sel = parent.children.length - 1;
    conv.updated = Date.now();
    if (!conv.title && node.role === "user") conv.title = titleOf(node.content);
    return node;
  }

  // Versions of a turn are the children of its parent: [index shown, count].
  function versions(conv, node) {
    const parent = conv.nodes[node.parent];
    return [parent.children.indexOf(node.id), parent.children.length];
  }

  function choose(conv, node, step) {
    const parent = conv.nodes[node.parent];
    const [i, n] = versions(conv, node);
    parent.sel = Math.max(0, Math.min(n - 1, i + step));
  }

  function titleOf(text) {
    const line = (text || "").replace(/\s+/g, " ").trim();
    return line.length > 48 ? line.slice(0, 47) + "…" : line || "untitled";
  }

  function matches(conv, query) {
    const q = query.trim().toLowerCase();
    if (!q) return true;
    if ((conv.title || "").toLowerCase().includes(q)) return true;
    return Object.values(conv.nodes).some((n) => (n.content || "").toLowerCase().includes(q));
  }

  // ---- export / import --------------------------------------------------------------------

  function exportJson(convs) {
    return JSON.stringify({ format: FORMAT, version: 1, exported: new Date().toISOString(), conversations: convs }, null, 1);
  }

  // Conversations from an export; throws an Error that says what is wrong with the file.
  function parseImport(text) {
    let data;
    try {
      data = JSON.parse(text);
    } catch (e) {
      throw new Error("the file is not JSON (" + e.message + ")");
    }
    if (!data || data.format !== FORMAT || !Array.isArray(data.conversations)) {
      throw new Error('the file is not a dsv4stream export (no "format": "' + FORMAT + '" with conversations)');
    }
    return data.conversations.map((c, i) => checked(c, i));
  }

  function checked(c, i) {
    const where = "conversation " + (i + 1);
    if (!c || typeof c !== "object" || !c.nodes || !c.nodes.root) throw new Error(where + " has no turns");
    for (const [id, n] of Object.entries(c.nodes)) {
      if (!n || !Array.isArray(n.children) || n.id !== id) throw new Error(where + ": turn " + id + " is malformed");
      if (id !== "root" && (!c.nodes[n.parent] || !["user", "assistant"].includes(n.role))) {
        throw new Error(where + ": turn " + id + " has no parent or an unknown role");
      }
      for (const k of n.children) if (!c.nodes[k]) throw new Error(where + ": turn " + id + " names a missing reply");
      if (typeof n.content !== "string" && id !== "root") n.content = String(n.content || "");
      delete n.pending;
    }
    return {
      ...c,
      id: typeof c.id === "string" && c.id ? c.id : newId(),
      title: typeof c.title === "string" ? c.title : "",
      created: Number(c.created) || Date.now(),
      updated: Number(c.updated) || Date.now(),
      settings: { ...DEFAULTS, ...(c.settings || {}) },
    };
  }

  return { open, all, put, remove, create, path, last, add, versions, choose, titleOf, matches, exportJson, parseImport, DEFAULTS };
})();
