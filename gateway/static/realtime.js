// The OpenAI Realtime dialect on /v1/realtime: what the page sends, and the server's events folded into
// a few callbacks (reply started, words, audio, reply done, listening, user turn, error, closed), and the
// duplex extensions the timeline draws (each step's decision, the overlap policy's barge-ins).

import { RATE, encodePcm16, decodePcm16 } from "./audio.js";

export function realtimeUrl(key) {
  const url = new URL("/v1/realtime", location.origin);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  // The page speaks the extensions (a stock OpenAI client gets the spec alone): the model's own turns, and
  // the events it shows (response.listen, session.closed, the cause of a cut reply).
  url.searchParams.set("extensions", "duplex,events");
  if (key) url.searchParams.set("key", key); // browsers cannot set headers on a WebSocket
  return url.toString();
}

export class Realtime {
  constructor(url, settings, on) {
    this.on = on;
    this.reply = null; // the reply in progress: {id, itemId, firstAudioAt, inputAt}
    this.lastReply = null; // the latest reply, in progress or done (its audio may still be playing)
    this.replyOfItem = new Map();
    this.cut = new Set(); // replies interrupted here: their late audio is not played
    this.lastInputAt = null;
    this.ws = new WebSocket(url);
    this.ws.onmessage = (m) => this.receive(JSON.parse(m.data));
    this.ws.onclose = (e) => on.closed(e.reason || `socket closed (${e.code})`);
    // duplex: the model's own turns (`duplex: true`; the spec's turn_detection is null: no VAD turns)
    const vad = settings.turns === "manual" || settings.turns === "duplex" ? null : { type: settings.turns };
    this.ws.onopen = () => this.send("session.update", { session: {
      duplex: settings.turns === "duplex",
      audio: {
        input: { format: { type: "audio/pcm", rate: RATE }, turn_detection: vad },
        output: { format: { type: "audio/pcm", rate: RATE }, voice: settings.voice },
      },
    } });
  }

  send(type, fields = {}) {
    if (this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify({ type, ...fields }));
  }

  appendAudio(samples) {
    this.send("input_audio_buffer.append", { audio: encodePcm16(samples) });
    this.lastInputAt = performance.now();
  }

  ask(text) {
    this.send("conversation.item.create", { item: { type: "message", role: "user",
                                                     content: [{ type: "input_text", text }] } });
    this.send("response.create");
    this.lastInputAt = performance.now();
  }

  // Cut the latest reply where the listener stopped hearing it (`heardMs` of its audio were played): the
  // server stops it if it is still going, and keeps only what was heard in the conversation.
  interrupt(heardMs) {
    const r = this.lastReply;
    if (!r || !r.itemId) return null;
    if (this.reply) this.cut.add(r.id);
    this.send("conversation.item.truncate", { item_id: r.itemId, content_index: 0,
                                              audio_end_ms: Math.round(heardMs) });
    return r.id;
  }

  close() {
    this.send("session.close");
  }

  receive(ev) {
    const on = this.on;
    switch (ev.type) {
      case "response.created":
        this.reply = this.lastReply = { id: ev.response.id, itemId: null, firstAudioAt: null,
                                        inputAt: this.lastInputAt };
        on.replyStarted(ev.response.id);
        break;
      case "response.output_item.added":
        if (this.reply && this.reply.id === ev.response_id) {
          this.reply.itemId = ev.item.id;
          this.replyOfItem.set(ev.item.id, ev.response_id);
        }
        break;
      case "conversation.item.truncated":
        if (this.replyOfItem.has(ev.item_id)) on.truncated(this.replyOfItem.get(ev.item_id), ev.audio_end_ms);
        break;
      case "response.output_audio_transcript.delta":
      case "response.output_text.delta":
        on.words(ev.response_id, ev.delta);
        break;
      case "response.output_audio.delta": {
        if (this.cut.has(ev.response_id)) break;
        const r = this.reply;
        if (r && r.id === ev.response_id && r.firstAudioAt === null) {
          r.firstAudioAt = performance.now();
          if (r.inputAt !== null) on.latency(r.id, r.firstAudioAt - r.inputAt);
        }
        on.audio(ev.response_id, decodePcm16(ev.delta));
        break;
      }
      case "response.done":
        this.reply = null;
        const details = ev.response.status_details || {};
        on.replyDone(ev.response.id, ev.response.status, details.cause || details.reason);
        break;
      case "response.listen":
        on.listening();
        break;
      case "duplex.step": // one per second the model heard: listen or speak
        on.step(ev.second, ev.decision);
        break;
      case "overlap.decision":
        if (ev.action === "barge_in") on.bargeIn(ev.response_id);
        break;
      case "conversation.item.added":
        if (ev.item.role === "user") {
          const typed = ev.item.content.find((p) => p.type === "input_text");
          on.userTurn(typed ? typed.text : "(speech)");
        }
        break;
      case "error":
        on.error(`${ev.error.code}: ${ev.error.message}`);
        break;
      case "session.closed":
        on.closed(ev.reason);
        break;
    }
  }
}
