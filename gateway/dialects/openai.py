"""The OpenAI Realtime dialect as a state machine (pure code: client events and step events in, effects out).

Turn detection decides who opens a response:
- `duplex` (default): every second of caller audio is a duplex step and the model decides whether to
  speak; a spoken turn opens a response (`response.speak`) and its end closes it (`response.listen`).
  While the assistant speaks, the overlap policy judges the caller's audio: noise is dropped, a
  backchannel is heard and the reply goes on, sustained speech barges in.
- `server_vad`: Silero VAD segments the caller's speech; its end commits the buffer as a user item and
  starts a response (a chat turn over the conversation); speech during a reply interrupts it.
- `null`: the client commits and asks for responses itself.

A barge-in stops the Triton step in flight, bumps the epoch (nothing of the old one reaches the client),
ends the response `cancelled` / `barge_in`, cuts the reply to what was heard, and, in duplex, rolls the
LLM's context back to that point with the next step.
"""

from __future__ import annotations

import base64
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from minicpmo_triton.duplex_contract import ChatInput, ChatMessage, Context, StepEvent, StepInput
from minicpmo_triton.duplex_options import DuplexOptions
from minicpmo_triton.model_config import DuplexDefaults

from ..audio import (
    INPUT_RATE,
    OUTPUT_RATE,
    AudioDecodeError,
    StreamResampler,
    decode_pcm16_base64,
    encode_pcm16_base64,
    resample,
)
from ..engine import UNIT, Effects, EngineState, PlannedStep, ServerEvent
from ..inputs import MAX_APPEND_SECONDS, MAX_FRAMES, image_bytes
from ..overlap import OverlapDecision, OverlapPolicy, rms
from ..vad import WINDOW_MS, SpeechSegmenter
from ..wire import ProtocolError, Usage, new_id
from . import openai_events as oe
from .openai_config import RealtimeConfig, apply_update, max_output_tokens
from .openai_conversation import Conversation, Item
from .realtime_events import answer, closed_event, error_event, parse_event

MIN_COMMIT_MS = 100
REPLAY_UNITS = 8  # how many seconds of caller audio a rollback may hear again
CONTEXT_TOKENS = DuplexDefaults().context_tokens  # what rate_limits.updated reports left
# Frames this long are decided off the event loop. Per second of audio an append costs 5-9 ms of Silero VAD
# (12-17 ms with both cores busy), 0.2 ms of resampling, 0.1 ms of decoding; a thread hand-off 0.2 ms, but
# 5-8 ms at its p99 (`python -m bench.frame_cost`, docs/realtime.md). 64,000 characters is an append of 1 s
# at 24 kHz (1.5 s at 16 kHz): its VAD outweighs even a slow hand-off. Smaller frames (clients stream
# 20-100 ms; a barge-in is decided on one) stay inline, where a hand-off would only make them later.
OFFLOAD_FRAME_BYTES = 64_000
CAPABILITIES = {"duplex": True, "barge_in": True, "truncate": True, "playback_ack": True, "resume": True,
                "server_vad": True, "chunk_period_ms": 1000, "input_rates": [16_000, 24_000]}


# Work that is not protocol comes in as callables (the shell decides big frames off the event loop):
SpeechProbabilities = Callable[[np.ndarray], list[float]]  # 16 kHz audio -> one speech probability per VAD window
Resampling = Callable[[int, int], Callable[[np.ndarray], np.ndarray]]  # (rate in, rate out) -> a stream resampler


@dataclass
class Response:
    id: str
    item: Item
    epoch: int
    kv_before: int = -1  # duplex: where to roll back to if nothing of it was heard
    unit_before: int = -1
    usage: Usage = field(default_factory=Usage)
    first_audio_at: float | None = None
    ack_ms: float = 0.0
    ack_at: float | None = None
    done: bool = False
    kv_length: int = 0


@dataclass
class OpenAIRealtimeState(EngineState):
    offload_frame_bytes: ClassVar[int | None] = OFFLOAD_FRAME_BYTES
    config: RealtimeConfig = field(default_factory=RealtimeConfig)
    vad: SpeechProbabilities | None = None
    resampling: Resampling = StreamResampler
    conversation: Conversation = field(default_factory=Conversation)
    response: Response | None = None  # the latest response, open or done
    past_responses: set[str] = field(default_factory=set)
    overlap: OverlapPolicy | None = None
    segmenter: SpeechSegmenter | None = None
    _unit_audio: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    _buffer: list[np.ndarray] = field(default_factory=list)  # uncommitted caller audio (turn-based), 16 kHz
    _speech_item: str | None = None
    _units: int = 0
    _sent_units: deque[tuple[int, np.ndarray]] = field(default_factory=lambda: deque(maxlen=REPLAY_UNITS))
    _last_listen: tuple[int, int] = (-1, -1)  # (kv length, unit) after the latest step that did not speak
    _rollback: tuple[int, int] | None = None  # (kv length, unit) to go back to with the next duplex step
    _listen_next: bool = False
    _frames: list[bytes] = field(default_factory=list)
    _to_say: Item | None = None  # an assistant message the next response.create voices
    _said: set[str] = field(default_factory=set)  # messages voiced by a response (whose item now holds them)
    _reported: tuple[str, str] | None = None
    _resampler: Callable[[np.ndarray], np.ndarray] | None = None  # the caller's audio, at its rate, to 16 kHz
    _resampler_rate: int = 0
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._reset_detectors()

    def options(self) -> DuplexOptions:
        return self.config.options()

    def voice_name(self) -> str:
        return self.config.voice  # an OpenAI name with no file in the voice folder keeps the default voice

    def _reset_detectors(self) -> None:
        td = self.config.turn_detection
        self.overlap = OverlapPolicy(self.config.overlap)
        position = self.segmenter.position_ms if self.segmenter else 0
        self.segmenter = SpeechSegmenter(td.threshold, td.prefix_padding_ms, td.silence_duration_ms,
                                         position_ms=position)

    # ---- session ----
    def created(self) -> list[ServerEvent]:
        return [oe.SessionCreated(self._session_dict(), CAPABILITIES)]

    def on_text(self, text: str) -> Effects:
        return answer(parse_event(text, None), self.on_client)  # not JSON: an error, the session goes on

    def error_event(self, err: ProtocolError) -> ServerEvent:
        return error_event(err)

    def _session_dict(self) -> dict[str, Any]:
        return {**self.config.to_dict(self.session_id), "epoch": self.epoch}

    @property
    def active(self) -> Response | None:
        return self.response if self.response is not None and not self.response.done else None

    # ---- client events ----
    def on_client(self, msg: dict[str, Any]) -> Effects:
        return self.on_event(oe.decode_client(msg))

    def on_event(self, event: oe.ClientEvent) -> Effects:
        return _HANDLERS[type(event)](self, event)

    def _session_update(self, msg: oe.SessionUpdate) -> Effects:
        config = apply_update(self.config, msg.session, self.started, self.limits)
        if config.turn_detection.type == "server_vad" and self.vad is None:
            raise ProtocolError("server_vad_unavailable", "server VAD needs the silero-vad package installed",
                                "session.audio.input.turn_detection.type")
        self.config = config
        self._reset_detectors()
        return Effects([oe.SessionUpdated(self._session_dict())])

    def _append(self, msg: oe.AudioAppend) -> Effects:
        rate = self.config.input_rate
        try:
            pcm = decode_pcm16_base64(msg.audio, MAX_APPEND_SECONDS * rate)
        except AudioDecodeError as exc:
            raise ProtocolError("bad_audio", str(exc), "audio") from exc
        if self._resampler is None or self._resampler_rate != rate:
            self._resampler, self._resampler_rate = self.resampling(rate, INPUT_RATE), rate
        return self.hear(self._resampler(pcm), msg.hint)

    def hear(self, audio: np.ndarray, hint: str | None = None) -> Effects:
        """Caller audio (16 kHz float32), however it arrived."""
        out = Effects()
        # The VAD runs where it is needed: server VAD, or judging speech under a reply (duplex).
        needed = self.config.turn_detection.type == "server_vad" or (self.config.duplex and self.active is not None)
        probs = self.vad(audio) if self.vad is not None and needed else []
        vad_events = self.segmenter.feed(probs)
        if self.config.duplex:
            audio = self._judge_overlap(audio, probs, any(e.kind == "speech_started" for e in vad_events), hint, out)
            self._unit_audio = np.concatenate([self._unit_audio, audio])
            while len(self._unit_audio) >= UNIT:
                unit, self._unit_audio = self._unit_audio[:UNIT], self._unit_audio[UNIT:]
                out.steps.append(self._duplex_step(unit))
            return out
        self._buffer.append(audio)
        if sum(len(a) for a in self._buffer) > self.limits.audio_samples(INPUT_RATE):
            self._buffer.pop()
            most = self.limits.item_audio_s
            raise ProtocolError("input_audio_buffer_full", f"the input buffer holds at most {most:.0f} s; commit or "
                                "clear it (this append was dropped)")
        if self.config.turn_detection.type != "server_vad":
            return out
        for vad_ev in vad_events:
            if vad_ev.kind == "speech_started":
                self._speech_item = new_id("item")
                out.events.append(oe.SpeechStarted(vad_ev.audio_ms, self._speech_item))
                if self.active is not None and self.config.turn_detection.interrupt_response:
                    out.extend(self._interrupt("barge_in"))
            else:
                out.events.append(oe.SpeechStopped(vad_ev.audio_ms, self._speech_item))
                out.extend(self._commit_buffer(self._speech_item))
                if self.config.turn_detection.create_response and self.active is None:
                    out.extend(self._respond())
        if not self.segmenter.in_speech:  # before speech starts only its prefix padding is worth keeping
            keep = self.config.turn_detection.prefix_padding_ms * INPUT_RATE // 1000
            tail = np.concatenate(self._buffer)[-keep:] if keep and self._buffer else np.zeros(0, np.float32)
            self._buffer = [tail] if len(tail) else []
        return out

    def _judge_overlap(self, audio: np.ndarray, probs: list[float], onset: bool, hint: str | None,
                       out: Effects) -> np.ndarray:
        if self.active is None:
            self.overlap.reset()
            self._reported = None
            return audio
        if probs:
            speech_ms = sum(p >= self.config.turn_detection.threshold for p in probs) * WINDOW_MS
        else:  # no VAD model: loud enough counts as speech
            speech_ms = len(audio) * 1000 // INPUT_RATE if rms(audio) >= self.config.overlap.silence_rms else 0
        decision = self.overlap.decide(audio, speech_ms, onset, hint)
        if (decision.action, decision.reason) != self._reported or decision.action == "barge_in":
            self._reported = (decision.action, decision.reason)
            out.events.append(self._decision_event(decision))
        if decision.action == "barge_in":
            out.extend(self._interrupt("barge_in"))
            self._listen_next = True  # the second in which the caller barged in is listened to
        if decision.action == "drop":
            return np.zeros_like(audio)  # noise under a reply: the model hears silence
        return audio

    def _decision_event(self, d: OverlapDecision) -> oe.OverlapDecision:
        return oe.OverlapDecision(self.config.overlap.policy, d.action, d.reason, d.speech_ms,
                                  self.response.id if self.response else None, self.epoch)

    def _duplex_step(self, unit_audio: np.ndarray, force_listen: bool = False) -> PlannedStep:
        self._units += 1
        frames, self._frames = self._frames, []
        req = StepInput(audio=unit_audio, force_listen=force_listen, frames=frames,
                        max_slice_nums=[1] * len(frames))
        return PlannedStep("duplex", req, self.epoch, unit=self._units)

    def prepare(self, step: PlannedStep) -> StepInput | ChatInput:
        req = super().prepare(step)
        if isinstance(req, StepInput) and step.kind == "duplex":
            req.force_listen = req.force_listen or self._listen_next  # the second the caller barged in is heard
            self._listen_next = False
            if self._rollback is not None:
                kv, after = self._rollback
                self._rollback = None
                replay = [a for u, a in self._sent_units if u > after]
                if kv >= 0 and (not self._sent_units or self._sent_units[0][0] <= after + 1):
                    req.rollback_to = kv
                    req.replay_audio = np.concatenate(replay) if replay else np.zeros(0, np.float32)
            self._sent_units.append((step.unit, req.audio))
        return req

    def _commit(self, msg: oe.ClientEvent) -> Effects:
        if self.config.duplex:
            unit = _committable(self._unit_audio)
            self._unit_audio = np.zeros(0, np.float32)
            return Effects([oe.BufferCommitted(None)], [self._duplex_step(unit)])
        return self._commit_buffer(None)

    def _commit_buffer(self, item_id: str | None) -> Effects:
        audio = _committable(np.concatenate(self._buffer) if self._buffer else np.zeros(0, np.float32))
        self._buffer = []
        item = Item(item_id or new_id("item"), "user", audio=audio)
        evicted = self._room(item)
        previous, _ = self.conversation.add(item)
        return Effects([
            *evicted,
            oe.BufferCommitted(item.id, previous),
            oe.ItemAdded(previous, item.to_dict()),
            oe.ItemDone(item.to_dict()),
        ])

    def _clear(self, msg: oe.ClientEvent) -> Effects:
        self._buffer, self._unit_audio = [], np.zeros(0, np.float32)
        return Effects([oe.BufferCleared()])

    def _item_create(self, msg: oe.ItemCreate) -> Effects:
        raw = msg.item
        if not isinstance(raw, dict) or raw.get("type", "message") != "message":
            raise ProtocolError("invalid_value", "item must be a message", "item")
        role = raw.get("role")
        if role not in ("user", "assistant", "system"):
            raise ProtocolError("invalid_value", "item.role must be user, assistant or system", "item.role")
        item = self.conversation.new_item(role, spoken=False)
        content = raw.get("content") or []
        if not isinstance(content, list):
            raise ProtocolError("invalid_value", "item.content must be a list", "item.content")
        for part in content:
            self._add_part(item, part)
        if not item.text and item.audio is None and not item.images:
            raise ProtocolError("missing_field", "the item has no text, audio or image content", "item.content")
        self.limits.text(item.text, "item.content.text")
        self.limits.images([base64.b64decode(i) for i in item.images], "item.content")
        out = Effects(self._room(item))
        if role == "assistant" and item.text:
            self._to_say = item  # said by the next response.create; in duplex it enters the context only then
        if self.config.duplex:
            if item.audio is not None:
                raise ProtocolError("invalid_value", "in duplex, send caller audio with input_audio_buffer.append",
                                    "item.content")
            if len(self._frames) + len(item.images) > MAX_FRAMES:
                raise ProtocolError("invalid_value", f"at most {MAX_FRAMES} images wait for the next second", "item")
            self._frames += [base64.b64decode(i) for i in item.images]  # seen with the next second of audio
            if item.text and role != "assistant":
                req = StepInput.of_context(Context(item.text, role, respond=False))
                out.steps.append(PlannedStep("context", req, self.epoch))
        previous, _ = self.conversation.add(item)
        out.events += [oe.ItemAdded(previous, item.to_dict()),
                       oe.ItemDone(item.to_dict())]
        return out

    def _add_part(self, item: Item, part: Any) -> None:
        if not isinstance(part, dict):
            raise ProtocolError("invalid_value", "each content part must be an object", "item.content")
        kind = part.get("type")
        if kind in ("input_text", "text", "output_text") and isinstance(part.get("text"), str):
            item.text += part["text"]
        elif kind == "input_audio" and isinstance(part.get("audio"), str):
            rate = self.config.input_rate
            try:
                audio = resample(decode_pcm16_base64(part["audio"], self.limits.audio_samples(rate)), rate, INPUT_RATE)
            except AudioDecodeError as exc:
                raise ProtocolError("bad_audio", str(exc), "item.content.audio") from exc
            item.audio = _whole_tenths(audio)
        elif kind == "input_image":
            url = part.get("image_url")
            data = url.split(",", 1)[-1] if isinstance(url, str) else part.get("image")
            if not isinstance(data, str):
                raise ProtocolError("bad_image", "input_image needs a base64 image or data URL", "item.content")
            image_bytes(data)  # its size, and a format the server decodes
            item.images.append(data)
        else:
            raise ProtocolError("invalid_value", f"unsupported content part {kind!r}", "item.content")

    def _item_retrieve(self, msg: oe.ItemRetrieve) -> Effects:
        return Effects([oe.ItemRetrieved(self.conversation.get(msg.item_id).to_dict())])

    def _item_delete(self, msg: oe.ItemRetrieve) -> Effects:
        item_id = msg.item_id
        if self.active is not None and self.active.item.id == item_id:
            raise ProtocolError("invalid_value", "cancel the response before deleting its item", "item_id")
        self.conversation.delete(item_id)
        if self._to_say is not None and self._to_say.id == item_id:
            self._to_say = None
        return Effects([oe.ItemDeleted(item_id)])

    def _item_truncate(self, msg: oe.ItemTruncate) -> Effects:
        item = self.conversation.get(msg.item_id)
        if item.role != "assistant":
            raise ProtocolError("invalid_value", "only an assistant item's audio can be truncated", "item_id")
        end = msg.audio_end_ms
        out = Effects()
        response = self.response if self.response is not None and self.response.item is item else None
        if response is not None and not response.done:
            out.extend(self._interrupt("client_cancelled", heard_ms=end))
            return out
        cut = item.truncate(end)
        if response is not None:
            self._plan_rollback(response)
        out.events.append(oe.ItemTruncated(item.id, msg.content_index, round(cut)))
        return out

    def _response_create(self, msg: oe.ResponseCreate) -> Effects:
        if self.active is not None:
            raise ProtocolError("conversation_already_has_active_response",
                                f"response {self.active.id} is still in progress")
        budget = self.config.max_output_tokens if msg.max_output_tokens is None \
            else max_output_tokens(msg.max_output_tokens, "response.max_output_tokens")
        if self.config.duplex:
            # unit: a barge-in into a spoken turn replays the caller's seconds sent after it began
            return Effects(steps=[PlannedStep("context", self._duplex_response(msg.instructions, budget), self.epoch,
                                              unit=self._units)])
        return self._respond(budget)

    def _duplex_response(self, instructions: Any, budget: int) -> StepInput:
        """Duplex: instructions prompt the model (it decides whether to speak); without them the model
        speaks now: an assistant message waiting to be voiced is said as is, else it answers in voice."""
        if isinstance(instructions, str) and instructions.strip():
            self.limits.text(instructions, "response.instructions")
            return StepInput.of_context(Context(instructions.strip(), "instructions", respond=True))
        if self._to_say is not None:
            item, self._to_say = self._to_say, None
            return StepInput(say=item.text)
        return StepInput(answer_tokens=budget)

    def _respond(self, budget: int | None = None) -> Effects:
        """A turn-based response: a chat turn over the conversation so far."""
        items = [i for i in self.conversation.items if (i.text or i.audio is not None or i.images)
                 and i.id not in self._said]
        say = self._to_say is not None and bool(items) and items[-1] is self._to_say
        if not items or (items[-1].role == "assistant" and not say):
            raise ProtocolError("invalid_value", "nothing to respond to: the conversation ends with the assistant")
        self._room(Item("", "assistant"))  # the reply's item
        if say:  # the response's item holds the words from now on
            self._said.add(self._to_say.id)
            self._to_say = None
        out = self._open_response(self.clock())
        chat = ChatInput([self._chat_message(i) for i in items], budget or self.config.max_output_tokens,
                         self.config.audio_out, say=say)
        out.steps.append(PlannedStep("chat", chat, self.epoch, response_id=self.response.id))
        return out

    @staticmethod
    def _chat_message(item: Item) -> ChatMessage:
        return ChatMessage(item.role, item.text, item.audio, tuple(base64.b64decode(i) for i in item.images))

    def _response_cancel(self, msg: oe.ClientEvent) -> Effects:
        if self.active is None:
            raise ProtocolError("response_cancel_not_active", "there is no response in progress to cancel")
        return self._interrupt("client_cancelled")

    def _output_clear(self, msg: oe.ClientEvent) -> Effects:
        out = self._interrupt("output_cleared") if self.active is not None else Effects()
        out.events.append(oe.OutputBufferCleared(self.response.id if self.response else None))
        return out

    def _playback_ack(self, msg: oe.PlaybackAck) -> Effects:
        response_id, played = msg.response_id, msg.played_ms
        r = self.response
        if r is None or response_id != r.id:
            if response_id in self.past_responses:
                raise ProtocolError("playback_ack_too_late", f"response {response_id} was followed by a newer one",
                                    "response_id")
            raise ProtocolError("unknown_response", f"no response {response_id!r}", "response_id")
        r.ack_ms = max(r.ack_ms, min(played, r.item.audio_ms))  # acks only move forward
        r.ack_at = self.clock()
        committed = r.done
        out = Effects()
        if r.done and self.config.playback_commit_policy == "ack_only" and r.ack_ms < r.item.audio_ms:
            cut = r.item.truncate(r.ack_ms)
            self._plan_rollback(r)
            out.events.append(oe.ItemTruncated(r.item.id, 0, round(cut)))
        out.events.insert(0, oe.PlaybackAcknowledged(r.id, round(r.ack_ms), committed))
        return out

    def _close(self, msg: oe.ClientEvent) -> Effects:
        return Effects(close="client_closed")

    def _heartbeat(self, msg: oe.ClientEvent) -> Effects:
        return Effects()

    def _room(self, item: Item) -> list[ServerEvent]:
        """Room for `item` in the conversation (limits.conversation). A duplex conversation is only a record (the
        model's context is its KV cache): it keeps its latest items, the older ones deleted. A turn-based one is
        what each response sends: the caller deletes items, else `conversation_full`."""
        limits, conversation = self.limits, self.conversation
        if not self.config.duplex:
            limits.conversation(len(conversation.items) + 1, conversation.nbytes() + item.nbytes)
            return []
        limits.conversation(1, item.nbytes)
        gone = conversation.keep_latest(limits.conversation_items - 1)
        while conversation.items and conversation.nbytes() + item.nbytes > limits.conversation_bytes:
            gone += self.conversation.keep_latest(len(self.conversation.items) - 1)
        return [oe.ItemDeleted(item_id) for item_id in gone]

    # ---- responses ----
    def _open_response(self, now: float) -> Effects:
        item = self.conversation.new_item("assistant", status="in_progress", spoken=self.config.audio_out)
        if self.response is not None:
            self.past_responses.add(self.response.id)
        kv, unit = self._last_listen
        self.response = Response(new_id("resp"), item, self.epoch, kv_before=kv, unit_before=unit)
        evicted = self._room(item)
        previous, _ = self.conversation.add(item)
        r = self.response
        part = {"type": "output_audio" if self.config.audio_out else "output_text",
                "transcript" if self.config.audio_out else "text": ""}
        events: list[ServerEvent] = [*evicted]
        if self.config.duplex:
            events.append(oe.ResponseSpeak(r.id, self.epoch))
        events += [
            oe.ResponseCreated(self._response_dict(r)),
            oe.ItemAdded(previous, item.to_dict()),
            oe.OutputItemAdded(r.id, 0, item.to_dict()),
            oe.ContentPartAdded(r.id, item.id, 0, 0, part),
        ]
        return Effects(events)

    def _response_dict(self, r: Response, status: str = "in_progress",
                       details: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": r.id, "object": "realtime.response", "status": status, "status_details": details,
                "output": [r.item.to_dict()] if status != "in_progress" else [],
                "output_modalities": list(self.config.output_modalities),
                "audio": {"output": {"format": {"type": "audio/pcm", "rate": self.config.output_rate},
                                     "voice": self.config.voice}},
                "usage": usage_block(r.usage.counts) if status != "in_progress" else None}

    def _finish_response(self, status: str, details: dict[str, Any] | None = None) -> Effects:
        r = self.response
        r.done = True
        item = r.item
        item.status = "completed" if status == "completed" else "incomplete"
        ids = {"response_id": r.id, "item_id": item.id, "output_index": 0, "content_index": 0}
        if self.config.audio_out:
            events: list[ServerEvent] = [oe.OutputAudioDone(**ids), oe.TranscriptDone(**ids, transcript=item.text)]
            part = {"type": "output_audio", "transcript": item.text}
        else:
            events = [oe.TextDone(**ids, text=item.text)]
            part = {"type": "output_text", "text": item.text}
        events += [
            oe.ContentPartDone(**ids, part=part),
            oe.OutputItemDone(r.id, 0, item.to_dict()),
            oe.ItemDone(item.to_dict()),
            oe.ResponseDone(self._response_dict(r, status, details)),
            oe.RateLimitsUpdated([{
                "name": "context_tokens", "limit": CONTEXT_TOKENS,
                "remaining": max(0, CONTEXT_TOKENS - r.kv_length), "reset_seconds": 0}]),
        ]
        if self.config.duplex:
            events.append(oe.ResponseListen(r.id, self.epoch, status == "completed"))
        return Effects(events)

    def heard_ms(self, r: Response) -> float:
        """How much of a reply the listener has heard: acked, else as if played in real time from its first audio."""
        now = self.clock()
        if self.config.playback_commit_policy == "ack_only":
            return r.ack_ms
        if r.ack_at is not None:
            return min(r.item.audio_ms, r.ack_ms + (now - r.ack_at) * 1000)
        if r.first_audio_at is None:
            return 0.0
        return min(r.item.audio_ms, (now - r.first_audio_at) * 1000)

    def _interrupt(self, reason: str, heard_ms: float | None = None) -> Effects:
        """Barge-in, cancel, clear: the reply stops where the listener stopped hearing it."""
        r = self.active
        if r is None:
            return Effects()
        heard = self.heard_ms(r) if heard_ms is None else heard_ms
        cut = r.item.truncate(heard)
        self._plan_rollback(r, always=True)  # the step in flight may have said more than was sent
        self.epoch += 1
        out = Effects(cancel=True)
        out.extend(self._finish_response("cancelled", {"type": "cancelled", "reason": reason}))
        out.events.append(oe.ItemTruncated(r.item.id, 0, round(cut)))
        self.overlap.reset()
        return out

    def _plan_rollback(self, r: Response, always: bool = False) -> None:
        """Duplex: the next step takes the LLM back to the last heard step (or to before the reply)."""
        if not self.config.duplex:
            return  # turn-based: the next turn's messages carry the cut transcript; the LLM stage rebuilds
        heard = r.item.heard_marks(r.item.truncated_ms if r.item.truncated_ms is not None else r.item.audio_ms)
        if not always and len(heard) == len(r.item.marks):
            return  # every step of the reply was (at least partly) heard: nothing to take back
        target = (heard[-1].kv_after, heard[-1].unit) if heard else (r.kv_before, r.unit_before)
        if target[0] >= 0:
            self._rollback = target

    # ---- step events ----
    def on_step_event(self, step: PlannedStep, ev: StepEvent) -> Effects:
        if self.is_stale(step, ev):
            return Effects()
        if step.kind == "chat":
            return self._chat_event(step, ev)
        out = Effects()
        kv = int(ev.metrics.get("kv_cache_length", -1))
        if ev.kind == "listen":
            if step.kind == "duplex" and kv >= 0:
                self._last_listen = (kv, step.unit)
            if self.active is not None:
                self._count(ev)
                out.extend(self._finish_response("completed"))
            return out
        if self.active is None:
            out.extend(self._open_response(self.clock()))
        self._count(ev)
        if kv >= 0:
            self.response.kv_length = kv
        out.events += self._delta_events(ev, kv, step.unit)
        return out

    def _count(self, ev: StepEvent) -> None:
        if ev.chunk_usage and self.response is not None:
            self.response.usage.add(ev.chunk_usage)

    def _delta_events(self, ev: StepEvent, kv: int = -1, unit: int = -1) -> list[ServerEvent]:
        r = self.response
        ids = {"response_id": r.id, "item_id": r.item.id, "output_index": 0, "content_index": 0}
        if ev.kind == "text" and ev.text:
            r.item.add_text(ev.text, voiced=self.config.audio_out)
            delta = oe.TranscriptDelta if self.config.audio_out else oe.TextDelta
            return [delta(**ids, delta=ev.text)]
        if ev.kind == "audio" and len(ev.audio) and self.config.audio_out:
            dur_ms = len(ev.audio) * 1000 / OUTPUT_RATE
            mark = r.item.add_audio(dur_ms, kv, unit)
            if r.first_audio_at is None:
                r.first_audio_at = self.clock()
            pcm = encode_pcm16_base64(resample(ev.audio, OUTPUT_RATE, self.config.output_rate))
            return [oe.OutputAudioDelta(**ids, delta=pcm, metadata={
                "epoch": self.epoch, "audio_start_ms": round(mark.start_ms), "audio_ms": round(dur_ms),
                "kv_cache_length": kv})]
        return []

    def _chat_event(self, step: PlannedStep, ev: StepEvent) -> Effects:
        if self.active is None or self.active.id != step.response_id:
            return Effects()
        self._count(ev)
        if ev.kind == "done":
            self.response.kv_length = int(ev.metrics.get("kv_cache_length", 0))
            return self._finish_response("completed" if ev.reason != "length" else "incomplete",
                                         None if ev.reason != "length" else {"type": "incomplete",
                                                                             "reason": "max_output_tokens"})
        return Effects(self._delta_events(ev))

    def on_step_error(self, step: PlannedStep, code: str, message: str) -> Effects:
        """A step the stages refused for the client's input: say so; its response (if any) failed."""
        out = Effects([error_event(ProtocolError(code, message))])
        if step.epoch == self.epoch and self.active is not None and step.kind == "chat":
            out.extend(self._finish_response("failed", {"type": "failed", "error": {"code": code,
                                                                                     "message": message}}))
        return out

    def on_close(self, reason: str, message: str | None) -> list[ServerEvent]:
        out = [] if self.active is None else \
            self._finish_response("cancelled", {"type": "cancelled", "reason": reason}).events
        return [*out, closed_event(self.session_id, reason, self.usage.snapshot(), message)]

    def wanted(self, step: PlannedStep) -> bool:
        """A chat step whose response was cancelled while it waited need not run."""
        return step.kind != "chat" or (self.active is not None and self.active.id == step.response_id)


def usage_block(counts: dict[str, int]) -> dict[str, Any]:
    """The stages' token counts in OpenAI's `usage` shape."""
    text_in, audio_in = counts.get("input_text_tokens", 0), counts.get("input_audio_tokens", 0)
    image_in = counts.get("input_vision_tokens", 0)
    text_out, audio_out = counts.get("output_text_tokens", 0), counts.get("output_speech_tokens", 0)
    return {
        "total_tokens": text_in + audio_in + image_in + text_out + audio_out,
        "input_tokens": text_in + audio_in + image_in,
        "output_tokens": text_out + audio_out,
        "input_token_details": {"text_tokens": text_in, "audio_tokens": audio_in, "image_tokens": image_in,
                                "cached_tokens": 0},
        "output_token_details": {"text_tokens": text_out, "audio_tokens": audio_out},
    }


def _whole_tenths(audio: np.ndarray) -> np.ndarray:
    """Zero-padded to whole tenths of a second: what the audio encoder takes."""
    return np.pad(audio, (0, -len(audio) % (INPUT_RATE // 10)))


def _committable(audio: np.ndarray) -> np.ndarray:
    if len(audio) < MIN_COMMIT_MS * INPUT_RATE // 1000:
        raise ProtocolError("input_audio_buffer_commit_empty", f"the buffer holds under {MIN_COMMIT_MS} ms of audio")
    return _whole_tenths(audio)


_HANDLERS: dict[type[oe.ClientEvent], Callable[[OpenAIRealtimeState, Any], Effects]] = {
    oe.SessionUpdate: OpenAIRealtimeState._session_update,
    oe.AudioAppend: OpenAIRealtimeState._append,
    oe.BufferCommit: OpenAIRealtimeState._commit,
    oe.BufferClear: OpenAIRealtimeState._clear,
    oe.ItemCreate: OpenAIRealtimeState._item_create,
    oe.ItemRetrieve: OpenAIRealtimeState._item_retrieve,
    oe.ItemDelete: OpenAIRealtimeState._item_delete,
    oe.ItemTruncate: OpenAIRealtimeState._item_truncate,
    oe.ResponseCreate: OpenAIRealtimeState._response_create,
    oe.ResponseCancel: OpenAIRealtimeState._response_cancel,
    oe.OutputClear: OpenAIRealtimeState._output_clear,
    oe.PlaybackAck: OpenAIRealtimeState._playback_ack,
    oe.SessionClose: OpenAIRealtimeState._close,
    oe.Heartbeat: OpenAIRealtimeState._heartbeat,
}
