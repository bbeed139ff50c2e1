"""Audio encoder: whole utterances (stateless, chunks of equal length in one forward), and the duplex stream
(per-session Whisper KV cache, as MiniCPM-o 4.5's reference encodes what the LLM hears while duplex)."""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np

from ..audio_mel import CONTEXT_FRAMES, HOP, MelChunk, MelStream, mel_filterbank
from ..engines import Engine
from ..errors import Code, StepError
from ..kv_batch import KvBatch, KvCache
from ..model_config import AudioEncoderDims
from ..paged.protocol import PagedCache
from ..pcm import pcm_problem
from ..stage_io import AudioEncoderRequest, AudioEncoderResult
from .base import isolated

if TYPE_CHECKING:  # torch: imported where the paged encoder is built
    from ..paged.whisper import PagedWhisper

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
    ONNX graph, or its place in the paged encoder's pool)."""

    mel: MelStream = field(default_factory=MelStream)
    cache: KvCache | PagedCache | None = None  # None until the first chunk
    restarts: int = 0  # paged: the pool entry's restarts this stream has seen (an undo may put back an older count)

    @property
    def nbytes(self) -> int:
        return self.mel.nbytes + (self.cache.nbytes if isinstance(self.cache, KvCache) else 0)


class AudioStreamEncoder:
    """Each session's duplex chunk against its own Whisper KV cache (positions continue across chunks; the
    cache restarts before it would pass `max_positions`, 1500 = 30 s), all sessions' chunks in one batch.
    `engine`: the `stream.onnx` graph (the cache goes in and comes back grown each call) or the paged encoder
    (`paged/whisper.py`: the cache stays in its pool, written in place)."""

    def __init__(self, engine: Engine | PagedWhisper, dims: AudioEncoderDims, samples_per_token: int) -> None:
        self.paged = cast("PagedWhisper", engine) if getattr(engine, "name", "") == "paged" else None
        self.engine = cast(Engine, engine)  # used only where self.paged is None
        self.dims = dims
        self.samples_per_token = samples_per_token
        self.filters = mel_filterbank(dims.n_mels)
        # the pool's tables change on the stage's thread (reserve, run) and on an idle sweep's (release)
        self._lock = threading.RLock()
        self._restarted: dict[int, int] = {}  # paged: restarts of each pool entry (its frames rewritten from 0)

    def _new_frames(self, n_samples: int) -> int:
        """Encoder frames a chunk of `n_samples` adds to the cache: its core mel frames after the stride-2 conv."""
        return (n_samples + -n_samples % self.samples_per_token) // HOP // 2

    def reserve(self, stream: AudioStream, n_samples: int) -> None:
        """The paged pool's room for the stream's next chunk, taken before the batch (a new stream is admitted
        with room for one chunk): `pool_full` (retryable) is raised here, never mid-step. ONNX: nothing to do."""
        if self.paged is None:
            return
        pool, new = self.paged.pool, self._new_frames(n_samples)
        with self._lock:
            if not isinstance(stream.cache, PagedCache):
                stream.cache = PagedCache(pool.open(new), 0)
            elif not self._restarts(stream.cache.length, new + 2):  # a restart needs no more than the stream holds
                pool.reserve(stream.cache.seq, stream.cache.length + new)

    def release(self, stream: AudioStream) -> None:
        """END or eviction: the stream's blocks go back to the pool."""
        if self.paged is not None and isinstance(stream.cache, PagedCache):
            with self._lock:
                self.paged.pool.free(stream.cache.seq)
                self._restarted.pop(stream.cache.seq, None)
            stream.cache = None

    def run(self, items: list[tuple[np.ndarray, AudioStream]]) -> list[np.ndarray]:
        """Embeddings [audio_tokens(len(audio)), H] per item; each item's stream advances by its chunk."""
        with self._lock:
            return self._run(items)

    def _run(self, items: list[tuple[np.ndarray, AudioStream]]) -> list[np.ndarray]:
        results: list[np.ndarray] = [np.zeros(0)] * len(items)
        groups: dict[int, list[int]] = defaultdict(list)
        chunks: list[MelChunk] = []
        for i, (audio, stream) in enumerate(items):
            audio = np.asarray(audio, np.float32).reshape(-1)
            if len(audio) == 0:
                raise ValueError("audio_encoder got an empty chunk")
            chunks.append(stream.mel.push(np.pad(audio, (0, -len(audio) % self.samples_per_token)), self.filters))
            groups[chunks[-1].mel.shape[1] + (CONTEXT_FRAMES if chunks[-1].first else 0)].append(i)
        for frames, rows in groups.items():
            for i in rows:
                self._maybe_reset(items[i][1], chunks[i])
            mel = np.zeros((len(rows), self.dims.n_mels, frames), np.float32)
            mel_mask = np.ones((len(rows), frames), bool)
            for r, i in enumerate(rows):
                mel[r, :, frames - chunks[i].mel.shape[1]:] = chunks[i].mel
                mel_mask[r, : frames - chunks[i].mel.shape[1]] = False
            streams = [items[i][1] for i in rows]
            embeds = self._encode_paged(streams, mel, mel_mask) if self.paged is not None else \
                self._encode_onnx(streams, mel, mel_mask)
            for r, i in enumerate(rows):
                results[i] = embeds[r]
        return results

    def _encode_onnx(self, streams: list[AudioStream], mel: np.ndarray, mel_mask: np.ndarray) -> np.ndarray:
        """The graph takes every row's cache, padded to the longest, and gives it back grown."""
        batch = KvBatch([s.cache for s in streams])  # type: ignore[misc]
        new_len = np.full(len(streams), (mel.shape[2] - 2 * CONTEXT_FRAMES) // 2, np.int64)  # encoder frames per row
        feeds = batch.feeds(new_len)
        del feeds["last_index"]
        out = self.engine.run({"mel": mel, "mel_mask": mel_mask, **feeds})
        batch.advance(out["present_key"], out["present_value"], new_len)
        for r, stream in enumerate(streams):
            stream.cache = batch.extract(r)
        return out["embeds"]

    def _encode_paged(self, streams: list[AudioStream], mel: np.ndarray, mel_mask: np.ndarray) -> np.ndarray:
        """The rows' caches stay in the pool: only the mel goes in and the embeddings come back."""
        assert self.paged is not None
        caches = [cast(PagedCache, s.cache) for s in streams]
        embeds = self.paged.encode([c.seq for c in caches], [c.length for c in caches], mel, mel_mask)
        new_len = (mel.shape[2] - 2 * CONTEXT_FRAMES) // 2
        for stream, cache in zip(streams, caches, strict=True):
            stream.cache = cache.truncated(cache.length + new_len)
        return embeds

    def _restarts(self, length: int, frames_after_conv: int) -> bool:
        """The reference drops the cache when past + the chunk's encoder frames (context included) would reach
        the position table's end (get_audio_embedding_streaming: `cache_length + max_seq_len >= apm_max_len`)."""
        return length + frames_after_conv >= self.dims.max_positions

    def _maybe_reset(self, stream: AudioStream, chunk: MelChunk) -> None:
        d = self.dims
        frames_after_conv = (chunk.mel.shape[1] - 1) // 2 + 1
        if self.paged is not None:  # a restart is a truncation: the stream keeps its place (and its admitted room)
            if not isinstance(stream.cache, PagedCache):  # a call that skipped `reserve` (a direct caller)
                self.reserve(stream, (chunk.mel.shape[1] - CONTEXT_FRAMES * (1 if chunk.first else 2)) * HOP)
            cache = cast(PagedCache, stream.cache)
            # a stream undone after a restart holds a length over frames the restart rewrote: it restarts too
            stale = stream.restarts != self._restarted.get(cache.seq, 0)
            if stream.mel.chunks == 1 or stale or self._restarts(cache.length, frames_after_conv):
                self.paged.pool.truncate(cache.seq, 0)
                stream.cache = cache.truncated(0)
                stream.restarts = self._restarted[cache.seq] = self._restarted.get(cache.seq, 0) + 1
        elif stream.cache is None or self._restarts(cast(KvCache, stream.cache).length, frames_after_conv):
            stream.cache = KvCache.empty(d.layers, d.heads, d.d_model // d.heads)
