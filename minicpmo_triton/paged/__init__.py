"""Session state resident on the device: a KV pool per decoder, paged attention, the paged LLM engine, sampling
and the duplex decode rules on the device, and the ledgers of bytes moved and work done."""
