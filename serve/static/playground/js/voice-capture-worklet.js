// The microphone's AudioWorklet (loaded by voice-mic.js): the context's samples, at whatever rate the device runs,
// become 24 kHz pcm16 (the Realtime wire's format) in chunks of CHUNK_SAMPLES, posted with their RMS level.
// Runs on the audio thread: no DOM, no imports, nothing allocated per sample.
const WIRE_RATE = 24000;
const CHUNK_SAMPLES = 1200; // 50 ms: small enough for a prompt VAD, large enough not to flood the socket

class CaptureProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.step = sampleRate / WIRE_RATE; // input samples per output sample (2 at 48 kHz)
    this.sum = 0; // weighted input of the output sample being built
    this.filled = 0; // how much of its window (in input samples) the sum covers
    this.chunk = new Int16Array(CHUNK_SAMPLES);
    this.length = 0;
    this.energy = 0; // sum of squares of the chunk, for the level meter
    this.chunkTime = null; // context time of the chunk's first sample
  }

  // Each output sample is the mean of the input over its window [i*step, (i+1)*step), input samples weighted by
  // how much of them falls inside: a box filter that keeps most of what is above 12 kHz from folding into the
  // speech band, exact for 48 kHz (the mean of each pair) and still right for 44.1 kHz or rates under 24 kHz.
  push(x) {
    let left = 1;
    while (left > 0) {
      const take = Math.min(left, this.step - this.filled);
      this.sum += x * take;
      this.filled += take;
      left -= take;
      if (this.filled >= this.step - 1e-9) {
        this.emit(this.sum / this.step);
        this.sum = 0;
        this.filled = 0;
      }
    }
  }

  emit(value) {
    const clipped = Math.max(-1, Math.min(1, value));
    this.chunk[this.length++] = clipped < 0 ? clipped * 0x8000 : clipped * 0x7fff;
    this.energy += clipped * clipped;
    if (this.length === CHUNK_SAMPLES) {
      const pcm = this.chunk;
      this.port.postMessage({ pcm, time: this.chunkTime, level: Math.sqrt(this.energy / CHUNK_SAMPLES) },
        [pcm.buffer]);
      this.chunk = new Int16Array(CHUNK_SAMPLES); // the old one was transferred
      this.length = 0;
      this.energy = 0;
      this.chunkTime = null;
    }
  }

  process(inputs) {
    const channel = inputs[0]?.[0]; // mono: the first channel is enough for speech
    if (channel) {
      // the context time of this quantum's first sample, minus what the chunk already holds from earlier quanta
      this.chunkTime ??= currentTime - (this.length * this.step + this.filled) / sampleRate;
      for (let i = 0; i < channel.length; i++) this.push(channel[i]);
    }
    return true; // keep running while the microphone is connected
  }
}

registerProcessor("voice-capture", CaptureProcessor);
