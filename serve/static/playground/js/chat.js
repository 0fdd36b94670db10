// Chat tab: /v1/chat/completions streamed over SSE, rendered as markdown while it arrives; images attach to
// models with the vision-chat task. Shows the time to first token and the token usage of each reply.
import { isAbort, streamEvents } from "./api.js";
import { $, el, readAsDataUrl } from "./dom.js";
import { renderMarkdown } from "./markdown.js";

const history = []; // the conversation as the API takes it: {role, content}
let attachments = []; // data: URLs of the images the next message carries
let running = null; // the AbortController of the reply in flight
let visionModels = new Set();

function setRunning(controller) {
  running = controller;
  $("chat-send").disabled = controller !== null;
  $("chat-stop").disabled = controller === null;
  $("chat-regenerate").disabled = controller !== null || !history.some((m) => m.role === "assistant");
}

function scrollDown() {
  const log = $("chat-log");
  log.scrollTop = log.scrollHeight;
}

function userBubble(text, images) {
  const bubble = el("li", { class: "user" }, ...images.map((url) => el("img", { src: url, alt: "attached image" })));
  bubble.append(el("div", {}, text));
  return bubble;
}

function userContent(text, images) {
  if (!images.length) return text;
  return [...images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text }];
}

function refreshAttachControl() {
  const vision = visionModels.has($("chat-model").value);
  const input = $("chat-attach");
  input.disabled = !vision;
  input.parentElement.setAttribute("aria-disabled", String(!vision));
  input.parentElement.title = vision ? "Attach images" : "This model takes no images";
  if (!vision) setAttachments([]);
}

function setAttachments(urls) {
  attachments = urls;
  $("chat-attachments").replaceChildren(...urls.map((url) => el("img", { src: url, alt: "image to send" })));
}

function stats({ ttft, seconds, usage, finish }) {
  const parts = [];
  if (ttft !== null) parts.push(`first token ${Math.round(ttft)} ms`);
  if (usage) {
    parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
    if (seconds > 0) parts.push(`${(usage.completion_tokens / seconds).toFixed(1)} tokens/s`);
  }
  if (finish) parts.push(`finish: ${finish}`);
  return parts.join(" · ");
}

// Streams one assistant reply to the conversation as it stands.
async function reply() {
  const controller = new AbortController();
  setRunning(controller);
  const bubble = el("li", { class: "assistant", "data-state": "streaming" });
  $("chat-log").append(bubble);
  const started = performance.now();
  const seen = { ttft: null, seconds: 0, usage: null, finish: null };
  let text = "";
  let frame = 0;
  const body = {
    model: $("chat-model").value, messages: history, stream: true, stream_options: { include_usage: true },
    max_tokens: Number($("chat-max-tokens").value) || undefined, temperature: Number($("chat-temperature").value),
  };
  try {
    for await (const { data } of streamEvents("/v1/chat/completions", body, controller.signal)) {
      if (data.error) throw new Error(data.error.message || "the server reported an error");
      const choice = data.choices?.[0];
      if (choice?.delta?.content) {
        seen.ttft ??= performance.now() - started;
        text += choice.delta.content;
        frame ||= requestAnimationFrame(() => { frame = 0; bubble.innerHTML = renderMarkdown(text); scrollDown(); });
      }
      if (choice?.finish_reason) seen.finish = choice.finish_reason;
      if (data.usage) seen.usage = data.usage;
    }
  } catch (error) {
    if (!isAbort(error)) $("chat-log").append(el("li", { class: "error" }, `Failed: ${error.message}`));
    else seen.finish = "stopped";
  } finally {
    cancelAnimationFrame(frame);
    bubble.innerHTML = renderMarkdown(text);
    bubble.dataset.state = "done";
    if (text) history.push({ role: "assistant", content: text });
    else bubble.remove();
    seen.seconds = (performance.now() - started - (seen.ttft ?? 0)) / 1000;
    $("chat-stats").textContent = stats(seen);
    setRunning(null);
    scrollDown();
  }
}

async function send(event) {
  event.preventDefault();
  const input = $("chat-input");
  const text = input.value.trim();
  if (!text || running) return;
  history.push({ role: "user", content: userContent(text, attachments) });
  $("chat-log").append(userBubble(text, attachments));
  input.value = "";
  setAttachments([]);
  await reply();
}

async function regenerate() {
  if (running || history.at(-1)?.role !== "assistant") return;
  history.pop();
  [...$("chat-log").querySelectorAll("li.assistant")].at(-1)?.remove();
  await reply();
}

function clear() {
  running?.abort();
  history.length = 0;
  $("chat-log").replaceChildren();
  $("chat-stats").textContent = "";
  setRunning(null);
}

export function setChatModels(models) {
  const chatModels = models.filter((m) => (m.tasks || []).some((t) => t === "chat" || t === "vision-chat"));
  visionModels = new Set(chatModels.filter((m) => m.tasks.includes("vision-chat")).map((m) => m.id));
  $("chat-model").replaceChildren(...chatModels.map((m) => el("option", { value: m.id }, m.id)));
  $("chat-send").disabled = !chatModels.length;
  refreshAttachControl();
}

export function initChat() {
  $("chat-form").addEventListener("submit", send);
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("chat-stop").addEventListener("click", () => running?.abort());
  $("chat-regenerate").addEventListener("click", regenerate);
  $("chat-clear").addEventListener("click", clear);
  $("chat-model").addEventListener("change", refreshAttachControl);
  $("chat-attach").addEventListener("change", async (event) => {
    const files = [...event.target.files];
    event.target.value = "";
    setAttachments([...attachments, ...await Promise.all(files.map(readAsDataUrl))]);
  });
}
