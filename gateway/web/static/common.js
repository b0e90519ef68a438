// Helpers both pages share: building DOM nodes (never innerHTML: model output and server data are
// text, not markup) and reading a server-sent event stream from fetch().

/** el("div", {class: "x", "data-testid": "y"}, child, "text") -> HTMLElement */
export function el(tag, attrs = {}, ...children) {
  const svg = ["svg", "rect", "line", "text", "g", "title", "path", "polyline"].includes(tag);
  const node = svg ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

export const $ = (id) => document.getElementById(id);

/** The message of an error answer, in any of the three APIs' shapes (or plain text). */
export async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    const err = body.error || body;
    return `${response.status}: ${err.message || text}`;
  } catch {
    return `${response.status}: ${text.trim().slice(0, 300) || response.statusText}`;
  }
}

/**
 * Read an SSE body event by event: onEvent({event, data}) with data parsed as JSON (or the raw
 * string, e.g. "[DONE]"). Lines may be split anywhere across chunks; events end at a blank line.
 */
export async function readSSE(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let event = null;
  let data = [];
  const dispatch = () => {
    if (data.length) {
      const raw = data.join("\n");
      let parsed = raw;
      try { parsed = JSON.parse(raw); } catch { /* "[DONE]" and the like */ }
      onEvent({ event, data: parsed });
    }
    event = null;
    data = [];
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n/)) >= 0) {
      const line = buffer.slice(0, cut);
      buffer = buffer.slice(cut + (buffer[cut] === "\r" ? 2 : 1));
      if (line === "") dispatch();
      else if (line.startsWith(":")) continue;
      else if (line.startsWith("event:")) event = line.slice(6).trim();
      else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
    }
  }
  if (buffer.startsWith("data:")) data.push(buffer.slice(5).replace(/^ /, ""));
  dispatch();
}

export function fmt(n, digits = 0) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  return Number(n).toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: digits });
}
