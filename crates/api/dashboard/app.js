"use strict";
// The vmon dashboard: one page, routed by the URL fragment (#/sandboxes, #/sandbox/<id>, …),
// talking to the api's REST endpoints with the team key from sessionStorage in X-API-Key.
// Data from the api only ever reaches the DOM as text (textContent, text nodes, attributes
// set one by one); the key never goes into a URL.

(() => {
  const KEY = "vmon.apiKey";
  const EVENT_TYPES = [
    "sandbox.lifecycle.created",
    "sandbox.lifecycle.updated",
    "sandbox.lifecycle.paused",
    "sandbox.lifecycle.resumed",
    "sandbox.lifecycle.checkpointed",
    "sandbox.lifecycle.killed",
  ];
  const MAX_LOG_LINES = 5000;
  const MAX_SPARKLINES = 30;

  const $ = (id) => document.getElementById(id);

  // el("a", {href: "#/x", class: "c", text: "t", data: {k: "v"}}, child, "text", …)
  function el(tag, props, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = String(v);
      else if (k === "data") for (const [dk, dv] of Object.entries(v)) e.dataset[dk] = String(dv);
      else if (k === "onclick") e.addEventListener("click", v);
      else e.setAttribute(k, String(v));
    }
    for (const c of children) if (c !== null && c !== undefined) e.append(c);
    return e;
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
  }

  // ---- the api ----------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, code, message) {
      super(message);
      this.status = status;
      this.code = code;
    }
    describe() {
      return this.status ? `${this.code}: ${this.message}` : this.message;
    }
  }

  const key = () => sessionStorage.getItem(KEY);

  async function api(method, path, body, keyOverride) {
    const k = keyOverride || key();
    const headers = { Accept: "application/json" };
    if (k) headers["X-API-Key"] = k;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let resp;
    try {
      resp = await fetch(path, {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        cache: "no-store",
        credentials: "omit",
        redirect: "error",
      });
    } catch (e) {
      throw new ApiError(0, 0, `could not reach the vmon api (${e.message})`);
    }
    const text = await resp.text();
    let data = null;
    if (text) {
      try {
        data = JSON.parse(text);
      } catch (_) {
        data = text;
      }
    }
    if (!resp.ok) {
      const obj = data && typeof data === "object" ? data : {};
      const message =
        typeof obj.message === "string" && obj.message
          ? obj.message
          : typeof data === "string" && data
            ? data.slice(0, 300)
            : resp.statusText || "request failed";
      const code = typeof obj.code === "number" ? obj.code : resp.status;
      const err = new ApiError(resp.status, code, message);
      if (resp.status === 401 && !keyOverride && key()) {
        signOut(`The API key was rejected (${err.describe()}). Sign in again.`);
      }
      throw err;
    }
    return { data, headers: resp.headers };
  }

  const sbxPath = (id, rest) => `/sandboxes/${encodeURIComponent(id)}${rest || ""}`;

  // ---- errors and messages ----------------------------------------------------------------

  function showError(context, err) {
    const text = err instanceof ApiError ? err.describe() : String(err && err.message ? err.message : err);
    $("error-text").textContent = `${context}: ${text}`;
    $("error").hidden = false;
  }

  function hideError() {
    $("error").hidden = true;
    $("error-text").textContent = "";
  }

  function say(id, text, isError) {
    const p = $(id);
    p.textContent = text;
    p.classList.toggle("error-text", Boolean(isError));
  }

  // ---- formatting -------------------------------------------------------------------------

  function when(iso) {
    const t = Date.parse(iso);
    if (Number.isNaN(t)) return String(iso || "");
    return new Date(t).toLocaleString([], {
      month: "short",
      day: "numeric",
      hour: "2-digit",
      minute: "2-digit",
      second: "2-digit",
    });
  }

  function relative(iso) {
    const t = Date.parse(iso);
    if (Number.isNaN(t)) return "";
    const s = Math.round((t - Date.now()) / 1000);
    const a = Math.abs(s);
    const unit = a < 90 ? `${a}s` : a < 5400 ? `${Math.round(a / 60)}m` : `${Math.round(a / 3600)}h`;
    return s >= 0 ? `in ${unit}` : `${unit} ago`;
  }

  function bytes(n) {
    if (!Number.isFinite(n)) return "";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) {
      n /= 1024;
      i++;
    }
    return `${n >= 100 || i === 0 ? Math.round(n) : n.toFixed(1)} ${units[i]}`;
  }

  const pct = (v) => `${Math.round(v)}%`;

  function badge(state) {
    return el("span", { class: `badge state-${state}`, text: state });
  }

  // ---- polling that stops when the view changes ------------------------------------------

  let generation = 0;
  const timers = new Set();

  // Runs fn now and again every ms (or the ms it returns) until the view changes; fn gets a
  // function that says whether the view has changed since, to drop answers that came late.
  function every(ms, fn) {
    const gen = generation;
    const stale = () => gen !== generation;
    const tick = async () => {
      if (gen !== generation) return;
      let again = ms;
      if (!document.hidden) {
        try {
          const r = await fn(stale);
          if (typeof r === "number") again = r;
        } catch (e) {
          if (gen === generation && !(e instanceof ApiError && e.status === 401)) showError("Refreshing", e);
        }
      }
      if (gen !== generation) return;
      const t = setTimeout(() => {
        timers.delete(t);
        tick();
      }, again);
      timers.add(t);
    };
    tick();
  }

  function stopPolling() {
    generation++;
    timers.forEach(clearTimeout);
    timers.clear();
  }

  // ---- sign in / out ----------------------------------------------------------------------

  function signOut(message) {
    sessionStorage.removeItem(KEY);
    say("signin-message", message || "", Boolean(message));
    route();
  }

  $("signin").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const input = $("signin-key");
    const k = input.value.trim();
    if (!k) return;
    $("signin-submit").disabled = true;
    say("signin-message", "Checking the key…");
    try {
      await api("GET", "/v2/sandboxes?limit=1", undefined, k);
      sessionStorage.setItem(KEY, k);
      input.value = "";
      say("signin-message", "");
      hideError();
      if (!location.hash || location.hash === "#/" || location.hash === "#") location.hash = "#/sandboxes";
      else route();
    } catch (e) {
      say("signin-message", `Sign-in failed: ${e instanceof ApiError ? e.describe() : e}`, true);
    } finally {
      $("signin-submit").disabled = false;
    }
  });

  $("signout").addEventListener("click", () => signOut(""));
  $("error-close").addEventListener("click", hideError);

  // ---- routing ----------------------------------------------------------------------------

  function show(view) {
    document.querySelectorAll("main > .view").forEach((s) => {
      s.hidden = s.id !== `view-${view}`;
    });
    document.querySelectorAll("#nav a").forEach((a) => {
      a.classList.toggle("active", a.dataset.nav === view || (view === "sandbox" && a.dataset.nav === "sandboxes"));
    });
    document.body.dataset.view = view;
  }

  function route() {
    stopPolling();
    const signedIn = Boolean(key());
    $("nav").hidden = !signedIn;
    $("signout").hidden = !signedIn;
    if (!signedIn) {
      show("signin");
      $("signin-key").focus();
      return;
    }
    const parts = (location.hash || "#/sandboxes").replace(/^#\/?/, "").split("/");
    const [page, arg] = [parts[0] || "sandboxes", parts.slice(1).join("/")];
    let id = "";
    try {
      id = decodeURIComponent(arg);
    } catch (_) {
      // A malformed fragment: the list instead.
    }
    if (page === "sandbox" && id) sandboxPage(id);
    else if (page === "snapshots") snapshotsPage();
    else if (page === "webhooks") webhooksPage();
    else if (page === "keys") show("keys");
    else sandboxesPage();
  }

  window.addEventListener("hashchange", route);

  // ---- sandboxes list ---------------------------------------------------------------------

  const listRows = new Map(); // sandboxID -> {row, cpu, mem, cells}

  // "k=v, k2=v2" -> [[k, v], …]; throws on a part without "=".
  function parseMetadata(text) {
    return text
      .split(",")
      .map((p) => p.trim())
      .filter((p) => p)
      .map((p) => {
        const i = p.indexOf("=");
        if (i <= 0) throw new Error(`metadata filter "${p}" is not key=value`);
        return [p.slice(0, i).trim(), p.slice(i + 1).trim()];
      });
  }

  function listQuery() {
    const q = new URLSearchParams();
    q.set("state", $("filter-state").value);
    q.set("limit", "100");
    const template = $("filter-template").value.trim();
    if (template) q.set("template", template);
    const pairs = parseMetadata($("filter-metadata").value);
    if (pairs.length) {
      // What the SDKs send: each key and value quoted, the pairs url-encoded into one value.
      const enc = (s) => encodeURIComponent(encodeURIComponent(s));
      q.set("metadata", pairs.map(([k, v]) => `${enc(k)}=${enc(v)}`).join("&"));
    }
    return q.toString();
  }

  function listRow(s) {
    let r = listRows.get(s.sandboxID);
    if (!r) {
      const link = el("a", { href: `#/sandbox/${encodeURIComponent(s.sandboxID)}`, class: "mono" });
      const cpu = el("canvas", { class: "spark cpu", "data-points": "0", role: "img", "aria-label": "CPU" });
      const mem = el("canvas", { class: "spark mem", "data-points": "0", role: "img", "aria-label": "Memory" });
      const cells = {
        id: el("td", { "data-label": "Sandbox" }, link),
        template: el("td", { "data-label": "Template" }),
        state: el("td", { "data-label": "State" }),
        metadata: el("td", { "data-label": "Metadata" }),
        cpu: el("td", { "data-label": "CPU", class: "spark-cell" }, cpu, el("span", { class: "now" })),
        mem: el("td", { "data-label": "Memory", class: "spark-cell" }, mem, el("span", { class: "now" })),
        started: el("td", { "data-label": "Started" }),
        ends: el("td", { "data-label": "Ends" }),
      };
      const row = el("tr", { data: { sandboxId: s.sandboxID } }, ...Object.values(cells));
      link.textContent = s.sandboxID;
      r = { row, cpu, mem, cells };
      listRows.set(s.sandboxID, r);
    }
    r.row.dataset.state = s.state;
    r.cells.template.textContent = s.alias || s.templateID;
    clear(r.cells.state);
    r.cells.state.append(badge(s.state));
    clear(r.cells.metadata);
    for (const [k, v] of Object.entries(s.metadata || {})) {
      r.cells.metadata.append(el("span", { class: "chip", text: `${k}=${v}` }));
    }
    r.cells.started.textContent = when(s.startedAt);
    r.cells.started.title = s.startedAt;
    r.cells.ends.textContent = s.state === "paused" ? "paused" : relative(s.endAt);
    r.cells.ends.title = s.endAt;
    return r;
  }

  // The chart's window: the last `range` seconds, or the sandbox's life when it is shorter.
  function chartWindow(range, startedAt) {
    const end = Math.floor(Date.now() / 1000);
    const born = Math.floor(Date.parse(startedAt) / 1000);
    const start = Number.isFinite(born) && born > end - range ? born : end - range;
    return { start: Math.min(start, end - 60), end };
  }

  async function sparklines(r, s) {
    const id = s.sandboxID;
    const { start, end } = chartWindow(600, s.startedAt);
    const { data } = await api("GET", `${sbxPath(id, "/metrics")}?start=${start}&end=${end}`);
    if (!r.row.isConnected) return;
    const samples = Array.isArray(data) ? data : [];
    const cpu = samples.map((m) => ({ t: m.timestampUnix, v: m.cpuUsedPct }));
    const mem = samples.map((m) => ({ t: m.timestampUnix, v: m.memTotal ? (100 * m.memUsed) / m.memTotal : 0 }));
    VmonChart.draw(r.cpu, cpu, { min: 0, max: 100, start, end });
    VmonChart.draw(r.mem, mem, { min: 0, max: 100, start, end });
    const last = samples[samples.length - 1];
    r.cells.cpu.lastChild.textContent = last ? pct(last.cpuUsedPct) : "–";
    r.cells.mem.lastChild.textContent = last ? bytes(last.memUsed) : "–";
  }

  function sandboxesPage() {
    show("sandboxes");
    let query;
    try {
      query = listQuery();
    } catch (e) {
      showError("Filter", e);
      return;
    }
    every(5000, async (stale) => {
      const { data, headers } = await api("GET", `/v2/sandboxes?${query}`);
      if (stale()) return;
      const list = Array.isArray(data) ? data : [];
      const body = $("sandboxes-body");
      const seen = new Set();
      const rows = list.map((s) => {
        seen.add(s.sandboxID);
        return listRow(s);
      });
      for (const [id, r] of listRows) {
        if (!seen.has(id)) {
          r.row.remove();
          listRows.delete(id);
        }
      }
      rows.forEach((r) => body.append(r.row));
      $("sandboxes-empty").hidden = list.length > 0;
      const running = headers.get("x-total-running");
      $("sandboxes-count").textContent =
        `${list.length} shown` + (running !== null ? ` · ${running} running in the team` : "");
      await Promise.all(
        list.slice(0, MAX_SPARKLINES).map((s) =>
          sparklines(listRows.get(s.sandboxID), s).catch(() => {
            // A sandbox killed between the list and its metrics: the next list drops it.
          }),
        ),
      );
    });
  }

  $("filters").addEventListener("submit", (ev) => {
    ev.preventDefault();
    hideError();
    if (document.body.dataset.view === "sandboxes") route();
  });
  $("filter-state").addEventListener("change", () => route());

  // ---- one sandbox ------------------------------------------------------------------------

  let current = null; // {id, detail, log: {cursor, atCursor, lines}, events}

  function fact(dl, name, value) {
    dl.append(el("dt", { text: name }), el("dd", { text: value }));
  }

  function renderDetail(d) {
    current.detail = d;
    const state = d ? d.state : "killed";
    const b = $("sbx-state");
    b.className = `badge state-${state}`;
    b.textContent = state;
    document.body.dataset.sandboxState = state;
    const dl = $("sbx-facts");
    clear(dl);
    if (d) {
      fact(dl, "Template", d.alias ? `${d.alias} (${d.templateID})` : d.templateID);
      fact(dl, "Resources", `${d.cpuCount} vCPU · ${d.memoryMB} MiB RAM · ${d.diskSizeMB} MiB disk`);
      fact(dl, "Started", when(d.startedAt));
      fact(dl, "Ends", d.state === "paused" ? "paused" : `${when(d.endAt)} (${relative(d.endAt)})`);
      if (d.lifecycle) fact(dl, "On timeout", `${d.lifecycle.onTimeout}${d.lifecycle.autoResume ? ", auto-resume" : ""}`);
      fact(dl, "envd", d.envdVersion);
      const meta = Object.entries(d.metadata || {});
      if (meta.length) fact(dl, "Metadata", meta.map(([k, v]) => `${k}=${v}`).join(", "));
    } else {
      fact(dl, "Status", "killed or expired; its logs, metrics and events stay readable for 7 days");
    }
    const running = state === "running";
    const paused = state === "paused";
    $("act-pause").disabled = !running;
    $("act-resume").disabled = !paused;
    $("act-kill").disabled = !(running || paused);
    for (const f of ["form-timeout", "form-fork", "form-snapshot"]) {
      $(f).querySelector("button").disabled = !running;
    }
  }

  async function refreshDetail() {
    const c = current;
    try {
      const { data } = await api("GET", sbxPath(c.id));
      if (c === current) renderDetail(data);
    } catch (e) {
      if (e instanceof ApiError && e.status === 404) {
        if (c === current) renderDetail(null);
      }
      else throw e;
    }
  }

  async function refreshMetrics() {
    const c = current;
    // The window starts at the sandbox's start when that is later: wait for its detail once.
    if (!c.detail) await refreshDetail().catch(() => {});
    const range = Number($("metrics-range").value) || 900;
    const { start, end } = chartWindow(range, c.detail ? c.detail.startedAt : "");
    let samples = [];
    try {
      const { data } = await api("GET", `${sbxPath(c.id, "/metrics")}?start=${start}&end=${end}`);
      samples = Array.isArray(data) ? data : [];
    } catch (e) {
      if (!(e instanceof ApiError && e.status === 404)) throw e;
    }
    if (c !== current) return;
    const MiB = 1024 * 1024;
    const last = samples[samples.length - 1];
    VmonChart.draw(
      $("chart-cpu"),
      samples.map((m) => ({ t: m.timestampUnix, v: m.cpuUsedPct })),
      { axis: true, min: 0, max: 100, format: pct, start, end },
    );
    VmonChart.draw(
      $("chart-mem"),
      samples.map((m) => ({ t: m.timestampUnix, v: m.memUsed / MiB })),
      { axis: true, min: 0, max: last ? last.memTotal / MiB : null, format: (v) => bytes(v * MiB), start, end },
    );
    VmonChart.draw(
      $("chart-disk"),
      samples.map((m) => ({ t: m.timestampUnix, v: m.diskUsed / MiB })),
      { axis: true, min: 0, max: last ? last.diskTotal / MiB : null, format: (v) => bytes(v * MiB), start, end },
    );
    $("cpu-now").textContent = last ? `${pct(last.cpuUsedPct)} of ${last.cpuCount} vCPU` : "";
    $("mem-now").textContent = last ? `${bytes(last.memUsed)} of ${bytes(last.memTotal)}` : "";
    $("disk-now").textContent = last ? `${bytes(last.diskUsed)} of ${bytes(last.diskTotal)}` : "";
  }

  // Follows the console log: asks from the newest timestamp seen (inclusive) and skips the
  // entries at that instant it already shows.
  async function refreshLogs() {
    const c = current;
    const log = c.log;
    const q = new URLSearchParams({ limit: "1000" });
    if (log.cursor !== null) q.set("start", String(log.cursor));
    let data;
    try {
      ({ data } = await api("GET", `${sbxPath(c.id, "/logs")}?${q}`));
    } catch (e) {
      if (e instanceof ApiError && e.status === 404) return 10000;
      throw e;
    }
    if (c !== current) return undefined;
    const lines = (data && data.logs) || [];
    const entries = (data && data.logEntries) || [];
    const box = $("log");
    const stick = box.scrollTop + box.clientHeight >= box.scrollHeight - 8;
    const from = log.cursor;
    let skip = log.atCursor;
    let added = 0;
    lines.forEach((l, i) => {
      const t = Date.parse(l.timestamp);
      if (from !== null && t === from && skip > 0) {
        skip--;
        return;
      }
      if (t === log.cursor) log.atCursor++;
      else if (!Number.isNaN(t) && (log.cursor === null || t > log.cursor)) {
        log.cursor = t;
        log.atCursor = 1;
      }
      const level = entries[i] && typeof entries[i].level === "string" ? entries[i].level : "info";
      const time = Number.isNaN(t) ? "" : new Date(t).toLocaleTimeString([], { hour12: false });
      box.append(
        el("div", { class: `line level-${level}` }, el("span", { class: "ts", text: time }), el("span", { class: "text", text: l.line })),
      );
      added++;
    });
    while (box.childElementCount > MAX_LOG_LINES) box.firstElementChild.remove();
    log.lines += added;
    box.dataset.lines = String(log.lines);
    if (added && $("log-follow").checked && stick) box.scrollTop = box.scrollHeight;
    return lines.length >= 1000 ? 200 : 2000;
  }

  async function refreshEvents() {
    const c = current;
    const q = new URLSearchParams({ orderAsc: "true", limit: "100", offset: String(c.events) });
    const { data } = await api("GET", `/events/sandboxes/${encodeURIComponent(c.id)}?${q}`);
    if (c !== current) return undefined;
    const list = Array.isArray(data) ? data : [];
    const ol = $("events");
    for (const e of list) {
      const type = String(e.type || "");
      const short = type.replace(/^sandbox\.lifecycle\./, "");
      const item = el(
        "li",
        { class: `event type-${short.replace(/[^a-z]/g, "")}`, data: { type } },
        el("time", { datetime: e.timestamp, text: when(e.timestamp) }),
        el("strong", { text: short }),
      );
      if (e.eventData && typeof e.eventData === "object" && Object.keys(e.eventData).length) {
        item.append(el("code", { text: JSON.stringify(e.eventData) }));
      }
      ol.append(item);
    }
    c.events += list.length;
    ol.dataset.events = String(c.events);
    $("events-empty").hidden = c.events > 0;
    return list.length >= 100 ? 200 : 3000;
  }

  function sandboxPage(id) {
    show("sandbox");
    if (!current || current.id !== id) {
      current = { id, detail: null, log: { cursor: null, atCursor: 0, lines: 0 }, events: 0 };
      $("sbx-id").textContent = id;
      clear($("sbx-facts"));
      clear($("log"));
      $("log").dataset.lines = "0";
      clear($("events"));
      $("events").dataset.events = "0";
      clear($("action-results"));
      say("action-status", "");
      for (const c of ["chart-cpu", "chart-mem", "chart-disk"]) VmonChart.draw($(c), [], { axis: true });
    }
    every(3000, refreshDetail);
    every(5000, refreshMetrics);
    every(2000, refreshLogs);
    every(3000, refreshEvents);
  }

  $("metrics-range").addEventListener("change", () => {
    if (current) refreshMetrics().catch((e) => showError("Metrics", e));
  });

  // Runs one action: buttons off while it runs, its outcome in the status line.
  async function act(label, doing, fn) {
    const buttons = document.querySelectorAll("#view-sandbox .actions button");
    buttons.forEach((b) => (b.disabled = true));
    say("action-status", `${doing}…`);
    try {
      const done = await fn();
      say("action-status", done || `${label}: done.`);
    } catch (e) {
      say("action-status", `${label} failed: ${e instanceof ApiError ? e.describe() : e.message}`, true);
    } finally {
      await refreshDetail().catch(() => {});
    }
  }

  function result(...children) {
    $("action-results").prepend(el("li", {}, ...children));
  }

  function sandboxLink(id) {
    return el("a", { href: `#/sandbox/${encodeURIComponent(id)}`, class: "mono", text: id });
  }

  function seconds(input, name) {
    const n = Number(input.value);
    if (!Number.isInteger(n) || n < 0) throw new Error(`${name} must be a whole number of seconds`);
    return n;
  }

  $("act-pause").addEventListener("click", () =>
    act("Pause", "Pausing", async () => {
      await api("POST", sbxPath(current.id, "/pause"), {});
      return "Paused.";
    }),
  );
  $("act-resume").addEventListener("click", () =>
    act("Resume", "Resuming", async () => {
      const timeout = seconds($("in-timeout"), "Timeout") || 300;
      await api("POST", sbxPath(current.id, "/resume"), { timeout });
      return `Resumed, timeout ${timeout} s.`;
    }),
  );
  $("act-kill").addEventListener("click", () => {
    if (!window.confirm(`Kill sandbox ${current.id}? Its memory and disk are gone for good.`)) return;
    act("Kill", "Killing", async () => {
      await api("DELETE", sbxPath(current.id));
      return "Killed.";
    });
  });
  $("form-timeout").addEventListener("submit", (ev) => {
    ev.preventDefault();
    act("Set timeout", "Setting the timeout", async () => {
      const timeout = seconds($("in-timeout"), "Timeout");
      await api("POST", sbxPath(current.id, "/timeout"), { timeout });
      return `Timeout set: ends in ${timeout} s.`;
    });
  });
  $("form-fork").addEventListener("submit", (ev) => {
    ev.preventDefault();
    act("Fork", "Forking", async () => {
      const count = Number($("in-fork-count").value);
      if (!Number.isInteger(count) || count < 1 || count > 20) throw new Error("children must be between 1 and 20");
      const { data } = await api("POST", sbxPath(current.id, "/fork"), { count, timeout: 300 });
      let ok = 0;
      for (const r of Array.isArray(data) ? data : []) {
        if (r && r.sandbox) {
          ok++;
          result("Fork child ", sandboxLink(r.sandbox.sandboxID));
        } else if (r && r.error) {
          result(el("span", { class: "error-text", text: `Fork child failed: ${r.error.code}: ${r.error.message}` }));
        }
      }
      return `Forked: ${ok} of ${count} children started.`;
    });
  });
  $("form-snapshot").addEventListener("submit", (ev) => {
    ev.preventDefault();
    act("Snapshot", "Taking a snapshot", async () => {
      const name = $("in-snapshot-name").value.trim();
      const { data } = await api("POST", sbxPath(current.id, "/snapshots"), name ? { name } : {});
      const names = data && Array.isArray(data.names) && data.names.length ? ` (${data.names.join(", ")})` : "";
      result("Snapshot ", el("code", { text: (data && data.snapshotID) || "" }), names);
      return "Snapshot taken.";
    });
  });

  // ---- snapshots --------------------------------------------------------------------------

  function snapshotsPage() {
    show("snapshots");
    every(10000, async () => {
      const { data, headers } = await api("GET", "/snapshots?limit=1000");
      const list = Array.isArray(data) ? data : [];
      const body = $("snapshots-body");
      clear(body);
      for (const s of list) {
        const del = el("button", { type: "button", class: "danger small", text: "Delete" });
        del.addEventListener("click", async () => {
          if (!window.confirm(`Delete snapshot ${s.snapshotID}?`)) return;
          try {
            await api("DELETE", `/templates/${encodeURIComponent(s.snapshotID)}`);
            route();
          } catch (e) {
            showError("Deleting the snapshot", e);
          }
        });
        body.append(
          el(
            "tr",
            {},
            el("td", { "data-label": "Snapshot", class: "mono", text: s.snapshotID }),
            el("td", { "data-label": "Names", text: (s.names || []).join(", ") }),
            el("td", { class: "right" }, del),
          ),
        );
      }
      $("snapshots-empty").hidden = list.length > 0;
      $("snapshots-count").textContent = `${list.length}${headers.get("x-next-token") ? "+" : ""}`;
    });
  }

  // ---- webhooks ---------------------------------------------------------------------------

  let openHook = null;

  function webhooksPage() {
    show("webhooks");
    const box = $("wh-events");
    if (!box.querySelector("input")) {
      for (const t of EVENT_TYPES) {
        box.append(
          el("label", { class: "inline" }, el("input", { type: "checkbox", value: t, checked: "" }), ` ${t.replace(/^sandbox\.lifecycle\./, "")}`),
        );
      }
    }
    every(10000, refreshWebhooks);
    every(5000, refreshDeliveries);
  }

  async function refreshWebhooks() {
    const { data } = await api("GET", "/events/webhooks");
    const list = Array.isArray(data) ? data : [];
    const body = $("webhooks-body");
    // Rows stay as they are while nothing changed, so a click never lands on a replaced row.
    const signature = JSON.stringify(list);
    if (body.dataset.signature === signature) return;
    body.dataset.signature = signature;
    clear(body);
    for (const w of list) {
      const toggle = el("button", { type: "button", class: "small", text: w.enabled ? "Disable" : "Enable" });
      toggle.addEventListener("click", async () => {
        try {
          await api("PATCH", `/events/webhooks/${encodeURIComponent(w.id)}`, { enabled: !w.enabled });
          await refreshWebhooks();
        } catch (e) {
          showError("Updating the webhook", e);
        }
      });
      const open = el("button", { type: "button", class: "small", text: "Deliveries" });
      open.addEventListener("click", () => {
        openHook = { id: w.id, name: w.name || w.url };
        $("deliveries").hidden = false;
        refreshDeliveries().catch((e) => showError("Deliveries", e));
      });
      const del = el("button", { type: "button", class: "small danger", text: "Delete" });
      del.addEventListener("click", async () => {
        if (!window.confirm(`Delete webhook ${w.name || w.url}?`)) return;
        try {
          await api("DELETE", `/events/webhooks/${encodeURIComponent(w.id)}`);
          if (openHook && openHook.id === w.id) closeDeliveries();
          await refreshWebhooks();
        } catch (e) {
          showError("Deleting the webhook", e);
        }
      });
      body.append(
        el(
          "tr",
          { data: { webhookId: w.id } },
          el("td", { "data-label": "Name", text: w.name }),
          el("td", { "data-label": "URL", class: "mono wrap", text: w.url }),
          el("td", { "data-label": "Events" }, ...(w.events || []).map((t) => el("span", { class: "chip", text: t.replace(/^sandbox\.lifecycle\./, "") }))),
          el("td", { "data-label": "Enabled" }, badge(w.enabled ? "enabled" : "disabled")),
          el("td", { class: "right buttons" }, open, toggle, del),
        ),
      );
    }
    $("webhooks-empty").hidden = list.length > 0;
  }

  async function refreshDeliveries() {
    if (!openHook) return;
    const hook = openHook;
    const path = `/events/webhooks/${encodeURIComponent(hook.id)}`;
    const [{ data: stats }, { data: list }] = await Promise.all([
      api("GET", `${path}/stats`),
      api("GET", `${path}/deliveries?limit=50`),
    ]);
    if (openHook !== hook) return;
    $("deliveries-name").textContent = hook.name;
    const dl = $("deliveries-stats");
    clear(dl);
    const s = stats || {};
    fact(dl, "Attempts", String(s.attempts ?? 0));
    fact(dl, "Succeeded", String(s.successes ?? 0));
    fact(dl, "Failed", String(s.failures ?? 0));
    fact(dl, "Pending", String(s.pending ?? 0));
    fact(dl, "Average", `${s.averageDurationMs ?? 0} ms`);
    if (s.lastSuccessAt) fact(dl, "Last success", when(s.lastSuccessAt));
    if (s.lastFailureAt) fact(dl, "Last failure", when(s.lastFailureAt));
    const body = $("deliveries-body");
    clear(body);
    const rows = Array.isArray(list) ? list : [];
    for (const d of rows) {
      body.append(
        el(
          "tr",
          {},
          el("td", { "data-label": "Time", text: when(d.timestamp) }),
          el("td", { "data-label": "Event", class: "mono", text: d.eventID }),
          el("td", { "data-label": "Attempt", text: d.attempt }),
          el("td", { "data-label": "Status", text: d.statusCode ?? "–" }),
          el("td", { "data-label": "Result" }, badge(d.success ? "delivered" : "failed")),
          el("td", { "data-label": "Duration", text: `${d.durationMs} ms` }),
          el("td", { "data-label": "Error", class: "wrap", text: d.error || "" }),
        ),
      );
    }
    $("deliveries-empty").hidden = rows.length > 0;
  }

  function closeDeliveries() {
    openHook = null;
    $("deliveries").hidden = true;
  }
  $("deliveries-close").addEventListener("click", closeDeliveries);

  $("webhook-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const events = [...$("wh-events").querySelectorAll("input:checked")].map((i) => i.value);
    const body = {
      name: $("wh-name").value.trim() || undefined,
      url: $("wh-url").value.trim(),
      enabled: $("wh-enabled").checked,
      events,
      signatureSecret: $("wh-secret").value,
    };
    say("webhook-status", "Creating…");
    try {
      const { data } = await api("POST", "/events/webhooks", body);
      $("wh-secret").value = "";
      say("webhook-status", `Created webhook ${data && data.name ? data.name : ""}.`);
      await refreshWebhooks();
    } catch (e) {
      say("webhook-status", `Creating the webhook failed: ${e instanceof ApiError ? e.describe() : e.message}`, true);
    }
  });

  route();
})();
