// Images tab: a text-to-image request, or an edit of an uploaded image (inpainting where a mask was painted),
// streamed over SSE. Progress events move the bar, partial images replace the live preview (about PREVIEWS of
// them through mmserve's per-step `preview_every`; 3, OpenAI's cap, where a model runs a plain diffusers pipeline),
// completed images join the gallery with their parameters.
import { isAbort, streamEvents } from "./api.js";
import { $, el, imageUrl } from "./dom.js";
import { MaskPainter } from "./mask.js";

const PREVIEWS = 8; // partial images a request asks for, when the model takes preview_every
const OPENAI_PREVIEWS = 3; // partial_images: OpenAI caps it at 3
const GUESSED_STEPS = 30; // a model's default step count is not listed: preview_every is sized for this many
const stepwise = new Set(); // models that take preview_every (their graph runs the denoise loop step by step)
let running = null; // the AbortController of the request in flight
let partialUrl = null; // the blob: URL of the preview on show, while it is a partial image (results stay)
let source = null; // the File to edit; null: text-to-image
let sourceUrl = null;
let painter = null;
const EDIT_TASKS = ["image-to-image", "inpainting"];

function numberField(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

// The request body from the form; empty fields are left to the model's defaults.
function requestBody() {
  const body = {
    model: $("image-model").value,
    prompt: $("image-prompt").value,
    size: $("image-size").value,
    n: numberField("image-n") ?? 1,
    stream: true,
  };
  const negative = $("image-negative").value.trim();
  if (negative) body.negative_prompt = negative;
  const optional = { num_inference_steps: "image-steps", guidance_scale: "image-guidance", seed: "image-seed" };
  for (const [field, id] of Object.entries(optional)) {
    const value = numberField(id);
    if (value !== undefined) body[field] = value;
  }
  if (stepwise.has(body.model)) {
    body.preview_every = Math.max(1, Math.ceil((numberField("image-steps") ?? GUESSED_STEPS) / PREVIEWS));
  } else {
    body.partial_images = OPENAI_PREVIEWS;
  }
  const strength = numberField("image-strength");
  if (source && strength !== undefined) body.strength = strength;
  return body;
}

// An edit goes as multipart, as OpenAI's /v1/images/edits takes it: the fields, the image file and the mask.
async function editForm(body) {
  const form = new FormData();
  for (const [field, value] of Object.entries(body)) form.append(field, String(value));
  form.append("image", source, source.name);
  if (painter.painted) form.append("mask", await painter.toBlob(), "mask.png");
  return form;
}

function editKind() {
  if (!source) return "—";
  return painter.painted ? "inpaint" : "image-to-image";
}

function setRunning(controller) {
  running = controller;
  $("image-generate").disabled = controller !== null;
  $("image-cancel").disabled = controller === null;
}

function status(text) {
  $("image-status").textContent = text;
}

function showPreview(url, partial) {
  if (partialUrl) URL.revokeObjectURL(partialUrl);
  partialUrl = partial ? url : null;
  const preview = $("image-preview");
  preview.src = url;
  preview.hidden = false;
}

function galleryItem(url, body, data, seconds) {
  const format = data.output_format || "png";
  const params = [["model", body.model], ["prompt", body.prompt], ["negative", body.negative_prompt ?? "—"],
    ["size", data.size], ["steps", body.num_inference_steps ?? "default"],
    ["guidance", body.guidance_scale ?? "default"], ["edit", body.edit], ["strength", body.strength ?? "default"],
    ["seed", data.seed], ["time", `${seconds.toFixed(1)} s`]];
  const list = el("dl");
  for (const [name, value] of params) list.append(el("dt", {}, name), el("dd", {}, String(value)));
  const name = `mmserve-${body.model}-${data.seed}-${data.image_index}.${format}`.replace(/[^\w.-]+/g, "_");
  return el("li", { class: "gallery-item" },
    el("img", { src: url, alt: body.prompt }), list,
    el("a", { href: url, download: name, class: "download" }, "Download"));
}

async function generate(event) {
  event.preventDefault();
  const body = requestBody();
  const [path, sent] = source ? ["/v1/images/edits", await editForm(body)] : ["/v1/images/generations", body];
  const shown = { ...body, edit: editKind() }; // the gallery's copy of the parameters
  const controller = new AbortController();
  setRunning(controller);
  const progress = $("image-progress");
  progress.value = 0;
  const started = performance.now();
  let previews = 0;
  status("Waiting for the server…");
  try {
    for await (const { event: kind, data } of streamEvents(path, sent, controller.signal)) {
      const seconds = (performance.now() - started) / 1000;
      if (kind.endsWith(".progress")) {
        progress.value = data.step / data.total;
        status(`Step ${data.step} of ${data.total} · ${seconds.toFixed(1)} s`);
      } else if (kind.endsWith(".partial_image")) {
        previews += 1;
        showPreview(imageUrl(data.b64_json, data.output_format), true);
      } else if (kind.endsWith(".completed")) {
        const url = imageUrl(data.b64_json, data.output_format);
        showPreview(url, false);
        $("gallery").prepend(galleryItem(url, shown, data, seconds));
      } else if (kind === "error") {
        throw new Error(data.error?.message || "the server reported an error");
      }
    }
    progress.value = 1;
    status(`Done in ${((performance.now() - started) / 1000).toFixed(1)} s (${previews} previews).`);
  } catch (error) {
    status(isAbort(error) ? "Cancelled." : `Failed: ${error.message}`);
  } finally {
    setRunning(null);
  }
}

function setSource(file) {
  source = file;
  if (sourceUrl) URL.revokeObjectURL(sourceUrl);
  sourceUrl = file ? URL.createObjectURL(file) : null;
  const preview = $("image-source-preview");
  if (file) preview.src = sourceUrl;
  else {
    preview.removeAttribute("src");
    $("image-source").value = "";
  }
  $("mask-area").hidden = !file;
  $("mask-clear").disabled = !file;
  $("image-source-remove").disabled = !file;
  $("image-generate").textContent = file ? "Edit" : "Generate";
}

export function setImageModels(models) {
  const select = $("image-model");
  const tasks = ["text-to-image", ...EDIT_TASKS];
  const imageModels = models.filter((m) => (m.tasks || []).some((t) => tasks.includes(t)));
  stepwise.clear();
  for (const m of imageModels) if (m.execution === "stage-graph") stepwise.add(m.id);
  select.replaceChildren(...imageModels.map((m) => el("option", { value: m.id }, m.id)));
  if (!imageModels.length) status("This server has no image model.");
  $("image-generate").disabled = !imageModels.length;
}

export function initImages() {
  painter = new MaskPainter($("mask-canvas"), $("mask-brush"));
  $("image-form").addEventListener("submit", generate);
  $("image-cancel").addEventListener("click", () => running?.abort());
  $("image-source").addEventListener("change", (event) => setSource(event.target.files[0] || null));
  $("image-source-preview").addEventListener("load", (event) => {
    painter.load(event.target.naturalWidth, event.target.naturalHeight);
  });
  $("mask-clear").addEventListener("click", () => painter.clear());
  $("image-source-remove").addEventListener("click", () => setSource(null));
}
