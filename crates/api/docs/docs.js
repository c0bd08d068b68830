// Renders /openapi.json as a list of operations per tag. Text only: nothing from the document
// is parsed as HTML.
"use strict";

function el(name, text) {
  const e = document.createElement(name);
  if (text !== undefined) e.textContent = text;
  return e;
}

function render(doc) {
  document.getElementById("about").textContent =
    (doc.info.description || "") + " Version " + doc.info.version + ".";
  const byTag = new Map();
  for (const [path, item] of Object.entries(doc.paths)) {
    for (const method of ["get", "put", "post", "patch", "delete"]) {
      const op = item[method];
      if (!op) continue;
      const tag = (op.tags && op.tags[0]) || "other";
      if (!byTag.has(tag)) byTag.set(tag, []);
      byTag.get(tag).push({ method, path, op });
    }
  }
  const root = document.getElementById("ops");
  root.textContent = "";
  for (const t of doc.tags || []) {
    const ops = byTag.get(t.name);
    if (!ops) continue;
    root.append(el("h2", t.name));
    if (t.description) root.append(el("p", t.description));
    const list = el("ul");
    for (const { method, path, op } of ops) {
      const li = el("li");
      li.append(el("code", method.toUpperCase() + " " + path), " " + (op.summary || ""));
      const auth = (op.security || []).flatMap((s) => Object.keys(s));
      const codes = Object.keys(op.responses || {}).join(", ");
      li.append(el("div", (auth.length ? "auth: " + auth.join(", ") + "; " : "") + "answers: " + codes));
      list.append(li);
    }
    root.append(list);
  }
}

fetch("/openapi.json")
  .then((r) => r.json())
  .then(render)
  .catch((e) => {
    document.getElementById("ops").textContent = "Loading /openapi.json failed: " + e;
  });
