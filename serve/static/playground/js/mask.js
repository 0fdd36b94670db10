// The inpainting mask: strokes painted with the pointer on a canvas laid over the source image. The canvas has the
// image's own pixel size (CSS scales it to the preview), so the mask sent matches the image pixel for pixel.
const STROKE = "rgb(255, 64, 64)"; // shown at half opacity by the stylesheet; only its coverage matters

export class MaskPainter {
  constructor(canvas, brush) {
    this.canvas = canvas;
    this.brush = brush; // a range input: the brush diameter in screen pixels
    this.last = null; // the previous point of the stroke being drawn, in canvas pixels
    this.painted = false;
    canvas.addEventListener("pointerdown", (event) => this.start(event));
    canvas.addEventListener("pointermove", (event) => this.move(event));
    for (const kind of ["pointerup", "pointercancel"]) canvas.addEventListener(kind, () => { this.last = null; });
  }

  load(width, height) {
    this.canvas.width = width;
    this.canvas.height = height;
    this.clear();
  }

  clear() {
    this.canvas.getContext("2d").clearRect(0, 0, this.canvas.width, this.canvas.height);
    this.painted = false;
  }

  // Screen coordinates -> canvas pixels, and the brush's diameter at that scale.
  point(event) {
    const box = this.canvas.getBoundingClientRect();
    const scale = this.canvas.width / box.width;
    return { x: (event.clientX - box.left) * scale, y: (event.clientY - box.top) * scale,
      width: Number(this.brush.value) * scale };
  }

  start(event) {
    event.preventDefault();
    this.canvas.setPointerCapture(event.pointerId);
    this.last = this.point(event);
    this.stroke(this.last, this.last);
  }

  move(event) {
    if (!this.last) return;
    const next = this.point(event);
    this.stroke(this.last, next);
    this.last = next;
  }

  stroke(from, to) {
    const ctx = this.canvas.getContext("2d");
    Object.assign(ctx, { strokeStyle: STROKE, lineWidth: to.width, lineCap: "round", lineJoin: "round" });
    ctx.beginPath();
    ctx.moveTo(from.x, from.y);
    ctx.lineTo(to.x + 0.01, to.y); // a click is a zero-length line, which round caps still draw as a dot
    ctx.stroke();
    this.painted = true;
  }

  // The mask in OpenAI's convention: a PNG of the image's size, opaque where the image stays and transparent where
  // it was painted (to be repainted).
  toBlob() {
    const out = document.createElement("canvas");
    out.width = this.canvas.width;
    out.height = this.canvas.height;
    const ctx = out.getContext("2d");
    ctx.fillStyle = "#000";
    ctx.fillRect(0, 0, out.width, out.height);
    ctx.globalCompositeOperation = "destination-out"; // the strokes cut the opaque fill away
    ctx.drawImage(this.canvas, 0, 0);
    return new Promise((resolve) => out.toBlob(resolve, "image/png"));
  }
}
