"""The embedded inference engine: continuous batching and per-request speculative decoding."""
