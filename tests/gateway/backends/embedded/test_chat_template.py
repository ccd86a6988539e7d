"""The configured chat template (`embedded.chat_template`, `--chat-template`): what a value stands
for, that it overrides the tokenizer's own everywhere a template is read, that a bad one stops the
start, and a chat request through the gateway to a model without a template of its own."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
from transformers import AutoTokenizer

from specgate.gateway.backends.embedded.backend import EmbeddedBackend
from specgate.gateway.backends.embedded.builtin_templates import BUILTIN_TEMPLATES
from specgate.gateway.backends.embedded.chat_template import (
    NO_TEMPLATE,
    chat_template_for,
    chat_text,
    check_template,
    configured_template,
    normalize_messages,
    render_chat,
)
from specgate.gateway.protocol.schemas import ChatMessage
from tests.conftest import CHAT_TEMPLATE, build_tokenizer
from tests.gateway.live import LiveGateway, start_gateway, tiny_settings

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
JINJA = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)


def test_a_name_is_a_builtin_and_anything_with_jinja_tags_is_a_template() -> None:
    assert configured_template(None) is None
    assert configured_template("chatml") == BUILTIN_TEMPLATES["chatml"]
    assert configured_template(JINJA) == JINJA
    assert configured_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match=r"embedded\.chat_template.*'chatmel' is not a built-in"):
        configured_template("chatmel")


def test_the_configured_template_overrides_the_tokenizers_own() -> None:
    tok = build_tokenizer()
    assert chat_template_for(tok, None) == CHAT_TEMPLATE
    assert chat_template_for(tok, "phi3") == BUILTIN_TEMPLATES["phi3"]
    assert chat_text(tok, MESSAGES) == "s:be brief\nu:hello\na:"
    assert chat_text(tok, MESSAGES, template=JINJA) == "<system>be brief<user>hello<a>"
    assert chat_text(tok, MESSAGES, template="chatml").endswith("<|im_start|>assistant\n")
    expected = tok("<system>be brief<user>hello<a>", add_special_tokens=False)["input_ids"]
    assert render_chat(tok, MESSAGES, template=JINJA) == expected


def test_without_any_template_the_error_names_the_setting() -> None:
    tok = build_tokenizer()
    tok.chat_template = None
    assert chat_template_for(tok, None) is None
    with pytest.raises(ValueError) as err:
        chat_text(tok, MESSAGES)
    assert str(err.value) == NO_TEMPLATE
    assert "--chat-template" in NO_TEMPLATE and "embedded.chat_template" in NO_TEMPLATE
    assert chat_text(tok, MESSAGES, template="chatml").startswith("<|im_start|>system\nbe brief")


def test_whether_tools_go_to_the_template_follows_the_override() -> None:
    # The tokenizer's own renders tools; a configured one that does not gets them as a system message.
    tok = SimpleNamespace(chat_template="{{ tools }}{{ messages }}")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [ChatMessage(role="user", content="hi")]
    _, native = normalize_messages(tok, msgs, tools, "auto")
    assert native == tools
    out, passed = normalize_messages(tok, msgs, tools, "auto", template="chatml")
    assert passed is None and out[0]["role"] == "system" and "<tools>" in out[0]["content"]


def test_check_template_refuses_what_would_fail_every_request() -> None:
    check_template(None)
    check_template("llama3")
    check_template(JINJA)
    with pytest.raises(ValueError, match=r"embedded\.chat_template.*does not compile"):
        check_template("{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(ValueError, match="not a built-in template"):
        check_template("gemma-7")


# ---- through the gateway ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def untemplated_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its chat template taken out of its files (as many GGUF files come)."""
    out = tmp_path_factory.mktemp("tiny-no-template") / "tiny-no-template"
    shutil.copytree(tiny_llama_dir, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config = out / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data.pop("chat_template", None)
    config.write_text(json.dumps(data))
    assert AutoTokenizer.from_pretrained(out).chat_template is None
    return out


@pytest.fixture(scope="module")
def untemplated(untemplated_dir: Path) -> Iterator[LiveGateway]:
    live = start_gateway(tiny_settings(str(untemplated_dir)))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def chatml(untemplated_dir: Path) -> Iterator[LiveGateway]:
    live = start_gateway(tiny_settings(str(untemplated_dir), embedded={"chat_template": "chatml"}))
    yield live
    live.stop()


def _client(live: LiveGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_to_a_model_without_a_template_is_a_400_naming_the_setting(
    untemplated: LiveGateway, untemplated_dir: Path
) -> None:
    client = _client(untemplated)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=untemplated_dir.name, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "messages"
    assert body["message"] == NO_TEMPLATE
    # Completions need no template.
    done = client.completions.create(model=untemplated_dir.name, prompt="hello", max_tokens=2)
    assert done.usage is not None and done.usage.completion_tokens == 2


def test_with_a_configured_template_the_same_model_serves_chat(
    chatml: LiveGateway, untemplated_dir: Path
) -> None:
    r = _client(chatml).chat.completions.create(
        model=untemplated_dir.name,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=3,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "length"
    # The prompt is the conversation as chatml writes it, rendered in the process that served it.
    tok = AutoTokenizer.from_pretrained(untemplated_dir)
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(render_chat(tok, MESSAGES, template="chatml"))


def test_a_bad_template_stops_the_backend_from_being_built(untemplated_dir: Path) -> None:
    # Built as each worker builds it at start-up (Services.build), before any model loads.
    for template, error in (("nonesuch", r"embedded\.chat_template.*'nonesuch'"), ("{{ messages", "compile")):
        settings = tiny_settings(str(untemplated_dir), embedded={"chat_template": template})
        with pytest.raises(ValueError, match=error):
            EmbeddedBackend(settings.embedded)
    assert EmbeddedBackend(tiny_settings(str(untemplated_dir)).embedded).model is None
