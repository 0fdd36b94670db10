// Plays the answers of a voice session. Each audio delta is scheduled on the AudioContext's clock right after the
// one before it, so the answer plays without gaps however unevenly the deltas arrive. The player knows how much of
// the item it plays has been heard: that is what a barge-in truncates the item to, so the conversation keeps only
// what the user actually heard.
const WIRE_RATE = 24000; // pcm16 on the Realtime wire
const START_LEAD_S = 0.05; // a chunk scheduled for "now" would lose its first milliseconds: start a little later

export class Player {
  constructor(context) {
    this.context = context;
    this.item = null; // the item being played: {id, chunks: [{source, start, duration}]}
    this.endTime = 0; // context time at which the last scheduled chunk ends
    this.earlierSeconds = 0; // played by the items before this one
  }

  // Schedules one delta (float samples at 24 kHz) of item `itemId`; returns the context time it starts at.
  play(itemId, samples) {
    if (this.item?.id !== itemId) this.nextItem(itemId);
    const buffer = this.context.createBuffer(1, samples.length, WIRE_RATE); // the context resamples it
    buffer.copyToChannel(samples, 0);
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.context.destination);
    const start = Math.max(this.endTime, this.context.currentTime + START_LEAD_S);
    source.start(start);
    this.item.chunks.push({ source, start, duration: buffer.duration });
    this.endTime = start + buffer.duration;
    return start;
  }

  nextItem(id) {
    this.earlierSeconds += this.heardSeconds();
    this.item = { id, chunks: [] };
  }

  // Seconds of the current item played by `now`: the chunks' played parts (a gap between two late chunks is
  // silence, not the item's audio, so it does not count).
  heardSeconds(now = this.context.currentTime) {
    let heard = 0;
    for (const chunk of this.item?.chunks ?? []) heard += Math.min(Math.max(now - chunk.start, 0), chunk.duration);
    return heard;
  }

  // Seconds of answer audio played in the whole session.
  playedSeconds() {
    return this.earlierSeconds + this.heardSeconds();
  }

  get playing() {
    return this.item !== null && this.context.currentTime < this.endTime;
  }

  // Silences the answer at once. Returns {itemId, heardMs} of the item cut short, or null when nothing was playing.
  stop() {
    if (!this.playing) return null;
    const now = this.context.currentTime;
    const cut = { itemId: this.item.id, heardMs: this.heardSeconds(now) * 1000 };
    for (const chunk of this.item.chunks) {
      chunk.source.stop();
      chunk.duration = Math.min(Math.max(now - chunk.start, 0), chunk.duration); // what it got to play
    }
    this.endTime = now;
    return cut;
  }
}
