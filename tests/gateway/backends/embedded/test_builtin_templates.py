"""Each built-in chat template renders a system / user / assistant / user conversation in its
model's format, ending with the generation prompt, through the tokenizer's own renderer."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from specgate.gateway.backends.embedded.builtin_templates import BUILTIN_TEMPLATES
from specgate.gateway.backends.embedded.chat_template import chat_text
from tests.conftest import build_tokenizer

MESSAGES = [
    {"role": "system", "content": "SYS"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "U2"},
]

# name -> the exact text: every turn's markers, and the generation prompt at the end.
EXPECTED = {
    "chatml": "<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n"
    "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n",
    "llama2": "<s>[INST] <<SYS>>\nSYS\n<</SYS>>\n\nU1 [/INST] A1 </s><s>[INST] U2 [/INST]",
    "llama3": "<s><|start_header_id|>system<|end_header_id|>\n\nSYS<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nU1<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nA1<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nU2<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": "<s>[INST] SYS\n\nU1[/INST] A1</s>[INST] U2[/INST]",
    "mistral-v7": "<s>[SYSTEM_PROMPT] SYS[/SYSTEM_PROMPT][INST] U1[/INST] A1</s>[INST] U2[/INST]",
    "mistral-v7-tekken": "<s>[SYSTEM_PROMPT]SYS[/SYSTEM_PROMPT][INST]U1[/INST]A1</s>[INST]U2[/INST]",
    "gemma": "<s><start_of_turn>user\nSYS\n\nU1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n"
    "<start_of_turn>user\nU2<end_of_turn>\n<start_of_turn>model\n",
    "phi3": "<|system|>\nSYS<|end|>\n<|user|>\nU1<|end|>\n<|assistant|>\nA1<|end|>\n<|user|>\nU2<|end|>\n"
    "<|assistant|>\n",
    "phi4": "<|im_start|>system<|im_sep|>SYS<|im_end|><|im_start|>user<|im_sep|>U1<|im_end|>"
    "<|im_start|>assistant<|im_sep|>A1<|im_end|><|im_start|>user<|im_sep|>U2<|im_end|>"
    "<|im_start|>assistant<|im_sep|>",
    "zephyr": "<|system|>\nSYS</s>\n<|user|>\nU1</s>\n<|assistant|>\nA1</s>\n"
    "<|user|>\nU2</s>\n<|assistant|>\n",
    "vicuna": "SYS\n\nUSER: U1\nASSISTANT: A1</s>\nUSER: U2\nASSISTANT:",
    "deepseek": "<s>SYS\n### Instruction:\nU1\n### Response:\nA1\n<|EOT|>\n"
    "### Instruction:\nU2\n### Response:\n",
    "deepseek3": "<s>SYS<｜User｜>U1<｜Assistant｜>A1<｜end▁of▁sentence｜><｜User｜>U2<｜Assistant｜>",
}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = build_tokenizer()
    # BOS and EOS as a Llama-2-style vocabulary names them, so that the templates' use shows.
    tok.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>"})
    return tok


def test_every_builtin_is_tested() -> None:
    required = {"chatml", "llama2", "llama3", "mistral-v7", "mistral", "gemma", "phi3", "phi4"}
    required |= {"zephyr", "vicuna", "deepseek"}
    assert required <= set(BUILTIN_TEMPLATES) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_builtin_renders_each_turn_and_the_generation_prompt(
    tokenizer: PreTrainedTokenizerFast, name: str
) -> None:
    assert chat_text(tokenizer, MESSAGES, template=name) == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_builtin_without_bos_or_eos_tokens_writes_no_none(name: str) -> None:
    tok = build_tokenizer()  # no BOS token at all
    text = chat_text(tok, MESSAGES[1:], template=name)
    assert "None" not in text and "U1" in text and "U2" in text


def test_formats_without_a_system_role_fold_it_into_the_first_user_turn(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    gemma = chat_text(tokenizer, MESSAGES, template="gemma")
    assert "system" not in gemma and gemma.count("<start_of_turn>user\n") == 2
    assert "<start_of_turn>user\nSYS\n\nU1<end_of_turn>" in gemma
    # Without a system message the first turn is the user's own text.
    plain = chat_text(tokenizer, MESSAGES[1:], template="gemma")
    assert plain.startswith("<s><start_of_turn>user\nU1<end_of_turn>")


def test_a_tool_result_is_a_user_turn_where_the_format_has_no_role_for_it(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    messages = [*MESSAGES[1:3], {"role": "tool", "content": "T"}]
    assert chat_text(tokenizer, messages, template="gemma").endswith(
        "<start_of_turn>user\nT<end_of_turn>\n<start_of_turn>model\n"
    )
    assert chat_text(tokenizer, messages, template="chatml").endswith(
        "<|im_start|>tool\nT<|im_end|>\n<|im_start|>assistant\n"
    )


def test_no_builtin_claims_to_render_tools() -> None:
    # Tools then go into a system message the model can read (tools.py), which these formats need.
    from specgate.gateway.backends.embedded.tools import template_supports_tools

    assert not any(template_supports_tools(t) for t in BUILTIN_TEMPLATES.values())
