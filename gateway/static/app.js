// The page: Start opens a session (microphone + playback), Interrupt (or Esc) cuts the reply and silences
// it at once, the text box asks typed questions, and the timeline draws each second the model heard.
// `window.talk` exposes counters for tests and curious people.

import { RATE, openAudio, startMicrophone, Player } from "./audio.js";
import { Realtime, realtimeUrl } from "./realtime.js";
import { Timeline } from "./timeline.js";

const $ = (id) => document.getElementById(id);
const key = new URLSearchParams(location.search).get("key");
const talk = (window.talk = { url: null, appends: 0, deltas: 0, chunks: 0, played: 0, queued: 0,
                              states: [], replies: [], steps: [], errors: [] });
const timeline = new Timeline($("timeline"), talk.steps);
let session = null;
let player = null;
let stopMicrophone = null;
let context = null;
let currentLine = null;
const replyStart = new Map(); // reply id -> where its audio starts in the player's timeline (samples)

function indicate(state) {
  const el = $("indicator");
  if (el.textContent === state) return;
  el.textContent = state;
  el.className = `indicator ${state}`;
  talk.states.push(state);
}

function refreshIndicator() {
  if (!session) indicate("idle");
  else indicate(session.reply || (player && player.busy) ? "speaking" : "listening");
}

function line(text, kind) {
  const li = document.createElement("li");
  li.className = kind;
  li.textContent = text;
  $("transcript").append(li);
  return li;
}

function setRunning(running) {
  $("start").disabled = running;
  for (const id of ["stop", "interrupt", "question", "send"]) $(id).disabled = !running;
}

async function start(event) {
  event.preventDefault();
  $("log").textContent = "";
  context = await openAudio();
  player = new Player(context, (p) => {
    talk.played = p.played;
    talk.queued = p.queued;
    refreshIndicator();
  });
  talk.url = realtimeUrl(key);
  timeline.clear();
  session = new Realtime(talk.url, { voice: $("voice").value, turns: $("turns").value }, {
    replyStarted(id) {
      talk.replies.push({ id, status: null, receivedMs: 0 });
      currentLine = line("Assistant: ", "assistant");
      currentLine.dataset.reply = id;
      refreshIndicator();
    },
    words(id, text) {
      talk.deltas += 1;
      if (currentLine) currentLine.textContent += text;
      timeline.words(text);
    },
    audio(id, pcm) {
      talk.chunks += 1;
      talk.replies.find((r) => r.id === id).receivedMs += (pcm.length / RATE) * 1000;
      if (!replyStart.has(id)) replyStart.set(id, player.played + player.queued);
      player.push(pcm);
      refreshIndicator();
    },
    latency(id, ms) {
      $("latency").textContent = `first audio after: ${Math.round(ms)} ms`;
      const reply = talk.replies.find((r) => r.id === id);
      if (reply) reply.latencyMs = Math.round(ms);
      timeline.latency(ms);
    },
    step(second, decision) {
      timeline.step(second, decision);
    },
    bargeIn() {
      timeline.bargeIn();
    },
    replyDone(id, status, reason) {
      const reply = talk.replies.find((r) => r.id === id);
      if (reply) Object.assign(reply, { status, reason });
      currentLine = null;
      refreshIndicator();
    },
    truncated(id, audioEndMs) {
      const reply = talk.replies.find((r) => r.id === id);
      if (reply) reply.truncatedMs = audioEndMs;
      const li = document.querySelector(`#transcript li[data-reply="${id}"]`);
      if (li && !li.textContent.endsWith("[cut]")) li.textContent += " [cut]";
    },
    listening: refreshIndicator,
    userTurn(text) {
      line(`You: ${text}`, "user");
    },
    error(message) {
      talk.errors.push(message);
      $("log").textContent = message;
    },
    closed(reason) {
      stop(reason);
    },
  });
  stopMicrophone = await startMicrophone(context, (chunk) => {
    talk.appends += 1;
    timeline.heard(chunk);
    session.appendAudio(chunk);
  });
  setRunning(true);
  refreshIndicator();
  $("interrupt").focus();
}

// Barge in: silence now (not when the server confirms), and cut the reply at what was heard of it.
function interrupt() {
  if (!session) return;
  const latest = session.lastReply;
  const playing = session.reply || player.busy;
  const heard = latest && replyStart.has(latest.id) ? Math.max(0, player.played - replyStart.get(latest.id)) : 0;
  player.flush();
  if (playing) {
    session.interrupt((heard / RATE) * 1000);
    timeline.bargeIn();
  }
  refreshIndicator();
}

function stop(reason) {
  if (!session) return;
  const s = session;
  session = null;
  s.close();
  if (stopMicrophone) stopMicrophone();
  if (context) context.close();
  setRunning(false);
  refreshIndicator();
  if (typeof reason === "string") $("log").textContent = `session ended: ${reason}`;
  $("start").focus();
}

function ask(event) {
  event.preventDefault();
  const text = $("question").value.trim();
  if (!session || !text) return;
  session.ask(text);
  $("question").value = "";
}

$("settings").addEventListener("submit", (e) => start(e).catch((err) => {
  $("log").textContent = `could not start: ${err.message}`;
  stop();
}));
$("stop").addEventListener("click", () => stop("stopped"));
$("interrupt").addEventListener("click", interrupt);
$("ask").addEventListener("submit", ask);
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape") interrupt();
});
