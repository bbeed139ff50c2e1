// Gapless playback: reply chunks queue up and play back to back; "flush" drops them at once (a barge-in).
// Every ~100 ms it reports how much was played and how much is still queued.
class Playback extends AudioWorkletProcessor {
  constructor() {
    super();
    this.chunks = [];
    this.offset = 0; // into chunks[0]
    this.queued = 0;
    this.played = 0;
    this.sinceReport = 0;
    this.port.onmessage = ({ data }) => {
      if (data.type === "push") {
        this.chunks.push(data.pcm);
        this.queued += data.pcm.length;
      } else if (data.type === "flush") {
        this.chunks = [];
        this.offset = 0;
        this.queued = 0;
        this.report();
      }
    };
  }

  report() {
    this.port.postMessage({ type: "played", played: this.played, queued: this.queued });
    this.sinceReport = 0;
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    let filled = 0;
    while (filled < out.length && this.chunks.length) {
      const head = this.chunks[0];
      const n = Math.min(out.length - filled, head.length - this.offset);
      out.set(head.subarray(this.offset, this.offset + n), filled);
      filled += n;
      this.offset += n;
      if (this.offset === head.length) {
        this.chunks.shift();
        this.offset = 0;
      }
    }
    out.fill(0, filled);
    this.played += filled;
    this.queued -= filled;
    this.sinceReport += out.length;
    if (this.sinceReport >= sampleRate / 10) this.report();
    return true;
  }
}
registerProcessor("playback", Playback);
