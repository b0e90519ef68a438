// The playground: one conversation with one model through the API picked, streamed with fetch().
import { $, el, errorMessage, fmt, readSSE } from "./common.js";
import { buildRequest, entriesFromItems, streamReader } from "./apis.js";

const DEFAULT_TOOLS = [{
  type: "function", name: "get_weather", description: "Current weather for a city.",
  parameters: { type: "object", properties: { city: { type: "string", maxLength: 40 }, unit: { type: "string", enum: ["celsius", "fahrenheit"] } }, required: ["city", "unit"] },
}];
const DEFAULT_SCHEMA = { type: "object", properties: { city: { type: "string", maxLength: 40 }, population: { type: "integer" } }, required: ["city", "population"], additionalProperties: false };
const CONVERSATIONS_KEY = "kiln.playground.conversations"; // ids and titles only: nothing secret

const state = {
  entries: [],        // the conversation, neutral form (apis.js)
  sentUpTo: 0,        // entries the server already holds (previous_response_id / conversation)
  previousId: null,
  conversationId: null,
  apiKey: "",         // hosted mode: kept here, in memory, never stored
  abort: null,
};

function setStatus(text, kind = "") {
  const s = $("status");
  s.textContent = text;
  s.className = kind || "muted";
}

function headers(extra = {}) {
  const h = { "Content-Type": "application/json", ...extra };
  if (state.apiKey) h.Authorization = `Bearer ${state.apiKey}`;
  return h;
}

async function loadModels() {
  const r = await fetch("/v1/models", { headers: headers() });
  if (r.status === 401) {
    $("key-row").classList.remove("hidden");
    setStatus("This gateway needs an API key: type it in Settings.", "error");
    return;
  }
  if (!r.ok) { setStatus(await errorMessage(r), "error"); return; }
  const models = (await r.json()).data || [];
  const select = $("model");
  const was = select.value;
  select.replaceChildren(...models.map((m) => el("option", { value: m.id }, m.id)));
  if (models.some((m) => m.id === was)) select.value = was;
  setStatus(models.length ? `${models.length} model${models.length > 1 ? "s" : ""}` : "No model is served yet.", models.length ? "ok" : "error");
}

function readJSONField(id, what) {
  try { return JSON.parse($(id).value); } catch (e) { throw new Error(`${what} is not valid JSON: ${e.message}`); }
}

// -- the transcript --------------------------------------------------------------------------

function renderUser(text) {
  $("output").append(el("div", { class: "turn user", "data-testid": "turn-user" }, el("div", { class: "who" }, "You"), el("div", { class: "text" }, text)));
}

function renderToolResult(entry) {
  $("output").append(el("div", { class: "turn user", "data-testid": "turn-tool-result" }, el("div", { class: "who" }, `Tool output · ${entry.id}`), el("pre", {}, entry.output)));
}

/** An assistant turn's box, filled as the stream arrives. */
function assistantView(turn) {
  const text = el("div", { class: "text", "data-testid": "answer" });
  const reasoningText = el("div", { class: "reasoning" });
  const reasoning = el("details", { class: "hidden", "data-testid": "reasoning" }, el("summary", {}, "Reasoning"), reasoningText);
  const calls = el("div", {});
  const box = el("div", { class: "turn assistant", "data-testid": "turn-assistant" }, el("div", { class: "who" }, "Assistant"), reasoning, text, calls);
  $("output").append(box);
  const callBoxes = new Map();
  const scroll = () => { const o = $("output"); o.scrollTop = o.scrollHeight; };
  return {
    box,
    text(d) { turn.text += d; text.textContent = turn.text; scroll(); },
    reasoning(d) { turn.reasoning += d; reasoning.classList.remove("hidden"); reasoningText.textContent = turn.reasoning; scroll(); },
    toolStart(id, name) {
      const args = el("pre", { "data-testid": "tool-args" });
      const card = el("div", { class: "tool-call", "data-testid": "tool-call" }, el("strong", {}, `${name}(…)`), " ", el("span", { class: "muted" }, id || ""), args);
      callBoxes.set(id, { card, args });
      calls.append(card);
    },
    toolArgs(id, d) { const c = callBoxes.get(id); if (c) c.args.textContent += d; },
    toolDone(id, name, args) {
      if (!callBoxes.has(id)) this.toolStart(id, name);
      const c = callBoxes.get(id);
      c.args.textContent = args;
      if (!turn.calls.some((x) => x.id === id)) turn.calls.push({ id, name, args, answered: false });
    },
  };
}

/** The form that answers one tool call; when every call of the turn has its output, the turn goes on. */
function toolAnswerForm(turn, call, card) {
  const area = el("textarea", { class: "code", rows: 2, id: `out-${call.id}`, "data-testid": "tool-output" });
  area.value = JSON.stringify({ temperature: 21, unit: "celsius", sky: "clear" });
  const button = el("button", { type: "submit", class: "primary", "data-testid": "send-tool-output" }, "Send tool output");
  const form = el("form", { "aria-label": `Output of ${call.name}` }, el("label", { for: `out-${call.id}` }, `Output of ${call.name}`), area, el("div", { class: "row" }, button));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    call.answered = true;
    const entry = { kind: "tool_result", id: call.id, output: area.value };
    state.entries.push(entry);
    form.remove();
    renderToolResult(entry);
    if (turn.calls.every((c) => c.answered)) send();
  });
  card.append(form);
  area.focus();
}

function renderEntries() {
  $("output").replaceChildren();
  for (const e of state.entries) {
    if (e.kind === "user") renderUser(e.text);
    else if (e.kind === "tool_result") renderToolResult(e);
    else {
      const v = assistantView({ text: "", reasoning: "", calls: [] });
      v.text(e.text);
      if (e.reasoning) v.reasoning(e.reasoning);
      for (const c of e.calls) v.toolDone(c.id, c.name, c.args);
    }
  }
}

// -- sending -----------------------------------------------------------------------------------

function resetStats() {
  for (const id of ["response-id", "usage", "ttft", "tps"]) $(id).textContent = "–";
}

async function ensureConversation() {
  if (state.conversationId) return;
  const r = await fetch("/v1/conversations", { method: "POST", headers: headers(), body: JSON.stringify({ metadata: { source: "kiln-playground" } }) });
  if (!r.ok) throw new Error(await errorMessage(r));
  state.conversationId = (await r.json()).id;
  const first = state.entries.find((e) => e.kind === "user");
  saveConversation(state.conversationId, first ? first.text.slice(0, 60) : "(empty)");
}

async function send() {
  const api = $("api").value;
  const continuation = $("continuation").value;
  let tools = null;
  let schema = null;
  try {
    if ($("use-tools").checked) tools = readJSONField("tools", "The tool definitions");
    if ($("use-schema").checked && api !== "messages") schema = readJSONField("schema", "The schema");
    if (api === "responses" && continuation === "conversation") await ensureConversation();
  } catch (e) { setStatus(e.message, "error"); return; }
  const opts = {
    model: $("model").value, entries: state.entries, fresh: state.entries.slice(state.sentUpTo),
    instructions: $("instructions").value.trim(), temperature: Number($("temperature").value), maxTokens: Number($("max-tokens").value),
    tools, toolChoice: $("tool-choice").value, schema, continuation, previousId: state.previousId, conversationId: state.conversationId,
  };
  const { path, body, headers: extra } = buildRequest(api, opts);
  const turn = { kind: "assistant", text: "", reasoning: "", calls: [] };
  const view = assistantView(turn);
  const started = performance.now();
  let first = null;
  let usage = null;
  let failed = null;
  const mark = () => { if (first === null) { first = performance.now(); $("ttft").textContent = `${fmt(first - started)} ms`; } };
  const reader = streamReader(api, {
    id(id) { $("response-id").textContent = id; if (api === "responses") state.pendingId = id; },
    text(d) { mark(); view.text(d); },
    reasoning(d) { mark(); view.reasoning(d); },
    toolStart(id, name) { mark(); view.toolStart(id, name); },
    toolArgs(id, d) { mark(); view.toolArgs(id, d); },
    toolDone(id, name, args) { view.toolDone(id, name, args); },
    usage(u) { usage = u; },
    status(s) { view.box.dataset.status = s; },
    error(m) { failed = m; },
  });
  resetStats();
  $("send").disabled = true;
  $("stop").disabled = false;
  setStatus("Streaming…");
  state.abort = new AbortController();
  try {
    const r = await fetch(path, { method: "POST", headers: headers(extra), body: JSON.stringify(body), signal: state.abort.signal });
    if (!r.ok) throw new Error(await errorMessage(r));
    await readSSE(r, reader);
    if (failed) throw new Error(failed);
  } catch (e) {
    view.box.classList.add("error");
    view.box.append(el("div", { class: "error", "data-testid": "error" }, e.name === "AbortError" ? "Stopped." : e.message));
    setStatus(e.name === "AbortError" ? "Stopped." : "The request failed.", "error");
    failed = failed || e.message;
  } finally {
    $("send").disabled = false;
    $("stop").disabled = true;
    state.abort = null;
  }
  const ended = performance.now();
  if (usage) {
    $("usage").textContent = `${fmt(usage.input)} in${usage.cached ? ` (${fmt(usage.cached)} cached)` : ""} / ${fmt(usage.output)} out`;
    if (first !== null && usage.output > 1 && ended > first) $("tps").textContent = fmt((usage.output - 1) / ((ended - first) / 1000), 1);
  }
  state.entries.push(turn);
  if (!failed) {
    setStatus(`Done in ${fmt(ended - started)} ms`, "ok");
    if (api === "responses" && state.pendingId) state.previousId = state.pendingId;
    state.sentUpTo = api === "responses" && continuation !== "resend" ? state.entries.length : 0;
    const card = (id) => [...view.box.querySelectorAll("[data-testid=tool-call]")].find((c) => c.textContent.includes(id));
    for (const call of turn.calls) toolAnswerForm(turn, call, card(call.id) || view.box);
  }
  if (!turn.calls.length) $("prompt").focus();
}

function submitPrompt(ev) {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || $("send").disabled) return;
  if (!$("model").value) { setStatus("Pick a model first.", "error"); return; }
  $("prompt").value = "";
  state.entries.push({ kind: "user", text });
  renderUser(text);
  send();
}

function newChat() {
  if (state.abort) state.abort.abort();
  Object.assign(state, { entries: [], sentUpTo: 0, previousId: null, conversationId: null, pendingId: null });
  $("output").replaceChildren();
  resetStats();
  setStatus("New chat.", "muted");
  $("prompt").focus();
}

// -- conversations (Responses API) -------------------------------------------------------------

function savedConversations() {
  try { return JSON.parse(localStorage.getItem(CONVERSATIONS_KEY) || "[]"); } catch { return []; }
}

function saveConversation(id, title) {
  const list = [{ id, title, at: Date.now() }, ...savedConversations().filter((c) => c.id !== id)].slice(0, 50);
  localStorage.setItem(CONVERSATIONS_KEY, JSON.stringify(list));
  renderConversations();
}

function renderConversations() {
  const list = savedConversations();
  $("conversations").replaceChildren(...(list.length ? list.map((c) => el("li", {},
    el("span", { title: c.id }, c.title || c.id),
    el("button", { type: "button", "data-testid": "reopen", "data-id": c.id, onclick: () => reopen(c.id), "aria-label": `Reopen ${c.title || c.id}` }, "Open"),
  )) : [el("li", { class: "muted" }, "None yet: pick “a Conversation” above.")]));
}

async function reopen(id) {
  const r = await fetch(`/v1/conversations/${encodeURIComponent(id)}/items?order=asc&limit=100`, { headers: headers() });
  if (!r.ok) { setStatus(`Cannot reopen ${id}: ${await errorMessage(r)}`, "error"); return; }
  const items = (await r.json()).data || [];
  Object.assign(state, { entries: entriesFromItems(items), previousId: null, conversationId: id, pendingId: null });
  state.sentUpTo = state.entries.length;
  $("api").value = "responses";
  $("continuation").value = "conversation";
  syncControls();
  renderEntries();
  setStatus(`Reopened ${id} (${items.length} items).`, "ok");
}

// -- controls ----------------------------------------------------------------------------------

function syncControls() {
  const api = $("api").value;
  const responses = api === "responses";
  $("continuation").disabled = !responses;
  $("continuation-note").textContent = responses ? "" : "Chat Completions and Messages keep no state: the page sends the whole history each turn.";
  $("schema-note").textContent = api === "messages" ? "Anthropic Messages has no structured output here: the schema is not sent." : "";
}

function init() {
  $("tools").value = JSON.stringify(DEFAULT_TOOLS, null, 2);
  $("schema").value = JSON.stringify(DEFAULT_SCHEMA, null, 2);
  $("composer").addEventListener("submit", submitPrompt);
  for (const id of ["settings", "tools-form", "schema-form"]) $(id).addEventListener("submit", (ev) => ev.preventDefault());
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) submitPrompt(ev);
  });
  $("stop").addEventListener("click", () => state.abort && state.abort.abort());
  $("new-chat").addEventListener("click", newChat);
  $("api").addEventListener("change", () => { syncControls(); Object.assign(state, { sentUpTo: 0, previousId: null, conversationId: null }); });
  $("continuation").addEventListener("change", () => { state.sentUpTo = 0; state.previousId = null; });
  $("api-key").addEventListener("change", () => { state.apiKey = $("api-key").value.trim(); loadModels(); });
  syncControls();
  renderConversations();
  loadModels().catch((e) => setStatus(`Cannot list models: ${e.message}`, "error"));
}

init();
