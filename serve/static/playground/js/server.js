// Server tab: the models and their tasks, live numbers from /metrics (queue depth, active items, batch sizes,
// request outcomes, cache hits) and the key's video and batch jobs, polled while the tab is open, with small
// sparklines of the last minute or so.
import { getJSON, getText } from "./api.js";
import { $, el } from "./dom.js";
import { parsePrometheus, sumBy, total } from "./prometheus.js";

const POLL_MS = 2000;
const HISTORY = 60; // samples each sparkline keeps
const series = { queued: [], active: [], requests: [], cachehits: [] };
const JOBS = 20; // the newest of each kind
let timer = 0;

function cell(value, numeric = false) {
  return el("td", numeric ? { class: "num" } : {}, String(value));
}

export function setServerModels(models) {
  $("server-models").replaceChildren(...models.map((m) => el("tr", {},
    cell(m.id), cell(m.family ?? "—"), cell((m.tasks || []).join(", ")), cell(m.execution ?? "—"))));
}

// The largest batch a histogram has seen: the smallest bucket bound whose cumulative count is the total.
function largestBatch(samples, stage) {
  const buckets = samples.filter((s) => s.name === "mmserve_stage_batch_size_bucket" && s.labels.stage === stage
    && s.labels.le !== "+Inf");
  const count = samples.find((s) => s.name === "mmserve_stage_batch_size_count" && s.labels.stage === stage);
  if (!count?.value) return "—";
  const full = buckets.filter((b) => b.value >= count.value).map((b) => Number(b.labels.le));
  return full.length ? Math.min(...full) : `> ${Math.max(...buckets.map((b) => Number(b.labels.le)))}`;
}

function stageRows(samples) {
  const depth = sumBy(samples, "mmserve_stage_queue_depth", "stage");
  const active = sumBy(samples, "mmserve_stage_active_items", "stage");
  const batches = sumBy(samples, "mmserve_stage_batch_size_count", "stage");
  const items = sumBy(samples, "mmserve_stage_batch_size_sum", "stage");
  return [...depth.keys()].map((stage) => {
    const count = batches.get(stage) || 0;
    return el("tr", { "data-stage": stage }, cell(stage), cell(depth.get(stage) ?? 0, true),
      cell(active.get(stage) ?? 0, true), cell(count, true),
      cell(count ? (items.get(stage) / count).toFixed(2) : "—", true), cell(largestBatch(samples, stage), true));
  });
}

function outcomeRows(samples) {
  const byModel = new Map();
  for (const s of samples.filter((x) => x.name === "mmserve_graph_requests_total")) {
    const row = byModel.get(s.labels.model) || { ok: 0, cancelled: 0, failed: 0 };
    const kind = s.labels.outcome === "ok" || s.labels.outcome === "cancelled" ? s.labels.outcome : "failed";
    row[kind] += s.value;
    byModel.set(s.labels.model, row);
  }
  return [...byModel].map(([model, r]) => el("tr", { "data-model": model },
    cell(model), cell(r.ok, true), cell(r.cancelled, true), cell(r.failed, true)));
}

function bytes(n) {
  const units = ["B", "KB", "MB", "GB"];
  let i = 0;
  for (; n >= 1024 && i < units.length - 1; i += 1) n /= 1024;
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function cacheRows(samples) {
  const hits = sumBy(samples, "mmserve_cache_hits_total", "cache");
  const misses = sumBy(samples, "mmserve_cache_misses_total", "cache");
  const held = sumBy(samples, "mmserve_cache_bytes", "cache");
  const names = [...new Set([...hits.keys(), ...misses.keys(), ...held.keys()])].sort();
  return names.map((name) => {
    const hit = hits.get(name) || 0;
    const lookups = hit + (misses.get(name) || 0);
    return el("tr", { "data-cache": name }, cell(name), cell(hit, true), cell(misses.get(name) || 0, true),
      cell(lookups ? `${((100 * hit) / lookups).toFixed(0)} %` : "—", true), cell(bytes(held.get(name) || 0), true));
  });
}

// Progress of a job as a user reads it: a video's percent, a batch's lines done of its total.
function jobProgress(job) {
  if (job.object === "batch") {
    const counts = job.request_counts;
    return `${counts.completed + counts.failed} / ${counts.total}`;
  }
  return `${job.progress ?? 0} %`;
}

function jobRow(job) {
  const kind = job.object === "batch" ? "batch" : "video";
  return el("tr", { "data-job": job.id, "data-status": job.status }, cell(kind), cell(job.id),
    cell(job.model ?? job.endpoint ?? "—"), cell(job.status), cell(jobProgress(job), true),
    cell(new Date(job.created_at * 1000).toLocaleTimeString()));
}

async function pollJobs() {
  const [videos, batches] = await Promise.all([getJSON(`/v1/videos?limit=${JOBS}`),
    getJSON(`/v1/batches?limit=${JOBS}`)]);
  const jobs = [...videos.data, ...batches.data].sort((a, b) => b.created_at - a.created_at);
  $("server-jobs").replaceChildren(...jobs.map(jobRow));
  $("server-jobs-empty").hidden = jobs.length > 0;
}

function sparkline(svg, values) {
  const top = Math.max(1, ...values);
  const step = 120 / (HISTORY - 1);
  const offset = HISTORY - values.length;
  const points = values.map((v, i) => `${((offset + i) * step).toFixed(1)},${(29 - (v / top) * 28).toFixed(1)}`);
  svg.replaceChildren(document.createElementNS("http://www.w3.org/2000/svg", "polyline"));
  svg.firstChild.setAttribute("points", points.join(" "));
}

function record(name, value) {
  const values = series[name];
  values.push(value);
  if (values.length > HISTORY) values.shift();
  $(`server-${name}`).textContent = String(value);
  sparkline($(`chart-${name}`), values);
}

async function poll() {
  try {
    const samples = parsePrometheus(await getText("/metrics"));
    record("queued", total(samples, "mmserve_stage_queue_depth"));
    record("active", total(samples, "mmserve_stage_active_items"));
    record("requests", total(samples, "mmserve_graph_requests_total"));
    record("cachehits", total(samples, "mmserve_cache_hits_total"));
    $("server-stages").replaceChildren(...stageRows(samples));
    $("server-outcomes").replaceChildren(...outcomeRows(samples));
    $("server-caches").replaceChildren(...cacheRows(samples));
    await pollJobs();
    $("server-updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    $("server-updated").textContent = `metrics unavailable: ${error.message}`;
  }
  if (timer) timer = setTimeout(poll, POLL_MS);
}

// Polls only while the Server tab is shown.
export function watchServer(visible) {
  if (visible && !timer) {
    timer = -1;
    poll();
  } else if (!visible && timer) {
    clearTimeout(timer);
    timer = 0;
  }
}
