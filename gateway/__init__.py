"""The WebSocket gateway: MiniCPM-o's backend protocol in front of the Triton duplex model."""
