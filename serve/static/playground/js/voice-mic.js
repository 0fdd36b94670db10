// The microphone of a voice session: getUserMedia -> an AudioWorklet (voice-capture-worklet.js) that hands back
// 24 kHz pcm16 chunks, each with the context time of its first sample (the clock the player schedules on too).
export class Microphone {
  constructor(context, onChunk) {
    this.context = context; // the session's AudioContext, shared with the player
    this.onChunk = onChunk; // ({pcm: Int16Array, time: seconds, level: RMS}) per 50 ms
    this.stream = null;
    this.node = null;
  }

  async start() {
    // The browser's echo cancellation keeps the answer playing from the speakers out of what is sent back.
    this.stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
    await this.context.audioWorklet.addModule("/playground/js/voice-capture-worklet.js");
    const source = this.context.createMediaStreamSource(this.stream);
    this.node = new AudioWorkletNode(this.context, "voice-capture");
    this.node.port.onmessage = (event) => this.onChunk(event.data);
    // Its output is silence; wired to the speakers all the same, because a node nobody pulls may never run.
    source.connect(this.node).connect(this.context.destination);
  }

  stop() {
    this.node?.port.close();
    this.node?.disconnect();
    for (const track of this.stream?.getTracks() ?? []) track.stop();
    this.node = this.stream = null;
  }
}
