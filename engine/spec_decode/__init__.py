"""Speculative decoding: proposers, the rejection sampler and draft-length controllers."""
