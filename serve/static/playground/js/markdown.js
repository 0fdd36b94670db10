// A small, safe markdown renderer for chat replies: the text is HTML-escaped first, then a few constructs
// (code fences, headings, lists, quotes, code spans, bold, italics, http(s) links) become tags. No raw HTML
// passes through, and links can only be http(s).
const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

function emphasis(escaped) {
  return escaped
    .replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>')
    .replace(/\*\*(.+?)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*\w])\*([^*\s][^*]*?)\*(?!\w)/g, "$1<em>$2</em>");
}

// One line's inline markup; code spans are cut out first so nothing inside them is interpreted.
export function inline(text) {
  return text.split(/(`[^`]+`)/).map((part) =>
    part.length > 2 && part.startsWith("`") && part.endsWith("`")
      ? `<code>${escapeHtml(part.slice(1, -1))}</code>`
      : emphasis(escapeHtml(part))).join("");
}

const BULLET = /^\s*[-*+]\s+/;
const NUMBERED = /^\s*\d+[.)]\s+/;
const QUOTE = /^>\s?/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const FENCE = /^```/;

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || BULLET.test(line) || NUMBERED.test(line) || QUOTE.test(line);
}

// Consecutive lines from `i` that match `pattern`, with the pattern removed.
function run(lines, i, pattern) {
  const items = [];
  while (i < lines.length && pattern.test(lines[i])) items.push(lines[i++].replace(pattern, ""));
  return items;
}

export function renderMarkdown(text) {
  const lines = text.split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (FENCE.test(line)) { // an unclosed fence (a reply still streaming) runs to the end
      const code = [];
      for (i++; i < lines.length && !FENCE.test(lines[i]); i++) code.push(lines[i]);
      i++;
      out.push(`<pre><code>${escapeHtml(code.join("\n"))}</code></pre>`);
    } else if (HEADING.test(line)) {
      const [, hashes, title] = line.match(HEADING);
      const level = Math.min(hashes.length + 2, 6); // the page's own h1/h2 stay above a reply's headings
      out.push(`<h${level}>${inline(title)}</h${level}>`);
      i++;
    } else if (BULLET.test(line) || NUMBERED.test(line)) {
      const pattern = BULLET.test(line) ? BULLET : NUMBERED;
      const items = run(lines, i, pattern);
      i += items.length;
      const tag = pattern === BULLET ? "ul" : "ol";
      out.push(`<${tag}>${items.map((item) => `<li>${inline(item)}</li>`).join("")}</${tag}>`);
    } else if (QUOTE.test(line)) {
      const quoted = run(lines, i, QUOTE);
      i += quoted.length;
      out.push(`<blockquote>${quoted.map(inline).join("<br>")}</blockquote>`);
    } else if (!line.trim()) {
      i++;
    } else {
      const paragraph = [];
      while (i < lines.length && lines[i].trim() && !startsBlock(lines[i])) paragraph.push(lines[i++]);
      out.push(`<p>${paragraph.map(inline).join("<br>")}</p>`);
    }
  }
  return out.join("");
}
