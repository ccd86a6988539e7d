"""Structured outputs: a request's grammar (what it is, how it is checked and compiled) and its live
state in the engine (the masks, forced tokens and draft cuts that keep speculation lossless)."""
