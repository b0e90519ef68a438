// The three doors of Kiln as the playground speaks them. The conversation is kept in one neutral
// form (entries: user text, an assistant turn with its text, reasoning and tool calls, a tool
// result), and each API turns it into its own request and reads its own stream into the same
// callbacks, so switching the API mid-conversation shows the same model through another door.

/** Responses function tools -> Chat Completions tools. */
const chatTools = (tools) => tools.map((t) => ({ type: "function", function: { name: t.name, description: t.description, parameters: t.parameters } }));
/** Responses function tools -> Anthropic tools. */
const anthropicTools = (tools) => tools.map((t) => ({ name: t.name, description: t.description, input_schema: t.parameters || { type: "object" } }));

function responsesItems(entries) {
  const items = [];
  for (const e of entries) {
    if (e.kind === "user") items.push({ role: "user", content: e.text });
    else if (e.kind === "assistant") {
      if (e.text) items.push({ role: "assistant", content: e.text });
      for (const c of e.calls) items.push({ type: "function_call", call_id: c.id, name: c.name, arguments: c.args });
    } else if (e.kind === "tool_result") items.push({ type: "function_call_output", call_id: e.id, output: e.output });
  }
  return items;
}

function chatMessages(entries, instructions) {
  const messages = instructions ? [{ role: "system", content: instructions }] : [];
  for (const e of entries) {
    if (e.kind === "user") messages.push({ role: "user", content: e.text });
    else if (e.kind === "assistant") {
      const m = { role: "assistant", content: e.text || null };
      if (e.calls.length) m.tool_calls = e.calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.args } }));
      messages.push(m);
    } else if (e.kind === "tool_result") messages.push({ role: "tool", tool_call_id: e.id, content: e.output });
  }
  return messages;
}

function anthropicMessages(entries) {
  const out = [];
  const push = (role, block) => {
    const last = out[out.length - 1];
    if (last && last.role === role) last.content.push(block);
    else out.push({ role, content: [block] });
  };
  for (const e of entries) {
    if (e.kind === "user") push("user", { type: "text", text: e.text });
    else if (e.kind === "assistant") {
      if (e.text) push("assistant", { type: "text", text: e.text });
      for (const c of e.calls) {
        let input = {};
        try { input = JSON.parse(c.args || "{}"); } catch { /* sent as {} */ }
        push("assistant", { type: "tool_use", id: c.id, name: c.name, input });
      }
    } else if (e.kind === "tool_result") push("user", { type: "tool_result", tool_use_id: e.id, content: e.output });
  }
  return out;
}

/**
 * The request for one turn. opts: {model, entries (all), fresh (entries since the last response),
 * instructions, temperature, maxTokens, tools|null, toolChoice, schema|null, continuation,
 * previousId, conversationId}
 */
export function buildRequest(api, o) {
  if (api === "responses") {
    const body = { model: o.model, stream: true, max_output_tokens: o.maxTokens, temperature: o.temperature };
    if (o.instructions) body.instructions = o.instructions;
    if (o.continuation === "previous" && o.previousId) { body.previous_response_id = o.previousId; body.input = responsesItems(o.fresh); }
    else if (o.continuation === "conversation" && o.conversationId) { body.conversation = o.conversationId; body.input = responsesItems(o.fresh); }
    else body.input = responsesItems(o.entries);
    if (o.tools) { body.tools = o.tools; body.tool_choice = o.toolChoice; }
    if (o.schema) body.text = { format: { type: "json_schema", name: "answer", schema: o.schema, strict: true } };
    return { path: "/v1/responses", body };
  }
  if (api === "chat") {
    const body = { model: o.model, stream: true, stream_options: { include_usage: true }, max_completion_tokens: o.maxTokens, temperature: o.temperature, messages: chatMessages(o.entries, o.instructions) };
    if (o.tools) { body.tools = chatTools(o.tools); body.tool_choice = o.toolChoice; }
    if (o.schema) body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: o.schema, strict: true } };
    return { path: "/v1/chat/completions", body };
  }
  const body = { model: o.model, stream: true, max_tokens: o.maxTokens, temperature: Math.min(o.temperature, 1), messages: anthropicMessages(o.entries) };
  if (o.instructions) body.system = o.instructions;
  if (o.tools) {
    body.tools = anthropicTools(o.tools);
    body.tool_choice = o.toolChoice === "required" ? { type: "any" } : { type: o.toolChoice };
  }
  return { path: "/v1/messages", body, headers: { "anthropic-version": "2023-06-01" } };
}

/**
 * A reader of one API's stream: feed(sse event) calls view.{id, text, reasoning, toolStart,
 * toolArgs, toolDone, usage, status, error}. Usage is {input, output, cached}.
 */
export function streamReader(api, view) {
  if (api === "responses") {
    const calls = new Map(); // output_index -> call_id
    return ({ data }) => {
      if (!data || typeof data !== "object") return;
      const t = data.type;
      if (t === "response.created") view.id(data.response.id);
      else if (t === "response.output_text.delta") view.text(data.delta);
      else if (t === "response.reasoning_text.delta" || t === "response.reasoning_summary_text.delta") view.reasoning(data.delta);
      else if (t === "response.output_item.added" && data.item.type === "function_call") {
        calls.set(data.output_index, data.item.call_id);
        view.toolStart(data.item.call_id, data.item.name);
      } else if (t === "response.function_call_arguments.delta") view.toolArgs(calls.get(data.output_index), data.delta);
      else if (t === "response.output_item.done" && data.item.type === "function_call") view.toolDone(data.item.call_id, data.item.name, data.item.arguments);
      else if (t === "response.completed" || t === "response.incomplete") {
        const u = data.response.usage || {};
        view.id(data.response.id);
        view.usage({ input: u.input_tokens, output: u.output_tokens, cached: (u.input_tokens_details || {}).cached_tokens });
        view.status(data.response.status);
      } else if (t === "response.failed") view.error((data.response.error || {}).message || "the response failed");
      else if (t === "error") view.error(data.message || (data.error || {}).message || "error");
    };
  }
  if (api === "chat") {
    const calls = new Map(); // index -> {id, name, args}
    return ({ data }) => {
      if (data === "[DONE]") { for (const c of calls.values()) view.toolDone(c.id, c.name, c.args); calls.clear(); return; }
      if (!data || typeof data !== "object") return;
      if (data.error) { view.error(data.error.message || "error"); return; }
      if (data.id) view.id(data.id);
      const choice = (data.choices || [])[0];
      if (choice) {
        const d = choice.delta || {};
        if (d.reasoning_content) view.reasoning(d.reasoning_content);
        if (d.content) view.text(d.content);
        for (const tc of d.tool_calls || []) {
          let c = calls.get(tc.index);
          if (!c) { c = { id: tc.id, name: (tc.function || {}).name, args: "" }; calls.set(tc.index, c); view.toolStart(c.id, c.name); }
          const piece = (tc.function || {}).arguments || "";
          if (piece) { c.args += piece; view.toolArgs(c.id, piece); }
        }
        if (choice.finish_reason) view.status(choice.finish_reason);
      }
      if (data.usage) view.usage({ input: data.usage.prompt_tokens, output: data.usage.completion_tokens, cached: (data.usage.prompt_tokens_details || {}).cached_tokens });
    };
  }
  const blocks = new Map(); // index -> {type, id, name, args}
  let usage = { input: 0, output: 0, cached: 0 };
  return ({ event, data }) => {
    if (!data || typeof data !== "object") return;
    const t = data.type || event;
    if (t === "message_start") {
      view.id(data.message.id);
      const u = data.message.usage || {};
      usage = { input: (u.input_tokens || 0) + (u.cache_read_input_tokens || 0), output: u.output_tokens || 0, cached: u.cache_read_input_tokens || 0 };
    } else if (t === "content_block_start") {
      const b = data.content_block;
      blocks.set(data.index, { type: b.type, id: b.id, name: b.name, args: "" });
      if (b.type === "tool_use") view.toolStart(b.id, b.name);
    } else if (t === "content_block_delta") {
      const d = data.delta;
      if (d.type === "text_delta") view.text(d.text);
      else if (d.type === "thinking_delta") view.reasoning(d.thinking);
      else if (d.type === "input_json_delta") { const b = blocks.get(data.index); b.args += d.partial_json; view.toolArgs(b.id, d.partial_json); }
    } else if (t === "content_block_stop") {
      const b = blocks.get(data.index);
      if (b && b.type === "tool_use") view.toolDone(b.id, b.name, b.args || "{}");
    } else if (t === "message_delta") {
      if (data.usage && data.usage.output_tokens !== undefined) usage.output = data.usage.output_tokens;
      if (data.delta && data.delta.stop_reason) view.status(data.delta.stop_reason);
    } else if (t === "message_stop") view.usage(usage);
    else if (t === "error") view.error((data.error || {}).message || "error");
  };
}

/** Conversation items (GET /v1/conversations/{id}/items) -> neutral entries. */
export function entriesFromItems(items) {
  const entries = [];
  let turn = null;
  const text = (content) => (typeof content === "string" ? content : (content || []).map((p) => p.text || "").join(""));
  for (const item of items) {
    if (item.type === "message" && item.role === "user") { entries.push({ kind: "user", text: text(item.content) }); turn = null; }
    else if (item.type === "message" && item.role === "assistant") {
      if (!turn) { turn = { kind: "assistant", text: "", reasoning: "", calls: [] }; entries.push(turn); }
      turn.text += text(item.content);
    } else if (item.type === "reasoning") {
      if (!turn) { turn = { kind: "assistant", text: "", reasoning: "", calls: [] }; entries.push(turn); }
      turn.reasoning += (item.content || []).map((p) => p.text || "").join("");
    } else if (item.type === "function_call") {
      if (!turn) { turn = { kind: "assistant", text: "", reasoning: "", calls: [] }; entries.push(turn); }
      turn.calls.push({ id: item.call_id, name: item.name, args: item.arguments, answered: true });
    } else if (item.type === "function_call_output") { entries.push({ kind: "tool_result", id: item.call_id, output: typeof item.output === "string" ? item.output : JSON.stringify(item.output) }); turn = null; }
  }
  return entries;
}
