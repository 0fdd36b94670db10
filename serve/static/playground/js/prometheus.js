// Prometheus text exposition (what /metrics answers) as samples {name, labels, value}.
const SAMPLE = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /(\w+)="((?:[^"\\]|\\.)*)"/g;

function unescape(value) {
  return value.replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
}

export function parsePrometheus(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = line.match(SAMPLE);
    if (!match) continue;
    const labels = {};
    for (const [, name, value] of (match[2] || "").matchAll(LABEL)) labels[name] = unescape(value);
    samples.push({ name: match[1], labels, value: Number(match[3]) });
  }
  return samples;
}

// Sums of `name`'s samples grouped by the value of label `by` (a Map, in the order first seen).
export function sumBy(samples, name, by) {
  const out = new Map();
  for (const s of samples) {
    if (s.name === name) out.set(s.labels[by], (out.get(s.labels[by]) || 0) + s.value);
  }
  return out;
}

export function total(samples, name) {
  return samples.filter((s) => s.name === name).reduce((sum, s) => sum + s.value, 0);
}
