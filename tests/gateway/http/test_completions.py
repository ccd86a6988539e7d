"""/v1/completions on the embedded engine."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest

from specgate.engine.engine import Engine
from specgate.engine.sampling_params import SamplingParams


def test_text_prompt_matches_the_engine(
    client: openai.OpenAI, model_name: str, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine()
    ids = engine.tokenizer.encode("def add(a, b):")
    engine.add_request("ref", ids, SamplingParams(max_tokens=10, temperature=0.0))
    expected = ""
    while engine.has_unfinished():
        expected += "".join(o.new_text for o in engine.step())
    r = client.completions.create(model=model_name, prompt="def add(a, b):", max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == expected
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 10
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == expected


def test_default_max_tokens_is_16(client: openai.OpenAI, model_name: str) -> None:
    r = client.completions.create(
        model=model_name, prompt="abc", temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None and r.usage.completion_tokens == 16


def test_echo_and_logprobs(client: openai.OpenAI, model_name: str) -> None:
    r = client.completions.create(
        model=model_name,
        prompt="hello",
        max_tokens=5,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    choice = r.choices[0]
    assert choice.text.startswith("hello")
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 5
    assert lp.text_offset == [5, 6, 7, 8, 9]  # one character per token in the tiny vocabulary
    assert all(len(t) == 2 for t in lp.top_logprobs or [])
    assert "".join(lp.tokens) == choice.text[5:]


def test_stream(client: openai.OpenAI, model_name: str) -> None:
    ref = client.completions.create(model=model_name, prompt="xyz", max_tokens=8, temperature=0)
    chunks = list(
        client.completions.create(
            model=model_name,
            prompt="xyz",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == ref.usage.completion_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "a", "suffix": "z"}, "suffix"),
        ({"prompt": "a", "best_of": 2}, "best_of"),
        ({"prompt": [100000]}, "prompt"),
        ({"prompt": "a", "logprobs": 21}, "logprobs"),
        ({"prompt": "a", "extra_body": {"guided_regex": "(a"}}, "guided_regex"),
        (
            {"prompt": "a", "extra_body": {"structured_outputs": {"choice": ["a"], "regex": "b"}}},
            "structured_outputs",
        ),
        ({"prompt": "a", "extra_body": {"guided_decoding_backend": "outlines"}}, "guided_decoding_backend"),
        ({"prompt": "a", "extra_body": {"frobnicate": True}}, "frobnicate"),
        ({"prompt": "a", "extra_body": {"chat_template_kwargs": {"x": 1}}}, "chat_template_kwargs"),
    ],
)
def test_refusals(client: openai.OpenAI, model_name: str, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model_name, max_tokens=2, **kwargs)
    assert exc.value.body["param"] == param  # type: ignore[index]
