"""The model's own decode rules in numpy, pure (logits and tokens in, tokens and states out): the duplex chunk, the
chat turn, the sliding window, sampling, a session's options. The CPU path runs them; they are the device rules'
test oracle."""
