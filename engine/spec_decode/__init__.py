"""Speculative decoding: the proposers, a step's drafts and draft trees, the draft-length
controllers, the rejection sampler, and what a verification leaves to speculation."""
