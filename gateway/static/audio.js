// Audio in and out at the session's rate (24 kHz): the microphone through an AudioWorklet, in 100 ms
// chunks, and gapless playback of the reply through another.

export const RATE = 24000;
const CHUNK = RATE / 10; // 100 ms per append

export async function openAudio() {
  const context = new AudioContext({ sampleRate: RATE });
  await context.audioWorklet.addModule("static/capture-worklet.js");
  await context.audioWorklet.addModule("static/playback-worklet.js");
  return context;
}

// Calls onChunk(Float32Array of 100 ms) for as long as the microphone runs; returns a stop function.
export async function startMicrophone(context, onChunk) {
  const stream = await navigator.mediaDevices.getUserMedia({
    audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true },
  });
  const source = context.createMediaStreamSource(stream);
  const capture = new AudioWorkletNode(context, "capture");
  let pending = new Float32Array(CHUNK);
  let filled = 0;
  capture.port.onmessage = ({ data }) => {
    let at = 0;
    while (at < data.length) {
      const n = Math.min(CHUNK - filled, data.length - at);
      pending.set(data.subarray(at, at + n), filled);
      filled += n;
      at += n;
      if (filled === CHUNK) {
        onChunk(pending);
        pending = new Float32Array(CHUNK);
        filled = 0;
      }
    }
  };
  source.connect(capture);
  return () => {
    source.disconnect();
    capture.port.onmessage = null;
    stream.getTracks().forEach((t) => t.stop());
  };
}

export class Player {
  constructor(context, onReport) {
    this.node = new AudioWorkletNode(context, "playback", { outputChannelCount: [1] });
    this.node.connect(context.destination);
    this.played = 0; // samples played so far
    this.queued = 0; // samples waiting to play
    this.node.port.onmessage = ({ data }) => {
      this.played = data.played;
      this.queued = data.queued;
      onReport(this);
    };
  }

  push(pcm) {
    this.queued += pcm.length;
    this.node.port.postMessage({ type: "push", pcm }, [pcm.buffer]);
  }

  flush() {
    this.queued = 0;
    this.node.port.postMessage({ type: "flush" });
  }

  get busy() {
    return this.queued > 0;
  }
}

// audio/pcm: base64 16-bit little-endian mono.
export function encodePcm16(samples) {
  const pcm = new Int16Array(samples.length);
  for (let i = 0; i < samples.length; i++) {
    pcm[i] = Math.max(-32768, Math.min(32767, Math.round(samples[i] * 32768)));
  }
  const bytes = new Uint8Array(pcm.buffer);
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(binary);
}

export function decodePcm16(base64) {
  const bytes = Uint8Array.from(atob(base64), (c) => c.charCodeAt(0));
  const pcm = new Int16Array(bytes.buffer, 0, bytes.length >> 1);
  return Float32Array.from(pcm, (v) => v / 32768);
}
