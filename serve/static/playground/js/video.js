// Video tab, first half: /v1/videos jobs (OpenAI's videos API). A job is created at once and runs on the server;
// the page polls it for status and progress, then fetches the MP4 with the key (a <video src> cannot send an
// Authorization header) into a blob: URL to play and download. The realtime half is in video-live.js.
import { request } from "./api.js";
import { $, el } from "./dom.js";
import { initLive, setLiveModels } from "./video-live.js";

const POLL_MS = 500;
const FINISHED = new Set(["completed", "failed", "cancelled", "expired"]); // a job in these states stays put
const MP4 = 'video/mp4; codecs="avc1.64001f"'; // what /content serves: H.264 (High, 4:2:0) in MP4
let models = new Map(); // id -> its /v1/models entry, for the video models on offer

function numberField(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

function status(text) {
  $("video-status").textContent = text;
}

// The request's fields from the form; empty ones are left to the model's defaults.
function requestFields() {
  const body = { model: $("video-model").value, prompt: $("video-prompt").value };
  const negative = $("video-negative").value.trim();
  if (negative) body.negative_prompt = negative;
  if ($("video-size").value) body.size = $("video-size").value;
  const optional = { num_frames: "video-frames", fps: "video-fps", num_inference_steps: "video-steps",
    guidance_scale: "video-guidance", seed: "video-seed" };
  for (const [field, id] of Object.entries(optional)) {
    const value = numberField(id);
    if (value !== undefined) body[field] = value;
  }
  return body;
}

// The start image, when one is chosen and the model takes one.
function startImage() {
  const input = $("video-image");
  return input.disabled ? null : input.files[0] ?? null;
}

// With a start image the request is multipart, the image a file part `input_reference` (OpenAI's videos API);
// without one, plain JSON.
function payload(fields, image) {
  if (!image) return fields;
  const form = new FormData();
  for (const [name, value] of Object.entries(fields)) form.append(name, String(value));
  form.append("input_reference", image, image.name);
  return form;
}

// The parameters a job was asked for, as the list shows them.
function parameterList(body, imageName) {
  const params = [["model", body.model], ["prompt", body.prompt], ["negative", body.negative_prompt ?? "—"],
    ["size", body.size ?? "default"], ["frames", body.num_frames ?? "default"], ["fps", body.fps ?? "default"],
    ["steps", body.num_inference_steps ?? "default"], ["guidance", body.guidance_scale ?? "default"],
    ["seed", body.seed ?? "random"], ["image", imageName ?? "— (text-to-video)"]];
  const list = el("dl");
  for (const [name, value] of params) list.append(el("dt", {}, name), el("dd", {}, String(value)));
  return list;
}

// One job's entry: what it was asked, its state, and a button that cancels it while it runs, deletes it after.
function jobItem(job, body, imageName) {
  const state = el("p", { class: "video-state" }, "queued");
  const bar = el("progress", { max: "100", value: "0", "aria-label": `progress of ${job.id}` });
  const button = el("button", { type: "button" }, "Cancel");
  const item = el("li", { class: "video-job", "data-id": job.id, "data-status": job.status },
    el("div", { class: "video-result" }), state, bar, parameterList(body, imageName),
    el("div", { class: "buttons" }, button));
  const entry = { id: job.id, item, state, bar, button, url: null, body, started: performance.now() };
  button.addEventListener("click", () => removeOrCancel(entry));
  return entry;
}

function showJob(entry, job) {
  entry.item.dataset.status = job.status;
  entry.bar.value = job.progress ?? 0;
  const seconds = ((performance.now() - entry.started) / 1000).toFixed(1);
  const error = job.error?.message ? `: ${job.error.message}` : "";
  entry.state.textContent = `${job.status.replace("_", " ")} · ${job.progress ?? 0}% · ${seconds} s${error}`;
  entry.button.textContent = FINISHED.has(job.status) ? "Delete" : "Cancel";
  entry.button.setAttribute("aria-label", `${entry.button.textContent} video ${job.id}`);
}

// Polls until the job is finished; a completed one is then fetched and shown.
async function follow(entry) {
  let last = null;
  for (;;) {
    if (!entry.item.isConnected) return; // deleted meanwhile
    let job;
    try {
      job = await (await request(`/v1/videos/${entry.id}`)).json();
    } catch (error) {
      entry.state.textContent = `Polling failed: ${error.message}`;
      return;
    }
    showJob(entry, job);
    if (job.status !== last) status(`Video ${entry.id}: ${job.status.replace("_", " ")}.`); // said once a change
    last = job.status;
    if (FINISHED.has(job.status)) break;
    await new Promise((resolve) => setTimeout(resolve, POLL_MS));
  }
  if (last !== "completed") return;
  try {
    await showResult(entry);
  } catch (error) {
    entry.state.textContent = `The video could not be fetched: ${error.message}`;
  }
}

function fileName(entry) {
  return `mmserve-${entry.body.model}-${entry.id}.mp4`.replace(/[^\w.-]+/g, "_");
}

// The MP4 as a blob: URL in a <video>, with a download link; a browser that cannot play H.264 (some Chromium
// builds leave it out) gets the link and a note instead of a broken player.
async function showResult(entry) {
  const response = await request(`/v1/videos/${entry.id}/content`);
  entry.url = URL.createObjectURL(await response.blob());
  const place = entry.item.querySelector(".video-result");
  const download = el("a", { href: entry.url, download: fileName(entry), class: "download" }, "Download MP4");
  const unplayable = () => place.replaceChildren(
    el("p", { class: "video-note" }, "This browser cannot play H.264 MP4: download it to watch."), download);
  if (!document.createElement("video").canPlayType(MP4)) return unplayable();
  const player = el("video", { src: entry.url, controls: "", loop: "", muted: "", playsinline: "",
    "aria-label": `video: ${entry.body.prompt}` });
  player.muted = true; // the attribute alone does not mute a video created by script
  player.addEventListener("error", unplayable);
  place.replaceChildren(player, download);
}

async function removeOrCancel(entry) {
  const finished = FINISHED.has(entry.item.dataset.status);
  entry.button.disabled = true;
  try {
    await request(`/v1/videos/${entry.id}`, { method: "DELETE" }); // cancels a running job, deletes a finished one
    if (finished) {
      entry.item.remove();
      if (entry.url) URL.revokeObjectURL(entry.url);
      status(`Video ${entry.id} deleted.`);
    }
  } catch (error) {
    status(`Could not ${finished ? "delete" : "cancel"} ${entry.id}: ${error.message}`);
  } finally {
    entry.button.disabled = false;
  }
}

async function create(event) {
  event.preventDefault();
  const submit = $("video-submit");
  submit.disabled = true;
  try {
    const fields = requestFields();
    const image = startImage();
    const job = await (await request("/v1/videos", { method: "POST", body: payload(fields, image) })).json();
    const entry = jobItem(job, fields, image?.name ?? null);
    $("video-jobs").prepend(entry.item);
    showJob(entry, job);
    follow(entry);
  } catch (error) {
    status(`Failed: ${error.message}`);
  } finally {
    submit.disabled = !models.size;
  }
}

// The start image is offered only to models that take one, and required by those that need one.
function refreshImageField() {
  const tasks = models.get($("video-model").value)?.tasks || [];
  const input = $("video-image");
  input.disabled = !tasks.includes("image-to-video");
  input.required = input.disabled ? false : !tasks.includes("text-to-video");
  $("video-image-label").setAttribute("aria-disabled", String(input.disabled));
}

export function setVideoModels(all) {
  const videoModels = all.filter((m) => (m.tasks || []).some((t) => t === "text-to-video" || t === "image-to-video"));
  models = new Map(videoModels.map((m) => [m.id, m]));
  $("video-model").replaceChildren(...videoModels.map((m) => el("option", { value: m.id }, m.id)));
  if (!videoModels.length) status("This server has no video model.");
  $("video-submit").disabled = !videoModels.length;
  refreshImageField();
  setLiveModels(all);
}

export function initVideo() {
  $("video-form").addEventListener("submit", create);
  $("video-model").addEventListener("change", refreshImageField);
  initLive();
}
