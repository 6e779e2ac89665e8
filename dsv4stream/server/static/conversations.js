// The conversation list: show one, new, rename, delete with a
// second click, search, export and import as JSON, and the one-time import of the page's old
// single conversation. Shares app.js's state (`convs`, `conv`) and helpers.
"use strict";
// ---- conversations ----------------------------------------------------------------------------

function isEmpty(c) {
  return !c.nodes.root.children.length;
}

function show(c) {
  conv = c;
  editing = null;
  localStorage.setItem(CURRENT, c.id);
  loadSettings();
  renderAll();
  renderList();
  const last = Store.path(c).filter((n) => n.role === "assistant").pop();
  showPlot(last || null);
  closeDrawers();
}

function newConversation() {
  if (conv && isEmpty(conv) && !convs.has(conv.id)) return show(conv);
  const settings = conv ? { ...conv.settings, system: "" } : {};
  show(Store.create(settings));
}

let renaming = false; // a title being typed: the list is not redrawn under it

function renderList() {
  if (renaming) return;
  const q = $("conv-search").value;
  const list = [...convs.values()].filter((c) => Store.matches(c, q)).sort((a, b) => b.updated - a.updated);
  $("conv-list").replaceChildren(...list.map(listItem));
}

function listItem(c) {
  const li = make("li", c === conv ? "current" : "");
  li.dataset.id = c.id;
  const title = make("span", "title", c.title || "untitled");
  title.title = c.title || "untitled";
  li.append(title);
  li.addEventListener("click", (e) => {
    if (e.target === li || e.target === title) show(c);
  });
  li.append(
    button("✎", "rename", () => rename(li, c), "Rename"),
    button("×", "delete", (e) => del(e.currentTarget, c), "Delete (click twice)")
  );
  return li;
}

function rename(li, c) {
  const input = make("input");
  input.value = c.title;
  li.replaceChildren(input);
  renaming = true;
  input.focus();
  input.select();
  const done = (keep) => {
    if (!renaming) return;
    renaming = false;
    if (keep && input.value.trim()) {
      c.title = input.value.trim();
      save(c);
    } else renderList();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") done(true);
    if (e.key === "Escape") {
      e.stopPropagation();
      done(false);
    }
  });
  input.addEventListener("blur", () => done(true));
}

// The first click arms the button, a second one within 3 s deletes.
async function del(btn, c) {
  if (!btn.classList.contains("confirm")) {
    btn.classList.add("confirm");
    btn.textContent = "Delete?";
    setTimeout(() => btn.isConnected && (btn.classList.remove("confirm"), (btn.textContent = "×")), 3000);
    return;
  }
  if (active && active.conv === c) active.controller.abort();
  convs.delete(c.id);
  await (saving = saving.then(() => Store.remove(c.id)));
  if (c === conv) {
    const next = [...convs.values()].sort((a, b) => b.updated - a.updated)[0];
    show(next || Store.create(c.settings));
  } else renderList();
}

function exportAll() {
  const blob = new Blob([Store.exportJson([...convs.values()])], { type: "application/json" });
  const a = make("a");
  a.href = URL.createObjectURL(blob);
  a.download = `dsv4stream-conversations-${new Date().toISOString().slice(0, 10)}.json`;
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 10000);
  $("conv-message").textContent = `exported ${convs.size} conversation(s)`;
}

async function importFile(file) {
  try {
    const got = Store.parseImport(await file.text());
    for (const c of got) {
      if (convs.has(c.id)) c.id = Store.create().id; // never overwrite one kept here
      await save(c);
    }
    $("conv-message").textContent = `imported ${got.length} conversation(s) from ${file.name}`;
    if (got.length) show(got[0]);
  } catch (e) {
    $("conv-message").textContent = `${file.name}: ${e.message}`;
  }
}

// The one conversation of the page before conversations were kept: imported once.
async function migrateLegacy() {
  const raw = localStorage.getItem(LEGACY);
  if (!raw) return;
  try {
    const old = JSON.parse(raw);
    const c = Store.create(old.settings || {});
    let parent = "root";
    for (const m of old.messages || []) {
      if (m.pending || !["user", "assistant"].includes(m.role)) continue;
      parent = Store.add(c, parent, { role: m.role, content: m.content || "", reasoning: m.reasoning || "" }).id;
    }
    if (!isEmpty(c)) await save(c);
  } catch (e) {
    /* unreadable: nothing to keep */
  }
  localStorage.removeItem(LEGACY);
}
