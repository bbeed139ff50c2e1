// The timeline: one column per second the model heard, drawn as it happens. Each shows the caller's level in
// that second (measured here, from the audio the page sent), the model's decision for it (listen or speak),
// a barge-in when the caller cut the reply there, the words the model said in it, and on the step where a
// turn began, how long its first audio took. People read a duplex model better from this than from a log.

import { RATE } from "./audio.js";

const FLOOR_DB = -60; // the bottom of the level bar: quieter than this is silence here

export class Timeline {
  constructor(list, steps) {
    this.list = list; // the <ol> the columns go into
    this.steps = steps; // [{second, decision, levelDb, bargeIn, text, latencyMs}], exposed for tests
    this.levels = []; // caller's sum of squares and samples per second sent, by second (0-based)
    this.sent = 0; // samples sent so far
    this.current = null; // the latest step's entry
    this.currentItem = null; // and its <li>
  }

  clear() {
    this.list.replaceChildren();
    this.steps.length = 0;
    this.levels = [];
    this.sent = 0;
    this.current = this.currentItem = null;
  }

  // A chunk of caller audio went up: it counts towards the level of the second it falls in.
  heard(chunk) {
    for (let i = 0; i < chunk.length; i++, this.sent++) {
      const s = Math.floor(this.sent / RATE);
      const level = this.levels[s] || (this.levels[s] = { squares: 0, n: 0 });
      level.squares += chunk[i] * chunk[i];
      level.n += 1;
    }
  }

  levelDb(second) {
    const level = this.levels[second - 1]; // the server counts the caller's seconds from 1
    if (!level || level.n === 0 || level.squares === 0) return FLOOR_DB;
    return Math.max(FLOOR_DB, 10 * Math.log10(level.squares / level.n));
  }

  // The model's decision for one second (the `duplex.step` extension event).
  step(second, decision) {
    const entry = { second, decision, levelDb: Math.round(this.levelDb(second)), bargeIn: false, text: "",
                    latencyMs: null };
    this.steps.push(entry);
    const li = document.createElement("li");
    li.className = `step ${decision}`;
    const bar = document.createElement("span");
    bar.className = "level";
    bar.style.height = `${Math.round(100 * (1 - entry.levelDb / FLOOR_DB))}%`;
    const meter = document.createElement("span");
    meter.className = "meter";
    meter.title = `caller level ${entry.levelDb} dBFS`;
    meter.append(bar);
    const label = document.createElement("span");
    label.className = "decision";
    label.textContent = decision;
    const words = document.createElement("span");
    words.className = "words";
    li.append(meter, label, words);
    this.current = entry;
    this.currentItem = li;
    this.describe();
    this.list.append(li);
    li.scrollIntoView({ block: "nearest", inline: "end" });
  }

  words(text) {
    if (!this.current) return;
    this.current.text += text;
    this.currentItem.querySelector(".words").textContent = this.current.text;
    this.describe();
  }

  bargeIn() {
    if (!this.current) return;
    this.current.bargeIn = true;
    this.currentItem.classList.add("barge-in");
    this.describe();
  }

  latency(ms) {
    if (!this.current) return;
    this.current.latencyMs = Math.round(ms);
    const tag = document.createElement("span");
    tag.className = "latency";
    tag.textContent = `${this.current.latencyMs} ms`;
    this.currentItem.append(tag);
    this.describe();
  }

  // What a screen reader says of the latest column (and a tooltip shows).
  describe() {
    const e = this.current;
    const parts = [`second ${e.second}`, e.decision, `caller ${e.levelDb} dBFS`];
    if (e.bargeIn) parts.push("barge-in");
    if (e.latencyMs !== null) parts.push(`turn's first audio after ${e.latencyMs} ms`);
    if (e.text) parts.push(`"${e.text}"`);
    this.currentItem.setAttribute("aria-label", parts.join(", "));
    this.currentItem.title = parts.join(", ");
  }
}
