"""The caller's media as the model takes it: Whisper's mel, images decoded and sliced, float PCM, tokenizers."""
