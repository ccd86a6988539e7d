"""What the client-library tests ask the default model: short prompts whose greedy answers end well
inside the token budgets (a 135M model is not asked for quality, only for valid answers)."""

from __future__ import annotations

from pydantic import BaseModel

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "unused"  # the test gateway is in open mode; clients still want a key

# Greedy: "The capital of France is Paris." (8 tokens), then the end of the turn.
QUESTION = "What is the capital of France? Answer in one word."
MAX_TOKENS = 32
# For structured outputs and forced tool calls: the grammar makes the answer a Person.
EXTRACT = "John is 30 years old."
STRUCTURED_MAX_TOKENS = 64
# For a forced tool call: EXTRACT's call is decided by a near-tie (0.02-0.27 nats, by the CPU's
# bf16 path) between ' ' and ' "' after `"name":`, and the losing ' ' opens a string that never
# closes. Here every step's greedy choice leads by at least 1.6 nats on AVX2 and AVX-512 alike.
RECORD = "Record this person: John, 30 years old."
WEATHER = "What is the weather in Paris?"


class Person(BaseModel):
    # No docstring: the modes that put the schema in the prompt (instructor's JSON) would show the
    # model its description, which the 135M model then copies into its answer instead of the fields.
    name: str
    age: int
