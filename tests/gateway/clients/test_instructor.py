"""instructor against the gateway on the default model: a pydantic model extracted in the three
modes that work with any OpenAI-compatible server.

instructor is not in the `dev` extra (pyproject.toml says why): these tests run where it is
installed (`pip install --no-deps "instructor>=1.17,<2" "docstring-parser>=0.16,<1"`).
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.gateway.clients.shared import API_KEY, EXTRACT, MODEL, STRUCTURED_MAX_TOKENS, Person

instructor: Any = pytest.importorskip("instructor", reason="instructor is installed apart (pyproject.toml)")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODES = [
    # response_format {"type": "json_object", "schema": ...} (llama.cpp's spelling): the schema is enforced.
    pytest.param("JSON_SCHEMA", id="json_schema"),
    # response_format {"type": "json_object"} and the schema in the prompt: the gateway enforces a
    # JSON object, the keys are the model's (they match at temperature 0 with this prompt).
    pytest.param("JSON", id="json"),
    # One function `Person`, forced by name (tool_choice {"type": "function", ...}): exactly one call.
    pytest.param("TOOLS", id="tools"),
]


@pytest.mark.parametrize("mode", MODES)
def test_extracts_a_pydantic_model(base_url: str, mode: str) -> None:
    client = instructor.from_openai(
        openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=60),
        mode=instructor.Mode[mode],
    )
    person = client.chat.completions.create(
        model=MODEL,
        response_model=Person,
        messages=[{"role": "user", "content": EXTRACT}],
        max_tokens=STRUCTURED_MAX_TOKENS,
        temperature=0,
        max_retries=0,  # instructor's re-asking would hide an invalid first answer
    )
    assert isinstance(person, Person)
