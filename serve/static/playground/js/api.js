// The one place that speaks HTTP: the API key (kept in sessionStorage) as a Bearer header, the API's error
// objects as ApiError, and server-sent events read from a POST's body.
const KEY_ITEM = "mmserve-api-key";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY_ITEM) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_ITEM, key);
  else sessionStorage.removeItem(KEY_ITEM);
}

function headers(json) {
  const out = json ? { "Content-Type": "application/json" } : {};
  const key = apiKey();
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body?.error?.message) message = body.error.message;
  } catch {
    // not a JSON error object: keep the status line
  }
  return new ApiError(response.status, message);
}

// `body`: an object sent as JSON, or FormData sent as multipart (the browser writes its boundary header).
export async function request(path, { method = "GET", body, signal } = {}) {
  const form = body instanceof FormData;
  const init = { method, signal, headers: headers(body !== undefined && !form) };
  if (body !== undefined) init.body = form ? body : JSON.stringify(body);
  const response = await fetch(path, init);
  if (!response.ok) throw await errorOf(response);
  return response;
}

export async function getJSON(path) {
  return (await request(path)).json();
}

export async function getText(path) {
  return (await request(path)).text();
}

// One SSE block ("event: x\ndata: {...}") as {event, data}; null for a comment or keep-alive.
export function parseEvent(block) {
  let event = "message";
  const data = [];
  for (const line of block.split(/\r?\n/)) {
    if (line.startsWith("event:")) event = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
  }
  return data.length ? { event, data: data.join("\n") } : null;
}

// POSTs `body` (JSON or FormData) to `path` and yields its events as {event, data: parsed JSON} until `data: [DONE]`.
// Aborting `signal` ends the request; mmserve cancels the work when the client goes away.
export async function* streamEvents(path, body, signal) {
  const response = await request(path, { method: "POST", body, signal });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const parsed = parseEvent(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
      if (parsed === null) continue;
      if (parsed.data === "[DONE]") return;
      yield { event: parsed.event, data: JSON.parse(parsed.data) };
    }
  }
}

export function isAbort(error) {
  return error?.name === "AbortError";
}
