"""Audio encoder: whole utterances (stateless, chunks of equal length in one forward), and the duplex stream
(per-session Whisper KV cache, as MiniCPM-o 4.5's reference encodes what the LLM hears while duplex)."""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np

from ..engine.exported import Engine
from ..engine.kv_batch import KvBatch, KvCache
from ..engine.lane import Handoff, Lane
from ..engine.protocol import PagedCache
from ..errors import Code, StepError
from ..media.audio_mel import CONTEXT_FRAMES, HOP, MelChunk, MelStream, mel_filterbank
from ..media.pcm import pcm_problem
from ..model_config import AudioEncoderDims
from ..stage_io import AudioEncoderRequest, AudioEncoderResult
from .base import isolated

PIECE_SAMPLES = 30 * 16_000  # the reference encodes a longer utterance as 30 s pieces (`chunk_audio`)


class AudioEncoderStage:
    """Whole utterances as MiniCPM-o's `get_audio_embedding` encodes them (MiniCPMO45/processing_minicpmo.py
    `process_audio_batch`): 30 s pieces, each its own mel (zero-padded to a whole hop, as the reference's
    padding to 30 s is) and its own forward, their tokens concatenated."""

    def __init__(self, engine: Engine, samples_per_token: int) -> None:
        self.engine = engine
        self.samples_per_token = samples_per_token  # the shortest piece the graph takes (one token's samples)
        self.pool = samples_per_token // (2 * HOP)  # hop, conv stride 2, then the pooling

    def tokens(self, n_samples: int) -> int:
        """The reference's token count for a piece (`_get_feat_extract_output_lengths` of ceil(n / hop) frames)."""
        frames = -(-n_samples // HOP)
        return ((frames + 1) // 2) // self.pool

    def pieces(self, audio: np.ndarray) -> list[np.ndarray]:
        audio = np.asarray(audio, np.float32).reshape(-1)
        out = []
        for start in range(0, len(audio), PIECE_SAMPLES):
            piece = audio[start:start + PIECE_SAMPLES]
            out.append(np.pad(piece, (0, max(-len(piece) % HOP, self.samples_per_token - len(piece)))))
        return out

    def _encode(self, chunks: list[np.ndarray]) -> list[np.ndarray]:
        return list(self.engine.run({"audio": np.stack(chunks)})["embeds"])

    def run(self, requests: list[AudioEncoderRequest]) -> list[AudioEncoderResult | Exception]:
        results: list[AudioEncoderResult | Exception] = [AudioEncoderResult() for _ in requests]
        groups: dict[int, list[tuple[int, int]]] = defaultdict(list)  # padded length -> (request, piece)
        pieces: list[list[np.ndarray]] = []
        for i, r in enumerate(requests):
            audio = np.asarray(r.audio, np.float32).reshape(-1)
            pieces.append(self.pieces(audio))
            if len(audio) == 0:
                results[i] = ValueError("audio_encoder got an empty chunk")
            elif problem := pcm_problem(audio):
                results[i] = StepError(Code.BAD_AUDIO, f"audio_encoder: {problem}")
            else:
                for k, piece in enumerate(pieces[-1]):
                    groups[len(piece)].append((i, k))
        embeds: dict[tuple[int, int], np.ndarray | Exception] = {}
        for rows in groups.values():  # padding would change the mel normalisation: batch equal lengths
            for key, out in zip(rows, isolated(self._encode, [pieces[i][k] for i, k in rows]), strict=True):
                embeds[key] = out
        for i, r in enumerate(requests):
            if isinstance(results[i], Exception):
                continue
            audio_len = len(np.asarray(r.audio).reshape(-1))
            parts = []
            for k in range(len(pieces[i])):
                out = embeds[(i, k)]
                if isinstance(out, Exception):
                    results[i] = out
                    break
                # a piece shorter than one token's samples ran padded; keep the reference's count of it
                parts.append(out[: self.tokens(min(PIECE_SAMPLES, audio_len - k * PIECE_SAMPLES))])
            else:
                results[i] = AudioEncoderResult(embeds=np.concatenate(parts))
        return results


@dataclass
class AudioStream:
    """One duplex session's streaming audio state: its mel stream and its Whisper KV cache (host arrays for the
    ONNX graph, or its place in the device encoder's pool)."""

    mel: MelStream = field(default_factory=MelStream)
    cache: KvCache | PagedCache | None = None  # None until the first chunk
    restarts: int = 0  # device pool: the entry's restarts this stream has seen (an undo may put back an older count)

    @property
    def nbytes(self) -> int:
        return self.mel.nbytes + (self.cache.nbytes if isinstance(self.cache, KvCache) else 0)


class StreamKv(Protocol):
    """Where the streams' Whisper KV caches live and how a group of equal chunks is encoded over them: host arrays
    through the `stream.onnx` graph (`GraphStreamKv`), or a pool on the device (`engine.whisper.PagedWhisper`)."""

    name: str
    # its host bookkeeping (the streams' places, the staging of a pool's writes): taken by a stream's reservation
    # or release (the engine thread) and by an encode's staging (the preparation thread), never over the compute
    lock: Any

    def reserve(self, stream: AudioStream, frames: int) -> None:
        """Room for the stream's next chunk of `frames` encoder frames, taken before the batch (a pool refuses
        now: pool_full); a new stream is admitted with one chunk's room."""
        ...

    def release(self, stream: AudioStream) -> None: ...

    def restart(self, stream: AudioStream, due: bool) -> None:
        """The stream's cache starts over before this chunk when `due` (the stream's first chunk, or the positions
        would run out), or when the cache it holds is stale (a device pool's entry restarted after an undo)."""
        ...

    def mels(self, items: list[tuple[MelStream, np.ndarray]], filters: np.ndarray) -> list[MelChunk]:
        """Each stream's next chunk's mel (`MelStream.push`: on the host, or on the device, batched)."""
        ...

    def encode(self, streams: list[AudioStream], chunks: list[MelChunk], frames: int) -> Any:
        """Rows of equal frames (each chunk's mel at the end of `frames`, its missing left context masked):
        their embeddings [B, T / pool, H] (a host array, or a device tensor kept where the LLM reads it); each
        stream's cache advances by its chunk."""
        ...



class GraphStreamKv:
    """The `stream.onnx` graph: every row's cache goes in, padded to the longest, and comes back grown."""

    name = "onnx"

    def __init__(self, engine: Engine, dims: AudioEncoderDims) -> None:
        self.engine, self.dims = engine, dims
        self.lock = threading.RLock()

    def reserve(self, stream: AudioStream, frames: int) -> None:
        """Host arrays grow as they must."""

    def release(self, stream: AudioStream) -> None:
        stream.cache = None

    def restart(self, stream: AudioStream, due: bool) -> None:
        if due or stream.cache is None:
            d = self.dims
            stream.cache = KvCache.empty(d.layers, d.heads, d.d_model // d.heads)

    def mels(self, items: list[tuple[MelStream, np.ndarray]], filters: np.ndarray) -> list[MelChunk]:
        return [stream.push(audio, filters) for stream, audio in items]

    def encode(self, streams: list[AudioStream], chunks: list[MelChunk], frames: int) -> np.ndarray:
        mel = np.zeros((len(chunks), self.dims.n_mels, frames), np.float32)
        mel_mask = np.ones((len(chunks), frames), bool)
        for r, chunk in enumerate(chunks):
            mel[r, :, frames - chunk.mel.shape[1]:] = chunk.mel
            mel_mask[r, : frames - chunk.mel.shape[1]] = False
        batch = KvBatch([s.cache for s in streams])  # type: ignore[misc]
        new_len = np.full(len(streams), (mel.shape[2] - 2 * CONTEXT_FRAMES) // 2, np.int64)  # encoder frames per row
        feeds = batch.feeds(new_len)
        del feeds["last_index"]
        out = self.engine.run({"mel": mel, "mel_mask": mel_mask, **feeds})
        batch.advance(out["present_key"], out["present_value"], new_len)
        for r, stream in enumerate(streams):
            stream.cache = batch.extract(r)
        return out["embeds"]


class AudioStreamEncoder:
    """Each session's duplex chunk against its own Whisper KV cache (positions continue across chunks; the
    cache restarts before it would pass `max_positions`, 1500 = 30 s), all sessions' chunks in one batch.
    `kv`: where the caches live (`StreamKv`); an exported `stream.onnx` graph (`Engine`) runs them as host arrays."""

    def __init__(self, kv: StreamKv | Engine, dims: AudioEncoderDims, samples_per_token: int) -> None:
        self.kv: StreamKv = cast(StreamKv, kv) if hasattr(kv, "restart") else GraphStreamKv(kv, dims)
        self.dims = dims
        self.samples_per_token = samples_per_token
        self.filters = mel_filterbank(dims.n_mels)
        # A pool's tables change on the engine thread (a call's reservation, END's release) while a preparation
        # thread encodes other streams: the kv's lock guards its bookkeeping only, so a reservation never waits for
        # an encode's compute; `_runs` lets one encode run at a time (the staging's views live until the next).
        self._lock = self.kv.lock
        self._runs = threading.Lock()
        self.lane = Lane(getattr(self.kv, "device", None))  # its own CUDA stream on a GPU (engine/lane.py)

    def _new_frames(self, n_samples: int) -> int:
        """Encoder frames a chunk of `n_samples` adds to the cache: its core mel frames after the stride-2 conv."""
        return (n_samples + -n_samples % self.samples_per_token) // HOP // 2

    def reserve(self, stream: AudioStream, n_samples: int) -> None:
        """The room for the stream's next chunk, taken before the batch: `pool_full` (retryable) is raised here,
        never mid-step."""
        with self._lock:
            self.kv.reserve(stream, self._new_frames(n_samples))

    def release(self, stream: AudioStream) -> None:
        """END or eviction: the stream's cache goes (a pool's blocks go back)."""
        with self._lock:
            self.kv.release(stream)

    def run(self, items: list[tuple[np.ndarray, AudioStream]]) -> list[Any]:
        """Embeddings [audio_tokens(len(audio)), H] per item; each item's stream advances by its chunk."""
        embeds, handoff = self.launch(items)
        handoff.wait()  # the caller's stream reads them next
        return embeds

    def launch(self, items: list[tuple[np.ndarray, AudioStream]]) -> tuple[list[Any], Handoff]:
        """`run` on the encoder's lane: the embeddings, and the hand-off a consumer on another stream waits on
        before it reads them (the LLM's engine, before the request's first iteration)."""
        with self._runs, self.lane.work():
            embeds = self._run(items)
            return embeds, self.lane.handoff(embeds)

    def _run(self, items: list[tuple[np.ndarray, AudioStream]]) -> list[Any]:
        results: list[Any] = [None] * len(items)
        groups: dict[int, list[int]] = defaultdict(list)
        audios = []
        for audio, _ in items:
            audio = np.asarray(audio, np.float32).reshape(-1)
            if len(audio) == 0:
                raise ValueError("audio_encoder got an empty chunk")
            audios.append(np.pad(audio, (0, -len(audio) % self.samples_per_token)))
        chunks = self.kv.mels([(stream.mel, a) for (_, stream), a in zip(items, audios, strict=True)], self.filters)
        for i, chunk in enumerate(chunks):
            groups[chunk.mel.shape[1] + (CONTEXT_FRAMES if chunk.first else 0)].append(i)
        for frames, rows in groups.items():
            with self._lock:
                for i in rows:
                    self._maybe_reset(items[i][1], chunks[i])
            embeds = self.kv.encode([items[i][1] for i in rows], [chunks[i] for i in rows], frames)
            for r, i in enumerate(rows):
                results[i] = embeds[r]
        return results

    def _restarts(self, length: int, frames_after_conv: int) -> bool:
        """The reference drops the cache when past + the chunk's encoder frames (context included) would reach
        the position table's end (get_audio_embedding_streaming: `cache_length + max_seq_len >= apm_max_len`)."""
        return length + frames_after_conv >= self.dims.max_positions

    def _maybe_reset(self, stream: AudioStream, chunk: MelChunk) -> None:
        frames_after_conv = (chunk.mel.shape[1] - 1) // 2 + 1
        if stream.cache is None:  # a call that skipped `reserve` (a direct caller)
            self.kv.reserve(stream, (chunk.mel.shape[1] - CONTEXT_FRAMES * (1 if chunk.first else 2)) // 2)
        length = stream.cache.length if stream.cache is not None else 0
        self.kv.restart(stream, stream.mel.chunks == 1 or self._restarts(length, frames_after_conv))
