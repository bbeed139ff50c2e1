"""Where a duplex session's spoken turn stands, for the TTS and for token2wav."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VoiceTurn:
    """MiniCPM-o's duplex loop (OpenBMB/MiniCPM-o-Demo MiniCPMO45/modeling_minicpmo_unified.py) keeps two turns:
    the TTS's (`tts_text_start_pos`, `tts_past_key_values`), ended only by a voiced <|turn_eos|> (:5218-5223), and
    token2wav's stream (`_reset_token2wav_for_new_turn`, :4406-4410), restarted at that same point (:5251-5252)
    and also when the caller forces a listen while the model is speaking (:5003-5011): the speech tokens it had
    buffered are dropped and it starts again from the voice prompt, while the TTS keeps its turn."""

    tts_open: bool = False
    restart: bool = False  # token2wav's stream restarts at the next voiced chunk

    def listened(self, turn_closed: bool) -> None:
        """A chunk that listened; a forced listen that closed the model's turn restarts token2wav."""
        if turn_closed:
            self.restart = True

    def starts(self) -> tuple[bool, bool]:
        """For the next voiced chunk: (the TTS's turn starts, token2wav's stream restarts)."""
        return not self.tts_open, not self.tts_open or self.restart

    def voiced(self, end_of_turn: bool) -> None:
        self.tts_open, self.restart = not end_of_turn, False

    def drop(self) -> None:
        """A cancel or a rollback: the spoken turn is over for both."""
        self.tts_open = self.restart = False
