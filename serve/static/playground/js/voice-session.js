// One realtime voice session: WS /v1/realtime (OpenAI Realtime events, realtime/voice/protocol.py), the microphone
// streaming into it, the answers played as they arrive, barge-in, and each turn's latency. It never touches the
// DOM: the Voice tab (voice.js) draws what the `view` callbacks report.
import { apiKey } from "./api.js";
import { base64ToFloat32, pcm16ToBase64 } from "./pcm16.js";
import { Microphone } from "./voice-mic.js";
import { Player } from "./voice-player.js";

const ACK_EVERY_MS = 250; // playback.ack while an answer plays (see ackPlayback)
// A session speaks GA names unless it was asked for beta ones (protocol.py's BETA_NAMES); understand both.
const GA_NAMES = {
  "response.audio.delta": "response.output_audio.delta",
  "response.audio_transcript.delta": "response.output_audio_transcript.delta",
  "response.text.delta": "response.output_text.delta",
};

// The WebSocket address of a voice model on this server.
function socketUrl(model) {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  return `${scheme}://${location.host}/v1/realtime?model=${encodeURIComponent(model)}`;
}

// A browser cannot set headers on a WebSocket: the key travels as a subprotocol (serve/ws.py), next to a plain one
// for the server to pick (the browser fails the handshake unless the server picks one that was offered).
function subprotocols() {
  const key = apiKey();
  return key ? ["realtime", `openai-insecure-api-key.${key}`] : ["realtime"];
}

// turn_detection's silence before the turn ends (GA or beta session object); 0 when the client ends turns itself.
function endSilenceMs(session) {
  const detection = session?.audio?.input?.turn_detection ?? session?.turn_detection;
  return detection?.silence_duration_ms ?? 0;
}

export class VoiceSession {
  // view: {status(text), level(rms), speech(itemId), transcript(role, itemId, text, final), truncated(itemId, ms),
  //        played(seconds), latency(ms, silenceMs), closed(reason)}
  constructor({ model, voice, view }) {
    this.model = model;
    this.voice = voice;
    this.view = view;
    this.socket = null;
    this.context = null; // one AudioContext: capture and playback share its clock (turn latency compares the two)
    this.mic = null;
    this.player = null;
    this.ready = false; // session.created has come: audio may be appended
    this.firstSampleTime = null; // context time of the first sample sent (the server counts from there)
    this.silenceMs = 0; // the end-of-turn silence the server's VAD waits for
    this.turnEnd = null; // context time the last turn's speech ended, until its answer's first audio plays
    this.cutItems = new Set(); // items stopped by a barge-in: a late delta of theirs is not played
    this.answering = false; // an answer's audio is playing, or about to
    this.answerSent = false; // ...and the server has sent all of it (response.done)
    this.timer = 0;
    this.closing = false;
  }

  async start() {
    this.view.status("Asking for the microphone…");
    this.context = new AudioContext();
    await this.context.resume(); // started by a click it runs anyway; this covers a browser that still holds it
    this.player = new Player(this.context);
    this.mic = new Microphone(this.context, (chunk) => this.onChunk(chunk));
    await this.mic.start(); // first: no socket for a page that cannot hear
    this.view.status("Connecting…");
    this.socket = new WebSocket(socketUrl(this.model), subprotocols());
    this.socket.onmessage = (message) => this.onEvent(JSON.parse(message.data));
    this.socket.onclose = (event) => this.onClose(event);
    this.timer = setInterval(() => this.tick(), ACK_EVERY_MS);
  }

  stop(reason = "Stopped.") {
    if (this.closing) return;
    this.closing = true;
    clearInterval(this.timer);
    this.player?.stop();
    this.view.played(this.player?.playedSeconds() ?? 0);
    this.mic?.stop();
    if (this.socket && this.socket.readyState <= WebSocket.OPEN) this.socket.close(1000, "stopped by the user");
    this.context?.close();
    this.view.closed(reason);
  }

  send(event) {
    if (this.socket?.readyState === WebSocket.OPEN) this.socket.send(JSON.stringify(event));
  }

  // A 50 ms microphone chunk: appended once the session exists (before that the server has nowhere to put it).
  onChunk({ pcm, time, level }) {
    this.view.level(level);
    if (!this.ready || this.closing) return;
    this.firstSampleTime ??= time;
    this.send({ type: "input_audio_buffer.append", audio: pcm16ToBase64(pcm) });
  }

  onEvent(event) {
    const type = GA_NAMES[event.type] ?? event.type;
    const handler = this.handlers[type];
    if (handler) handler.call(this, event);
  }

  onClose(event) {
    if (this.closing) return;
    const refused = "the connection failed or was refused (a wrong API key?)"; // 1006: no close frame at all
    const why = event.reason || (event.code === 1006 ? refused : `code ${event.code}`);
    this.stop(`Disconnected: ${why}.`);
  }

  tick() {
    this.view.played(this.player.playedSeconds());
    this.ackPlayback();
    if (this.answering && this.answerSent && !this.player.playing) {
      this.answering = false;
      this.view.status("Listening.");
    }
  }

  // mmserve's playback.ack: how much of the playing item was heard, so that when the server cuts the answer itself
  // (speech while it still plays) it truncates to what was heard rather than to its own estimate.
  ackPlayback() {
    if (!this.player.playing) return;
    const { id } = this.player.item;
    this.send({ type: "playback.ack", item_id: id, played_ms: Math.floor(this.player.heardSeconds() * 1000) });
  }

  // The user spoke over the answer: silence it now and tell the server how much of it was heard, so the
  // conversation keeps only that (the rest of the transcript is dropped from the history).
  bargeIn() {
    const cut = this.player.stop();
    if (cut === null) return;
    this.cutItems.add(cut.itemId);
    this.send({ type: "conversation.item.truncate", item_id: cut.itemId, content_index: 0,
                audio_end_ms: Math.floor(cut.heardMs) });
  }

  playDelta({ item_id: itemId, delta }) {
    if (this.cutItems.has(itemId)) return;
    const start = this.player.play(itemId, base64ToFloat32(delta));
    if (this.turnEnd !== null) { // the answer's first audio: the turn's latency is known
      const heardAt = start + (this.context.outputLatency || 0); // the sound leaves the speakers then
      this.view.latency((heardAt - this.turnEnd) * 1000, this.silenceMs);
      this.turnEnd = null;
    }
    this.answering = true;
    this.answerSent = false;
    this.view.status("Answering…");
  }
}

// Server events -> what the session does with them (anything else is ignored).
VoiceSession.prototype.handlers = {
  "session.created"({ session }) {
    this.ready = true;
    this.silenceMs = endSilenceMs(session);
    if (this.voice && this.voice !== session?.audio?.output?.voice) {
      this.send({ type: "session.update", session: { type: "realtime", audio: { output: { voice: this.voice } } } });
    }
    this.view.status("Listening: speak, and pause when you are done.");
  },
  "session.updated"({ session }) {
    this.silenceMs = endSilenceMs(session);
  },
  "input_audio_buffer.speech_started"({ item_id: itemId }) {
    this.bargeIn();
    this.answering = false;
    this.turnEnd = null;
    this.view.speech(itemId);
    this.view.status("Hearing you…");
  },
  // audio_end_ms counts from the first sample sent, and the server's VAD ends a turn after silenceMs of silence:
  // the speech itself ended that much earlier.
  "input_audio_buffer.speech_stopped"({ audio_end_ms: endMs }) {
    if (this.firstSampleTime !== null) this.turnEnd = this.firstSampleTime + (endMs - this.silenceMs) / 1000;
    this.view.status("Thinking…");
  },
  "conversation.item.input_audio_transcription.delta"({ item_id: itemId, delta }) {
    this.view.transcript("user", itemId, delta, false);
  },
  "conversation.item.input_audio_transcription.completed"({ item_id: itemId, transcript }) {
    this.view.transcript("user", itemId, transcript, true);
  },
  "conversation.item.input_audio_transcription.failed"({ item_id: itemId }) {
    this.view.transcript("user", itemId, "(not understood)", true);
  },
  "response.output_audio_transcript.delta"({ item_id: itemId, delta }) {
    this.view.transcript("assistant", itemId, delta, false);
  },
  "response.output_text.delta"({ item_id: itemId, delta }) {
    this.view.transcript("assistant", itemId, delta, false);
  },
  "response.output_audio.delta"(event) {
    this.playDelta(event);
  },
  // The answer is all sent, not all played: the status says "Listening" once it has played (tick).
  "response.done"({ response }) {
    this.answerSent = true;
    if (response?.status === "failed") {
      this.view.status(`The answer failed: ${response.status_details?.error?.message ?? "unknown error"}`);
    } else if (response?.status !== "cancelled" && !this.answering) {
      this.view.status("Listening.");
    }
  },
  "conversation.item.truncated"({ item_id: itemId, audio_end_ms: endMs }) {
    this.view.truncated(itemId, endMs);
  },
  "error"({ error }) {
    this.view.status(`Server error: ${error?.message ?? "unknown"}`);
  },
};
