// Video tab, second half: realtime img2img from the camera over WS /v1/realtime/video.
// Camera -> <video> -> canvas at the session's size -> JPEG -> one binary frame per capture, sent at a bounded
// rate; output JPEG frames are drawn beside the input. Output is paced by credits: the session starts with a few,
// and each frame drawn gives one back, so the server never computes frames this page has not room to show.
import { apiKey } from "./api.js";
import { $, el } from "./dom.js";

const CREDITS = 4; // output frames the server may have in flight towards us
const DEADLINE_MS = 2000; // a frame older than this is dropped by the server (CPU demo models are slow)
const JPEG_QUALITY = 0.8;
const ACK_EVERY = 20; // acknowledge server events now and then, so the session's resume journal is trimmed
const FPS_WINDOW_MS = 2000; // the output fps is measured over this much recent time
let live = null; // the running session: {socket, stream, timer, ...}

// -- the wire: binary frames are a 4-byte big-endian header length, a JSON header, then the payload -----------
function packFrame(header, payload) {
  const head = new TextEncoder().encode(JSON.stringify(header));
  const out = new Uint8Array(4 + head.length + payload.byteLength);
  new DataView(out.buffer).setUint32(0, head.length);
  out.set(head, 4);
  out.set(new Uint8Array(payload), 4 + head.length);
  return out;
}

function unpackFrame(buffer) {
  const size = new DataView(buffer).getUint32(0);
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 4, size)));
  return { header, payload: new Uint8Array(buffer, 4 + size) };
}

// Browsers cannot set WebSocket headers: the key rides as a subprotocol (as OpenAI's Realtime API), beside a plain
// one for the server to answer with.
function openSocket() {
  const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/realtime/video`;
  const key = apiKey();
  const socket = new WebSocket(url, key ? ["realtime", `openai-insecure-api-key.${key}`] : ["realtime"]);
  socket.binaryType = "arraybuffer";
  return socket;
}

function status(text) {
  $("live-status").textContent = text;
}

function setRunning(running) {
  $("live-start").disabled = running;
  $("live-stop").disabled = !running;
  for (const id of ["live-model", "live-size"]) $(id).disabled = running; // fixed for a session's life
}

function sessionSettings() {
  const settings = { mode: "img2img", model: $("live-model").value, prompt: $("live-prompt").value,
    strength: Number($("live-strength").value), steps: Number($("live-steps").value) || 4,
    output_format: "jpeg", credits: CREDITS, frame_deadline_ms: DEADLINE_MS };
  if ($("live-size").value) settings.size = $("live-size").value;
  return settings;
}

function send(event) {
  if (live?.socket.readyState === WebSocket.OPEN) live.socket.send(JSON.stringify(event));
}

// -- input: one camera frame, centre-cropped to the session's aspect, as a JPEG binary frame ------------------
function drawCover(context, source, width, height) {
  const sw = source.videoWidth, sh = source.videoHeight;
  const scale = Math.max(width / sw, height / sh);
  const cw = width / scale, ch = height / scale;
  context.drawImage(source, (sw - cw) / 2, (sh - ch) / 2, cw, ch, 0, 0, width, height);
}

async function captureFrame() {
  const { capture, socket } = live;
  const camera = $("live-input");
  // One at a time, and only while the socket keeps up: a slow link must not queue stale frames.
  if (live.encoding || socket.bufferedAmount > 0 || !camera.videoWidth) return;
  live.encoding = true;
  try {
    drawCover(capture.getContext("2d"), camera, capture.width, capture.height);
    const blob = await new Promise((resolve) => capture.toBlob(resolve, "image/jpeg", JPEG_QUALITY));
    if (!blob || live?.socket !== socket || socket.readyState !== WebSocket.OPEN) return;
    const seq = live.seq++;
    const header = { seq, frame_idx: seq, content_type: "image/jpeg", capture_ts_ms: Date.now(),
      pts_ms: Math.round(performance.now() - live.t0) };
    socket.send(packFrame(header, await blob.arrayBuffer()));
  } finally {
    if (live) live.encoding = false;
  }
}

// Frames are captured at the session's size, so the server never scales them (and overload may shrink it).
function setCaptureSize(size) {
  const [width, height] = size.split("x").map(Number);
  live.capture.width = width;
  live.capture.height = height;
}

function startCapture(size) {
  setCaptureSize(size);
  const rate = Math.min(30, Math.max(1, Number($("live-rate").value) || 8));
  live.timer = setInterval(captureFrame, 1000 / rate);
  status(`Running: ${size}, up to ${rate} frames/s sent.`);
}

// -- output: draw a frame, measure fps and latency, give its credit back -------------------------------------
function showStats() {
  const now = performance.now();
  live.arrivals = live.arrivals.filter((t) => now - t <= FPS_WINDOW_MS);
  const span = live.arrivals.length > 1 ? (live.arrivals.at(-1) - live.arrivals[0]) / 1000 : 0;
  if (span > 0) $("live-fps").textContent = ((live.arrivals.length - 1) / span).toFixed(1);
  $("live-frames").textContent = String(live.frames);
  $("live-dropped").textContent = String(live.dropped);
}

async function onOutput(buffer) {
  const { header, payload } = unpackFrame(buffer);
  const bitmap = await createImageBitmap(new Blob([payload], { type: header.content_type || "image/jpeg" }));
  if (!live) return bitmap.close(); // stopped meanwhile
  const canvas = $("live-output");
  canvas.width = bitmap.width;
  canvas.height = bitmap.height;
  canvas.getContext("2d").drawImage(bitmap, 0, 0);
  bitmap.close();
  live.frames += 1;
  live.arrivals.push(performance.now());
  if (header.capture_ts_ms) $("live-latency").textContent = `${Math.round(Date.now() - header.capture_ts_ms)} ms`;
  showStats();
  send({ type: "credit", n: 1 }); // drawn: room for one more
  acknowledge(header.server_event_seq);
}

function acknowledge(seq) {
  if (!live || seq === undefined || seq - live.acked < ACK_EVERY) return;
  live.acked = seq;
  send({ type: "session.event_ack", server_event_seq: seq });
}

function onEvent(event) {
  if (event.type === "session.created") {
    live.created = true;
    startCapture(event.session.size);
  } else if (event.type === "frame.dropped") {
    live.dropped += 1; // superseded by a newer frame, or too late
  } else if (event.type === "session.updated") {
    setCaptureSize(event.session.size);
    if (event.reason === "overload") status(`The server is behind: ${event.degraded?.knob ?? "quality"} lowered.`);
    if (event.reason === "recovered") status(`The server caught up: ${event.restored?.knob ?? "quality"} restored.`);
  } else if (event.type === "error") {
    const message = `Server: ${event.error?.message ?? "error"}`;
    if (!live.created) return stop(message); // the session was refused: nothing will come
    status(message);
  } else if (event.type === "session.closed") {
    status(`Session closed: ${event.reason}.`);
  }
  acknowledge(event.server_event_seq);
}

function onMessage(message) {
  if (!live) return;
  if (typeof message.data === "string") onEvent(JSON.parse(message.data));
  else onOutput(message.data).catch((error) => status(`A frame could not be shown: ${error.message}`));
}

// -- start / stop ------------------------------------------------------------------------------------------
async function start(event) {
  event.preventDefault();
  if (live) return;
  $("live-start").disabled = true; // Stop comes once there is something to stop
  status("Asking for the camera…");
  const camera = $("live-input");
  let stream = null;
  let socket;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ video: { width: 640, height: 480 }, audio: false });
    camera.srcObject = stream;
    await camera.play();
    socket = openSocket(); // throws on a key with characters a subprotocol cannot carry
  } catch (error) {
    stream?.getTracks().forEach((track) => track.stop());
    camera.srcObject = null;
    $("live-start").disabled = false;
    return status(`Cannot start: ${error.message}`);
  }
  live = { socket, stream, timer: null, capture: el("canvas"), encoding: false, seq: 0, t0: performance.now(),
    created: false, frames: 0, dropped: 0, acked: 0, arrivals: [] };
  setRunning(true);
  for (const id of ["live-fps", "live-latency"]) $(id).textContent = "—";
  for (const id of ["live-frames", "live-dropped"]) $(id).textContent = "0";
  status("Connecting…");
  socket.addEventListener("open", () => send({ type: "session.update", session: sessionSettings() }));
  socket.addEventListener("message", onMessage);
  socket.addEventListener("close", (closed) => stop(closed.code === 1000 ? null : `Disconnected (${closed.code}).`));
}

function stop(reason = "Stopped.") {
  if (!live) return;
  const { socket, stream, timer } = live;
  live = null;
  clearInterval(timer);
  stream.getTracks().forEach((track) => track.stop());
  $("live-input").srcObject = null;
  if (socket.readyState <= WebSocket.OPEN) socket.close(1000, "stopped"); // 1000: the session ends now
  setRunning(false);
  if (reason) status(reason);
}

// Prompt and strength apply to the running session from its next frame.
function onControl(kind, payload) {
  if (live) send({ type: "control", kind, payload });
}

export function setLiveModels(models) {
  // A model serves realtime img2img when it lists both the realtime-video and the image-to-image task.
  const usable = models.filter((m) => ["realtime-video", "image-to-image"].every((t) => (m.tasks || []).includes(t)));
  $("live-model").replaceChildren(...usable.map((m) => el("option", { value: m.id }, m.id)));
  if (!usable.length) status("This server has no realtime img2img model.");
  $("live-start").disabled = !usable.length || live !== null;
}

export function initLive() {
  $("live-form").addEventListener("submit", start);
  $("live-stop").addEventListener("click", () => stop());
  $("live-strength").addEventListener("input", () => {
    $("live-strength-value").textContent = $("live-strength").value;
  });
  $("live-strength").addEventListener("change", () => onControl("params", { strength: Number($("live-strength").value) }));
  $("live-steps").addEventListener("change", () => onControl("params", { steps: Number($("live-steps").value) || 4 }));
  $("live-prompt").addEventListener("change", () => onControl("prompt", { prompt: $("live-prompt").value }));
  window.addEventListener("pagehide", () => stop()); // the camera light goes off with the page
}
