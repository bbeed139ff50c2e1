"""The TTS: a Llama over [text condition | audio_bos | speech codes] predicting the next speech token (25/s), the
one definition the ONNX graph `tts/1/model.onnx` is traced from (`forward`, a `DenseCache`) and the device engine
runs (`TtsHead` in engine/tts.py: `condition`, `emb_code`, `head_code` around a `PagedDecoder` of `model`).

Follows MiniCPM-o 4.5's `MiniCPMTTS` (OpenBMB/MiniCPM-o-Demo `MiniCPMO45/modeling_minicpmo_unified.py`), names as
`tts.*` in the checkpoint: `model` is a transformers `LlamaModel` built from `tts_config` (engine/model.py's
decoder without q/k norm; its `embed_tokens` [32000, h] is never used); `projector_semantic` / `projector_spk` are
`MultiModalProjector`s from the LLM width; `head_code.0` is weight-normed in the file (folded at load). The duplex
path never applies `projector_spk` (4.5 passes no speaker embedding; the voice lives in token2wav): it is loaded and
left out of the graph.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from ..model_config import TtsDims
from .cache import DenseCache
from .model import Decoder, Projector


class DuplexTTS(nn.Module):
    def __init__(self, d: TtsDims, llm_hidden: int) -> None:
        super().__init__()
        h = d.decoder.hidden
        self.normalize = d.normalize_projected_hidden
        self.model = Decoder(d.decoder, vocab=d.decoder.vocab)  # model.embed_tokens: [32000, h], unused
        self.emb_text = nn.Embedding(d.num_text_tokens, h)  # [152064, 768]
        self.emb_code = nn.ModuleList([nn.Embedding(d.num_audio_tokens, h)])  # [6562, 768]
        self.head_code = nn.ModuleList([nn.Linear(h, d.num_audio_tokens, bias=False)])  # weight-normed in the file
        self.projector_semantic = Projector(llm_hidden, h)  # 4096 -> 768 -> 768
        self.projector_spk = Projector(llm_hidden, h)  # in the file; 4.5's inference never applies it

    def semantic(self, llm_hidden: torch.Tensor) -> torch.Tensor:
        """[..., H_llm] -> [..., h]: L2norm(projector_semantic(h)), the LLM hidden state's part of a text token's
        condition (`_convert_results_to_tts_input`)."""
        x = self.projector_semantic(llm_hidden)
        return functional.normalize(x, p=2, dim=-1) if self.normalize else x

    def forward(
        self,
        text_ids: torch.Tensor,  # [B, T]
        llm_hidden: torch.Tensor,  # [B, T, H_llm]
        has_hidden: torch.Tensor,  # [B, T] bool: text positions with an LLM hidden state (not audio_bos)
        code_ids: torch.Tensor,  # [B, T]
        is_code: torch.Tensor,  # [B, T] bool
        position_ids: torch.Tensor,  # [B, T] int64
        past_mask: torch.Tensor,  # [B, P] bool
        past_key: torch.Tensor,  # [L, B, KV, P, D]
        past_value: torch.Tensor,
        last_index: torch.Tensor,  # [B] int64
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        condition = self.emb_text(text_ids) + torch.where(has_hidden[..., None], self.semantic(llm_hidden), 0.0)
        x = torch.where(is_code[..., None], self.emb_code[0](code_ids), condition)
        cache = DenseCache.causal(past_mask, past_key, past_value, x.shape[1])
        hidden = self.model(x, position_ids, cache)
        last = hidden[torch.arange(hidden.shape[0]), last_index]
        return self.head_code[0](last), *cache.present()
