"""Chat templates of three model families, written small from their published form, and tiny
random-weight llamas whose vocabularies hold each family's marker tokens."""

from __future__ import annotations

import json
from pathlib import Path

# Qwen3: tools in <tools>, calls in <tool_call>, results as <tool_response> in a user turn,
# reasoning in <think>; enable_thinking=false writes an empty think block.
QWEN3 = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content and (loop.last or preserve_thinking) %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content }}{% for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

# The thinking-only Qwen3 variants (and DeepSeek-R1) open the block in the generation prompt.
QWEN3_THINKING = QWEN3.replace(
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}", "<think>\n")

# Llama 3.1: JSON tool calling with "parameters", tool results in the ipython role.
LLAMA31 = """{{- bos_token }}
{%- if messages[0].role == 'system' %}{% set system_message = messages[0].content %}\
{% set messages = messages[1:] %}{% else %}{% set system_message = '' %}{% endif %}
<|start_header_id|>system<|end_header_id|>

Environment: ipython
Cutting Knowledge Date: December 2023

{{ system_message }}<|eot_id|>
{%- if tools %}<|start_header_id|>user<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its \
proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and \
its value}. Do not use variables.

{% for t in tools %}{{ t | tojson(indent=4) }}

{% endfor %}{{ messages[0].content }}<|eot_id|>{% set messages = messages[1:] %}{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}\
<|start_header_id|>assistant<|end_header_id|>

{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "parameters": \
{{ tc.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# Mistral v3: the tool list before the last user turn, calls after the special [TOOL_CALLS],
# results in [TOOL_RESULTS] with 9-character call ids.
MISTRAL = """{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]\
{% endif %}[INST] {{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS] [\
{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "arguments": \
{{ tc.function.arguments | tojson }}, "id": "{{ tc.id[-9:] }}"}\
{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}
{%- elif message.role == 'assistant' %} {{ message.content }}{{ eos_token }}
{%- elif message.role == 'tool' %}[TOOL_RESULTS] {"content": {{ message.content | tojson }}, \
"call_id": "{{ message.tool_call_id[-9:] }}"}[/TOOL_RESULTS]
{%- elif message.role == 'system' %}
{%- else %}{{ raise_exception('Only user, assistant and tool roles are supported') }}
{%- endif %}
{%- endfor %}"""

# family -> (template, special tokens, plain added tokens, eos, bos)
FAMILIES = {
    "qwen3": (QWEN3, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              ["<think>", "</think>", "<tool_call>", "</tool_call>"], "<|im_end|>", None),
    "qwen3-thinking": (QWEN3_THINKING, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                       ["<think>", "</think>", "<tool_call>", "</tool_call>"], "<|im_end|>",
                       None),
    "llama3.1": (LLAMA31, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                           "<|eot_id|>", "<|python_tag|>"], [], "<|eot_id|>",
                 "<|begin_of_text|>"),
    "mistral": (MISTRAL, ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]",
                          "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                          "[/TOOL_RESULTS]"], [], "</s>", "<s>"),
}


def write_family(directory: Path, family: str, seed: int = 0) -> None:
    """A 2-layer random llama with a byte-level vocabulary plus the family's tokens."""
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    template, specials, plain, eos, bos = FAMILIES[family]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.add_tokens([AddedToken(s, special=False) for s in plain])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "eos_token": eos, "bos_token": bos}))
    vocab = tok.get_vocab_size()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, eos_token_id=tok.token_to_id(eos),
                         bos_token_id=None, initializer_range=0.3)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": tok.token_to_id(eos)}))
