"""Chat templates by name, for models whose files carry none (`embedded.chat_template`).

The names are llama.cpp's (`llama-server --chat-template NAME`). Each template is Jinja as a
tokenizer's own would be, rendered by the same `apply_chat_template`: it reads `messages`,
`add_generation_prompt`, `bos_token` and `eos_token`. Text is written as string expressions, never
as literal lines between tags, so that the renderer's whitespace trimming cannot change it.

Formats without a system role fold the system message into the first user turn, as those models'
own templates do; roles a format has no name for (a tool's result) are written as user turns.
"""

from __future__ import annotations

# The leading system message, if any, as `system`, and the messages after it as `turns`.
_SPLIT_SYSTEM = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- set turns = messages -%}{%- endif -%}"
)
# A tokenizer without a BOS token starts with nothing; one without an EOS token ends turns with
# the format's usual `</s>`.
_BOS = "{%- set bos = bos_token if bos_token else '' -%}"
_EOS = "{%- set eos = eos_token if eos_token else '</s>' -%}"

# <|im_start|>role\ncontent<|im_end|>\n (Qwen, SmolLM, Hermes, ...)
_CHATML = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# [INST] <<SYS>>\nsystem\n<</SYS>>\n\nuser [/INST] answer </s>, each exchange opened by BOS; the
# answer follows [/INST], so the generation prompt is the end of the last user turn.
_LLAMA2 = (
    _BOS + _EOS + _SPLIT_SYSTEM + "{%- for m in turns -%}"
    "{%- if m['role'] == 'assistant' -%}{{ ' ' + m['content'] + ' ' + eos }}"
    "{%- else -%}"
    "{{ bos + '[INST] ' }}"
    "{%- if loop.first and system -%}{{ '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' }}{%- endif -%}"
    "{{ m['content'] + ' [/INST]' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>, after BOS (Llama 3.x).
_LLAMA3 = (
    _BOS + "{{ bos }}"
    "{%- for m in messages -%}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ (m['content'] | trim) + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}"
)


def _mistral_v7(space: str) -> str:
    """[SYSTEM_PROMPT] / [INST] / answer + EOS (Mistral Small 3, Large 2411); `space` after each
    opening tag and before the answer (SentencePiece vocabularies), "" for Tekken ones."""
    return (
        _BOS + _EOS + "{{ bos }}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'system' -%}"
        f"{{{{ '[SYSTEM_PROMPT]{space}' + m['content'] + '[/SYSTEM_PROMPT]' }}}}"
        "{%- elif m['role'] == 'assistant' -%}"
        f"{{{{ '{space}' + m['content'] + eos }}}}"
        "{%- else -%}"
        f"{{{{ '[INST]{space}' + m['content'] + '[/INST]' }}}}"
        "{%- endif -%}"
        "{%- endfor -%}"
    )


# [INST] user[/INST] answer</s> (Mistral 7B Instruct, Mixtral): no system role, so the system
# message opens the first user turn.
_MISTRAL = (
    _BOS + _EOS + _SPLIT_SYSTEM + "{{ bos }}"
    "{%- for m in turns -%}"
    "{%- if m['role'] == 'assistant' -%}{{ ' ' + m['content'] + eos }}"
    "{%- else -%}"
    "{%- set text = system + '\\n\\n' + m['content'] if loop.first and system else m['content'] -%}"
    "{{ '[INST] ' + text + '[/INST]' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# <start_of_turn>user|model\ncontent<end_of_turn>\n after BOS (Gemma 1-3): no system role.
_GEMMA = (
    _BOS + _SPLIT_SYSTEM + "{{ bos }}"
    "{%- for m in turns -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else 'user' -%}"
    "{%- set text = system + '\\n\\n' + m['content'] if loop.first and system else m['content'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + text + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# <|role|>\ncontent<|end|>\n (Phi-3, Phi-3.5).
_PHI3 = (
    "{%- for m in messages -%}"
    "{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)

# <|im_start|>role<|im_sep|>content<|im_end|>, no newlines (Phi-4).
_PHI4 = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '<|im_sep|>' + m['content'] + '<|im_end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant<|im_sep|>' }}{%- endif -%}"
)

# <|role|>\ncontent + EOS + \n (Zephyr).
_ZEPHYR = (
    _EOS + "{%- for m in messages -%}"
    "{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)

# system\n\nUSER: ...\nASSISTANT: ...</s>\n (Vicuna 1.1 and its fine-tunes).
_VICUNA = (
    _EOS + "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ m['content'] + '\\n\\n' }}"
    "{%- elif m['role'] == 'assistant' -%}{{ 'ASSISTANT: ' + m['content'] + eos + '\\n' }}"
    "{%- else -%}{{ 'USER: ' + m['content'] + '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}"
)

# ### Instruction:\n...\n### Response:\n...\n<|EOT|>\n (DeepSeek Coder).
_DEEPSEEK = (
    _BOS + "{{ bos }}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ m['content'] + '\\n' }}"
    "{%- elif m['role'] == 'assistant' -%}{{ '### Response:\\n' + m['content'] + '\\n<|EOT|>\\n' }}"
    "{%- else -%}{{ '### Instruction:\\n' + m['content'] + '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '### Response:\\n' }}{%- endif -%}"
)

# system<｜User｜>...<｜Assistant｜>...<｜end▁of▁sentence｜> after BOS (DeepSeek V3, R1 and its distills).
_DEEPSEEK3 = (
    _BOS + "{{ bos }}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ m['content'] }}"
    "{%- elif m['role'] == 'assistant' -%}{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- else -%}{{ '<｜User｜>' + m['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<｜Assistant｜>' }}{%- endif -%}"
)

BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": _CHATML,
    "llama2": _LLAMA2,
    "llama3": _LLAMA3,
    "mistral": _MISTRAL,
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "gemma": _GEMMA,
    "phi3": _PHI3,
    "phi4": _PHI4,
    "zephyr": _ZEPHYR,
    "vicuna": _VICUNA,
    "deepseek": _DEEPSEEK,
    "deepseek3": _DEEPSEEK3,
}
