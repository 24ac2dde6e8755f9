"""Chat templates for GGUF files that ship none, by general.architecture, as llama.cpp also
falls back to its built-in ones. Gemma 3: the model card's template (text parts): a system
message is folded into the first user turn and the assistant's role is called `model`."""

from __future__ import annotations

from typing import Any

GEMMA3 = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

BY_ARCHITECTURE = {"gemma3": GEMMA3}


def gguf_chat_template(meta: dict[str, Any]) -> str | None:
    """The file's own template, else the built-in one for its architecture, else None."""
    return meta.get("tokenizer.chat_template") or BY_ARCHITECTURE.get(
        meta.get("general.architecture"))
