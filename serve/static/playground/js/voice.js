// Voice tab: a realtime voice session with the microphone (voice-session.js does the talking), drawn as a live
// transcript of both sides, a status line, how much answer audio has played, and each turn's latency
// (end of the user's speech -> first answer audio heard).
import { $, el } from "./dom.js";
import { VoiceSession } from "./voice-session.js";

const VOICE_TASK = "realtime-voice"; // what /v1/models says of a [[voices]] entry
let voicesOf = new Map(); // voice model id -> its voices
let session = null; // the live VoiceSession
let turns = 0;

function setStatus(text) {
  $("voice-status").textContent = text;
}

function setRunning(running) {
  const button = $("voice-toggle");
  button.textContent = running ? "Stop" : "Start";
  button.dataset.running = String(running);
  $("voice-model").disabled = running;
  $("voice-voice").disabled = running;
}

// The transcript row of a conversation item, made the first time the item is heard of (so rows keep the
// order in which the items began, whatever order their text arrives in).
function rowOf(role, itemId) {
  const log = $("voice-log");
  let row = log.querySelector(`li[data-item="${CSS.escape(itemId)}"]`);
  if (!row) {
    row = el("li", { class: `voice-${role}`, "data-item": itemId },
      el("span", { class: "voice-who" }, role === "user" ? "You" : "Assistant"), el("span", { class: "voice-text" }));
    log.append(row);
  }
  return row;
}

function showTranscript(role, itemId, text, final) {
  const row = rowOf(role, itemId);
  const body = row.querySelector(".voice-text");
  body.textContent = final ? text : body.textContent + text;
  if (final) row.dataset.final = "true";
  $("voice-log").scrollTop = $("voice-log").scrollHeight;
}

// The answer was cut short: the history keeps only what was heard, and the row says so.
function showTruncated(itemId, ms) {
  const row = rowOf("assistant", itemId);
  row.dataset.heardMs = String(ms);
  const note = row.querySelector(".voice-cut") ?? row.appendChild(el("small", { class: "voice-cut" }));
  note.textContent = ` (interrupted: ${(ms / 1000).toFixed(1)} s heard)`;
}

function showPlayed(seconds) {
  const played = $("voice-played");
  played.dataset.playedMs = String(Math.round(seconds * 1000));
  played.textContent = `${seconds.toFixed(1)} s of answer audio played`;
}

function showLatency(ms, silenceMs) {
  turns += 1;
  const note = silenceMs ? ` (${silenceMs} ms of it the pause that ends a turn)` : "";
  const item = el("li", { "data-ms": String(Math.round(ms)) }, `Turn ${turns}: `, el("b", {}, `${Math.round(ms)} ms`),
    el("small", {}, note));
  $("voice-latency").append(item);
}

const view = {
  status: setStatus,
  level: (rms) => { $("voice-level").value = Math.min(1, rms * 4); },
  speech: (itemId) => rowOf("user", itemId),
  transcript: showTranscript,
  truncated: showTruncated,
  played: showPlayed,
  latency: showLatency,
  closed(reason) {
    session = null;
    setRunning(false);
    $("voice-level").value = 0;
    setStatus(reason);
  },
};

async function start() {
  setRunning(true);
  session = new VoiceSession({ model: $("voice-model").value, voice: $("voice-voice").value, view });
  try {
    await session.start();
  } catch (error) { // no microphone, permission refused, no AudioWorklet
    session?.stop(`Could not start: ${error.message}`);
  }
}

function toggle() {
  if (session) session.stop();
  else start();
}

function showVoices() {
  const voices = voicesOf.get($("voice-model").value) ?? [];
  $("voice-voice").replaceChildren(...voices.map((v) => el("option", { value: v }, v)));
}

// getUserMedia and AudioWorklet exist only in a secure context: https, or this server at localhost.
function microphoneProblem() {
  if (!window.isSecureContext || !navigator.mediaDevices?.getUserMedia) {
    return "The microphone needs a secure page: open the playground over https or at localhost.";
  }
  return voicesOf.size ? "" : "This server has no voice model (configure a [[voices]] entry).";
}

export function setVoiceModels(models) {
  const voiceModels = models.filter((m) => (m.tasks || []).includes(VOICE_TASK));
  voicesOf = new Map(voiceModels.map((m) => [m.id, m.voices || []]));
  $("voice-model").replaceChildren(...voiceModels.map((m) => el("option", { value: m.id }, m.id)));
  showVoices();
  const problem = microphoneProblem();
  $("voice-toggle").disabled = Boolean(problem);
  if (!session) setStatus(problem || "Press Start and speak; pause to let the assistant answer.");
}

export function initVoice() {
  $("voice-toggle").addEventListener("click", toggle);
  $("voice-model").addEventListener("change", showVoices);
  $("voice-clear").addEventListener("click", () => {
    $("voice-log").replaceChildren();
    $("voice-latency").replaceChildren();
    turns = 0;
  });
}
