"""Dimensions and token ids of one model preset; written by the exporter, read by every stage."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SAMPLE_RATE_IN = 16_000
SAMPLE_RATE_OUT = 24_000
SPEECH_TOKENS_PER_SECOND = 25
SAMPLES_PER_SPEECH_TOKEN = SAMPLE_RATE_OUT // SPEECH_TOKENS_PER_SECOND  # 960


@dataclass(frozen=True)
class AudioEncoderDims:
    n_mels: int = 80
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    ffn: int = 256
    max_positions: int = 1500
    pool: int = 5  # 50 encoder frames/s -> 10 LLM tokens/s
    # A whole utterance attends in blocks of this many encoder frames, each to itself and those before it
    # (config.json `audio_chunk_length` 1.0 s x 50 frames/s); 0 = full attention
    chunk_frames: int = 50


@dataclass(frozen=True)
class VisionDims:
    """NaViT SigLIP (`vpm`) + a 2D resampler: every slice (at most 448x448 px) becomes `queries` LLM tokens."""

    image_size: int = 980  # vision_config.image_size: the position table's side, 70x70 patches
    patch: int = 14
    d_model: int = 64
    layers: int = 2  # layers run: vision_config.num_hidden_layers less one if drop_vision_last_layer
    heads: int = 4
    ffn: int = 256
    eps: float = 1e-6  # vision_config.layer_norm_eps; the resampler's LayerNorms use 1e-6 too
    queries: int = 64
    resampler_heads: int = 1  # LLM width / 128
    scale_resolution: int = 448  # slice_config.scale_resolution: a slice's area is at most this squared
    batch_slices: int = 16  # vision_batch_size: slices per forward

    @property
    def table_side(self) -> int:
        """Patches per side of the position table the slices' positions are bucketed into."""
        return self.image_size // self.patch

    @property
    def max_patches(self) -> int:
        """A bound on one slice's patches (aspect-preserving resizes can pass (448 / 14)^2 a little)."""
        return 2 * (self.scale_resolution // self.patch) ** 2


@dataclass(frozen=True)
class DecoderDims:
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 384
    vocab: int = 288
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    qk_norm: bool = True
    tie_word_embeddings: bool = False  # lm_head shares embed_tokens (Qwen3-8B: untied)


@dataclass(frozen=True)
class TtsDims:
    """MiniCPM-o's `tts_config`: a Llama over [text + LLM-hidden condition | audio_bos | speech codes]."""

    decoder: DecoderDims = field(
        default_factory=lambda: DecoderDims(
            hidden=64, layers=2, heads=4, kv_heads=4, head_dim=16, intermediate=192, vocab=32_000,
            rope_theta=10_000.0, qk_norm=False,
        )
    )  # `decoder.vocab`: LlamaModel's own embed_tokens (LlamaConfig's 32000), loaded but never used
    num_text_tokens: int = 288
    num_audio_tokens: int = 6562  # the last id is the speech EOS
    audio_bos_token_id: int = 0  # emb_text(audio_bos) ends every chunk's condition
    text_eos_token_id: int = 0  # read for completeness; the duplex path never feeds it
    normalize_projected_hidden: bool = True  # L2-normalise projector_semantic(h)
    # the Llama's position table (MiniCPMTTSConfig's default, configuration_minicpmo.py:85): a turn's cache
    # never runs past it (TtsStage starts the turn's cache over)
    max_positions: int = 4096


@dataclass(frozen=True)
class Token2WavDims:
    """Step-Audio2 token2wav (assets/token2wav): flow matching (conformer + DiT CFM) and the HiFT vocoder.

    The defaults are `tiny`'s widths; the streaming constants are MiniCPM-o 4.5's.
    """

    vocab: int = 6561  # S3 tokenizer v2 codes
    channels: int = 32  # conformer width, input embedding (512)
    heads: int = 2  # conformer heads (8)
    linear_units: int = 64  # conformer FFN (2048)
    num_blocks: int = 1  # token-rate conformer blocks (6)
    num_up_blocks: int = 1  # mel-rate conformer blocks (4)
    dit_depth: int = 2  # (16)
    dit_hidden: int = 32  # (512)
    dit_heads: int = 2  # (8)
    dit_head_dim: int = 16  # (64)
    dit_mlp_ratio: float = 2.0  # (4)
    hift_channels: int = 16  # HiFT base channels (512)
    f0_channels: int = 16  # F0 predictor width (512)
    n_mels: int = 80
    spk_embed_dim: int = 192  # the CAM++ voice vector (campplus.onnx's output; flow.yaml's spk_embed_dim)
    n_timesteps: int = 5  # MiniCPM-o's CFM steps
    chunk_tokens: int = 25  # tokens per streamed chunk (+ lookahead)
    lookahead: int = 3  # the conformer's pre_lookahead_len
    silence_token: int = 4218
    turn_lead_silence: int = 3  # a turn's speech starts with this many silence tokens
    mel_cache_frames: int = 8  # HiFT: mel frames carried to the next chunk
    source_cache_samples: int = 3840  # HiFT: source samples carried (= the cross-fade length)
    cache_tail_frames: int = 100  # attention caches keep the prompt + this many recent mel frames


@dataclass(frozen=True)
class SpecialTokens:
    """Token ids of the duplex control tokens (MiniCPM-o 4.5 ids in the real preset)."""

    im_start: int
    im_end: int
    audio_start: int
    audio_end: int
    unit: int
    unit_end: int
    image: int
    image_end: int
    slice: int
    slice_end: int
    image_id: int  # `<image_id>N</image_id>` numbers a chat prompt's images
    image_id_end: int
    tts_bos: int
    listen: int
    speak: int
    turn_eos: int
    chunk_eos: int
    chunk_tts_eos: int
    tts_pad: int
    audio_placeholder: int  # stands where audio embeddings are spliced into the prefill


@dataclass(frozen=True)
class DuplexDefaults:
    """The duplex loop's defaults as MiniCPM-o 4.5 ships them."""

    force_listen_count: int = 3
    max_new_speak_tokens_per_chunk: int = 20
    max_unit_text_chars: int = 28
    temperature: float = 0.7
    top_k: int = 20
    top_p: float = 0.8
    repetition_penalty: float = 1.05
    repetition_window: int = 512
    length_penalty: float = 1.1
    tts_tokens_per_chunk: int = 25  # returned per chunk; a 26th is sampled and dropped (generate_chunk)
    tts_temperature: float = 0.8
    # The Demo's `generate_chunk` builds top-k 20 / top-p 0.7 warpers and never applies them
    # (modeling_minicpmo_unified.py:6711, 6788-6822): its codes come from temperature and the penalty alone.
    # 0 / 1.0 = off; the `tts_top_k` / `tts_top_p` settings turn them on (stage_settings.py).
    tts_top_k: int = 0
    tts_top_p: float = 1.0
    tts_repetition_penalty: float = 1.05
    tts_repetition_window: int = 16  # over the chunk's own speech tokens
    context_tokens: int = 8192
    window_high_tokens: int = 8000  # the sliding window's watermarks (DuplexWindowConfig's basic mode)
    window_low_tokens: int = 6000
    window_max_units: int = 24  # DuplexWindowConfig's context mode: units held, then the oldest go
    window_previous_tokens: int = 500  # and at most this many tokens of what they said, kept as "previous"
    chunk_ms: int = 1000


@dataclass(frozen=True)
class PresetConfig:
    name: str
    audio: AudioEncoderDims
    llm: DecoderDims
    tts: TtsDims
    token2wav: Token2WavDims
    tokens: SpecialTokens
    duplex: DuplexDefaults = field(default_factory=DuplexDefaults)
    tokenizer: str = "bytes"  # "bytes" or "huggingface" (files in the stage folder)
    vision: VisionDims = field(default_factory=VisionDims)

    @property
    def audio_tokens_per_second(self) -> int:
        frames_per_second = SAMPLE_RATE_IN // 160 // 2  # hop 160, conv stride 2
        return frames_per_second // self.audio.pool

    @property
    def samples_per_audio_token(self) -> int:
        return SAMPLE_RATE_IN // self.audio_tokens_per_second

    def audio_tokens(self, n_samples: int) -> int:
        """Tokens the audio encoder makes of `n_samples` (it pads to a whole token)."""
        return -(-n_samples // self.samples_per_audio_token)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PresetConfig:
        tts = dict(data["tts"])
        tts["decoder"] = DecoderDims(**tts["decoder"])
        t2w = dict(data["token2wav"])
        return cls(
            name=data["name"],
            audio=AudioEncoderDims(**data["audio"]),
            llm=DecoderDims(**data["llm"]),
            tts=TtsDims(**tts),
            token2wav=Token2WavDims(**t2w),
            tokens=SpecialTokens(**data["tokens"]),
            duplex=DuplexDefaults(**data.get("duplex", {})),
            tokenizer=data.get("tokenizer", "bytes"),
            vision=VisionDims(**data.get("vision", {})),
        )

    @classmethod
    def load(cls, path: Path) -> PresetConfig:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


STAGE_CONFIG_FILE = "stage.json"


def load_stage_config(version_dir: Path) -> PresetConfig:
    path = Path(version_dir) / STAGE_CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python -m export --preset tiny` first")
    return PresetConfig.load(path)
