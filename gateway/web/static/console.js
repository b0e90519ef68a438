// The operator console: accounts, keys, credits, prices, usage, workers and live metrics, through
// the admin API. The admin token lives in this module's `token` variable only: never in a URL, a
// cookie or web storage, and it goes only in the Authorization header of same-origin fetches.
import { $, el, errorMessage, fmt } from "./common.js";
import { stackedBars } from "./chart.js";

let token = null;
let selectedOrg = null;
let catalogModels = [];
let lastTokens = null; // {t, output} from the previous metrics poll
let timer = null;

function setStatus(text, kind = "muted") {
  $("status").textContent = text;
  $("status").className = kind;
}

class Unauthorized extends Error {}

async function api(path, { method = "GET", body } = {}) {
  if (!token) throw new Unauthorized("signed out");
  const headers = { Authorization: `Bearer ${token}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body), cache: "no-store", credentials: "omit" });
  if (r.status === 401) { signOut("The admin token was refused."); throw new Unauthorized("refused"); }
  if (!r.ok) throw new Error(await errorMessage(r));
  return path === "/metrics" ? r.text() : r.json();
}

async function guarded(what, action) {
  try {
    await action();
  } catch (e) {
    if (!(e instanceof Unauthorized)) setStatus(`${what}: ${e.message}`, "error");
  }
}

// -- sign in / out ---------------------------------------------------------------------------

async function signIn(ev) {
  ev.preventDefault();
  const field = $("admin-token");
  token = field.value.trim();
  field.value = "";
  try {
    await api("/admin/orgs");
  } catch (e) {
    token = null;
    $("signin-error").textContent = e instanceof Unauthorized ? "That token was refused." : e.message;
    return;
  }
  $("signin-error").textContent = "";
  $("signin").classList.add("hidden");
  $("app").classList.remove("hidden");
  $("sign-out").classList.remove("hidden");
  setStatus("Signed in.", "ok");
  await Promise.all([refreshOrgs(), refreshCatalog(), refreshLive(), refreshUsage()]);
  timer = setInterval(() => refreshLive(), 5000);
}

function signOut(message = "Signed out.") {
  token = null;
  selectedOrg = null;
  if (timer) clearInterval(timer);
  timer = null;
  for (const id of ["orgs", "keys", "catalog", "workers", "metrics", "usage-chart", "usage-legend", "usage-table"]) $(id).replaceChildren();
  $("app").classList.add("hidden");
  $("sign-out").classList.add("hidden");
  $("signin").classList.remove("hidden");
  $("signin-error").textContent = message === "Signed out." ? "" : message;
  setStatus(message);
  $("admin-token").focus();
}

// -- organizations, keys, credits ------------------------------------------------------------

async function refreshOrgs() {
  await guarded("Organizations", async () => {
    const orgs = (await api("/admin/orgs")).data;
    $("orgs").replaceChildren(...orgs.map((o) => el("tr", { class: o.name === selectedOrg ? "selected" : "", "data-org": o.name },
      el("td", {}, o.name), el("td", { class: "num", "data-testid": "credits" }, o.credits_usd), el("td", { class: "num" }, o.concurrency_limit),
      el("td", {}, new Date(o.created_at * 1000).toLocaleDateString()),
      el("td", {}, el("button", { type: "button", "data-testid": "manage-org", "data-org": o.name, "aria-label": `Manage ${o.name}`, onclick: () => selectOrg(o.name) }, "Manage")))));
    const current = orgs.find((o) => o.name === selectedOrg);
    if (current) $("balance").textContent = current.credits_usd;
  });
}

async function createOrg(ev) {
  ev.preventDefault();
  await guarded("New organization", async () => {
    const org = await api("/admin/orgs", { method: "POST", body: { name: $("org-name").value.trim(), credits_usd: $("org-credits").value, concurrency_limit: Number($("org-concurrency").value) } });
    $("org-name").value = "";
    setStatus(`Created ${org.name}.`, "ok");
    await refreshOrgs();
    await selectOrg(org.name);
  });
}

async function selectOrg(name) {
  selectedOrg = name;
  $("keys-org").textContent = `· ${name}`;
  $("org-panel").classList.remove("hidden");
  $("new-key-box").classList.add("hidden");
  await Promise.all([refreshOrgs(), refreshKeys()]);
}

async function refreshKeys() {
  if (!selectedOrg) return;
  await guarded("Keys", async () => {
    const keys = (await api(`/admin/orgs/${encodeURIComponent(selectedOrg)}/keys`)).data;
    $("keys").replaceChildren(...keys.map((k) => el("tr", { "data-prefix": k.prefix },
      el("td", {}, el("code", {}, k.prefix)), el("td", { "data-testid": "key-status", class: k.revoked ? "error" : "ok" }, k.revoked ? "revoked" : "active"),
      el("td", {}, k.models ? k.models.join(", ") : "all models"), el("td", {}, new Date(k.created_at * 1000).toLocaleDateString()),
      el("td", {}, k.revoked ? "" : revokeButton(k.prefix)))));
    if (!keys.length) $("keys").append(el("tr", {}, el("td", { colspan: 5, class: "muted" }, "No keys yet.")));
  });
}

function revokeButton(prefix) {
  // Two clicks: the first arms it for a few seconds (no modal dialog, keyboard-friendly).
  const button = el("button", { type: "button", "data-testid": "revoke", "data-prefix": prefix, "aria-label": `Revoke ${prefix}` }, "Revoke");
  button.addEventListener("click", async () => {
    if (button.dataset.armed !== "1") {
      button.dataset.armed = "1";
      button.textContent = "Confirm revoke";
      button.classList.add("primary");
      setTimeout(() => { button.dataset.armed = ""; button.textContent = "Revoke"; button.classList.remove("primary"); }, 5000);
      return;
    }
    await guarded("Revoke", async () => {
      await api(`/admin/keys/${encodeURIComponent(prefix)}/revoke`, { method: "POST" });
      setStatus(`Revoked ${prefix}.`, "ok");
      await refreshKeys();
    });
  });
  return button;
}

async function createKey(ev) {
  ev.preventDefault();
  const models = [...document.querySelectorAll("#scopes input:checked")].map((i) => i.value);
  await guarded("New key", async () => {
    const made = await api(`/admin/orgs/${encodeURIComponent(selectedOrg)}/keys`, { method: "POST", body: { models: models.length ? models : null } });
    $("new-key").textContent = made.key;
    $("new-key-box").classList.remove("hidden");
    setStatus(`Created key ${made.prefix}.`, "ok");
    await refreshKeys();
  });
}

async function topUp(ev) {
  ev.preventDefault();
  await guarded("Top up", async () => {
    const org = await api(`/admin/orgs/${encodeURIComponent(selectedOrg)}/credits`, { method: "POST", body: { amount_usd: $("topup-amount").value } });
    $("balance").textContent = org.credits_usd;
    setStatus(`${org.name}: ${org.credits_usd} USD.`, "ok");
    await refreshOrgs();
  });
}

// -- catalog, workers, metrics ---------------------------------------------------------------

async function refreshCatalog() {
  await guarded("Catalog", async () => {
    const cat = await api("/admin/catalog");
    catalogModels = cat.data.map((m) => m.id);
    const price = (m, k) => (m.pricing ? fmt(m.pricing[k], 4) : "free");
    $("catalog").replaceChildren(...cat.data.map((m) => el("tr", {}, el("td", {}, m.id), el("td", { class: "num" }, price(m, "input")), el("td", { class: "num" }, price(m, "cached_input")), el("td", { class: "num" }, price(m, "output")), el("td", { class: m.available ? "ok" : "muted" }, m.available ? "yes" : "no"))));
    $("scopes").replaceChildren(...catalogModels.map((id, i) => el("label", { class: "check", for: `scope-${i}` }, el("input", { type: "checkbox", id: `scope-${i}`, value: id, "data-testid": "key-scope" }), id)));
  });
}

/** Prometheus text -> [{name, labels, value}] */
function parseMetrics(text) {
  const out = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{(.*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const p of (m[3] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[p[1]] = p[2];
    out.push({ name: m[1], labels, value: Number(m[4]) });
  }
  return out;
}

/** A route of the model API (not the pages, the admin API, /health or /metrics). */
const isApiRoute = (route) => Boolean(route) && route !== "unmatched" && route !== "/" && !/^\/(admin|ui|health|metrics)(\/|$)/.test(route);

function quantile(samples, name, q) {
  const buckets = samples.filter((s) => s.name === `${name}_bucket`).map((s) => ({ le: s.labels.le === "+Inf" ? Infinity : Number(s.labels.le), n: s.value })).sort((a, b) => a.le - b.le);
  const total = buckets.length ? buckets[buckets.length - 1].n : 0;
  if (!total) return null;
  const hit = buckets.find((b) => b.n >= q * total);
  return hit ? hit.le : null;
}

async function refreshLive() {
  await guarded("Metrics", async () => {
    const [text, health] = await Promise.all([api("/metrics"), fetch("/health", { cache: "no-store" }).then((r) => r.json())]);
    const s = parseMetrics(text);
    const sum = (name, pred = () => true) => s.filter((x) => x.name === name && pred(x.labels)).reduce((a, x) => a + x.value, 0);
    const requests = sum("kiln_requests_total", (l) => isApiRoute(l.route));
    const errors5 = sum("kiln_requests_total", (l) => isApiRoute(l.route) && Number(l.status) >= 500);
    const errors4 = sum("kiln_requests_total", (l) => isApiRoute(l.route) && l.status.startsWith("4"));
    const ttftCount = sum("kiln_time_to_first_token_seconds_count");
    const ttftMean = ttftCount ? sum("kiln_time_to_first_token_seconds_sum") / ttftCount : null;
    const gaps = sum("kiln_inter_token_seconds_count");
    const perStream = gaps ? gaps / sum("kiln_inter_token_seconds_sum") : null;
    const output = sum("kiln_tokens_total", (l) => l.direction === "output");
    const input = sum("kiln_tokens_total", (l) => l.direction === "input");
    const now = performance.now();
    const rate = lastTokens && now > lastTokens.t ? (output - lastTokens.output) / ((now - lastTokens.t) / 1000) : null;
    lastTokens = { t: now, output };
    const tile = (k, v, id) => el("div", { class: "tile", "data-testid": `metric-${id}` }, el("div", { class: "v" }, v), el("div", { class: "k" }, k));
    const p95 = quantile(s, "kiln_time_to_first_token_seconds", 0.95);
    $("metrics").replaceChildren(
      tile("API requests", fmt(requests), "requests"),
      tile("Server errors (5xx)", fmt(errors5), "errors"),
      tile("Refused (4xx)", fmt(errors4), "refused"),
      tile("In flight", fmt(sum("kiln_requests_in_flight")), "in-flight"),
      tile("TTFT mean", ttftMean === null ? "–" : `${fmt(ttftMean * 1000)} ms`, "ttft"),
      tile("TTFT p95 ≤", p95 === null ? "–" : p95 === Infinity ? "> 60 s" : `${fmt(p95 * 1000)} ms`, "ttft-p95"),
      tile("Tokens/s per stream", perStream === null ? "–" : fmt(perStream, 1), "stream-tps"),
      tile("Output tokens/s now", rate === null ? "…" : fmt(rate, 1), "tps"),
      tile("Tokens in / out", `${fmt(input)} / ${fmt(output)}`, "tokens"),
    );
    const workers = health.workers || [];
    $("workers").replaceChildren(...workers.map((w) => el("tr", {}, el("td", {}, el("code", {}, w.tag ?? w.id)), el("td", {}, w.model), el("td", { class: "num" }, w.active), el("td", { class: "num" }, w.queued), el("td", { class: "num" }, w.rss_bytes ? `${fmt(w.rss_bytes / 2 ** 20)} MiB` : "–"))));
    if (!workers.length) $("workers").append(el("tr", {}, el("td", { colspan: 5, class: "muted" }, "No worker is connected.")));
  });
}

// -- usage chart -----------------------------------------------------------------------------

async function refreshUsage(ev) {
  if (ev) ev.preventDefault();
  await guarded("Usage", async () => {
    const [span, bucket] = $("usage-window").value.split(":").map(Number);
    const end = Math.floor(Date.now() / 1000) + 1;
    const start = Math.floor((end - span) / bucket) * bucket;
    const data = await api(`/admin/usage?start_time=${start}&end_time=${end}&bucket=${bucket}`);
    drawUsage(data, start, end, bucket);
  });
}

function drawUsage(data, start, end, bucket) {
  const metric = $("usage-metric").value;
  const group = $("usage-group").value;
  const value = (p) => ({ requests: p.requests, tokens: p.input_tokens + p.output_tokens, output_tokens: p.output_tokens, cost: Number(p.cost_usd), errors: p.errors })[metric];
  const key = (p) => (group === "org" ? p.org : group === "model" ? p.model : `${p.org} · ${p.model}`);
  const buckets = [];
  for (let b = start; b < end; b += bucket) buckets.push(b);
  const byName = new Map();
  for (const p of data.data) {
    const name = key(p);
    if (!byName.has(name)) byName.set(name, { name, values: new Map(), requests: 0, total: 0 });
    const s = byName.get(name);
    s.values.set(p.start, (s.values.get(p.start) || 0) + value(p));
    s.requests += p.requests;
    s.total += value(p);
  }
  const series = [...byName.values()].sort((a, b) => b.total - a.total);
  const unit = { requests: "requests", tokens: "tokens", output_tokens: "output tokens", cost: "USD", errors: "failed requests" }[metric];
  const digits = metric === "cost" ? 6 : 0;
  const svg = stackedBars({ buckets, bucket, series, unit, digits, label: `${$("usage-metric").selectedOptions[0].text} ${$("usage-window").selectedOptions[0].text.toLowerCase()}` });
  svg.setAttribute("data-requests", series.reduce((a, s) => a + s.requests, 0));
  $("usage-chart").replaceChildren(svg);
  $("usage-chart").scrollLeft = $("usage-chart").scrollWidth; // on a narrow screen, show the latest buckets
  $("usage-legend").replaceChildren(...(series.length ? series.map((s, k) => el("span", { class: `s${k % 8}`, "data-series": s.name, "data-requests": s.requests }, `${s.name}: ${fmt(s.total, digits)}`)) : [el("span", { class: "muted" }, "No usage in this window.")]));
  $("usage-table").replaceChildren(el("table", {}, el("thead", {}, el("tr", {}, ...["Bucket start", "Organization", "Model", "Requests", "Failed", "Input tokens", "Output tokens", "Cost (USD)"].map((h) => el("th", {}, h)))),
    el("tbody", {}, ...data.data.map((p) => el("tr", {}, el("td", {}, new Date(p.start * 1000).toLocaleString()), el("td", {}, p.org), el("td", {}, p.model), el("td", { class: "num" }, p.requests), el("td", { class: "num" }, p.errors), el("td", { class: "num" }, p.input_tokens), el("td", { class: "num" }, p.output_tokens), el("td", { class: "num" }, p.cost_usd))))));
}

function init() {
  $("signin").addEventListener("submit", signIn);
  $("sign-out").addEventListener("click", () => signOut());
  $("create-org").addEventListener("submit", createOrg);
  $("create-key-form").addEventListener("submit", createKey);
  $("topup").addEventListener("submit", topUp);
  $("usage-form").addEventListener("submit", refreshUsage);
  for (const id of ["usage-window", "usage-metric", "usage-group"]) $(id).addEventListener("change", () => refreshUsage());
  $("admin-token").focus();
}

init();
