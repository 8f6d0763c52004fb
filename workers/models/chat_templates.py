"""Chat templates of the model families hyflow's agents speak, written for the tiny model's vocabulary.

Real checkpoints bring their own template (``tokenizer_config.json``) and hyflow uses it as it is; these let the
tiny CPU model behave like each family, so the agent layer is tested against what the families' templates do
(``ensure_tiny_model(..., chat_template=name)``, the recipes' ``model.tiny_chat_template``). Each marks a turn with
``<|im_start|>role`` ... ``<|im_end|>`` (the tiny model's special tokens and EOS); what differs is how tools,
tool calls and tool results are rendered, and whether earlier turns are rewritten:

* ``chatml``: Qwen2-style ChatML, no tools (the tiny model's default);
* ``qwen3``: tools as JSON in the system turn inside ``<tools>``, calls as ``<tool_call>{json}</tool_call>``
  (parser ``hermes``), results as ``<tool_response>`` blocks in a user turn; an assistant turn before the last
  user message loses its ``<think>...</think>`` block, as Qwen3's template does -- the history is rewritten when
  a user message follows reasoning;
* ``deepseek_r1``: like ``qwen3``, but the generation prompt opens the reasoning (``<think>\\n``, which the model
  closes) and every assistant turn but the last loses it, as DeepSeek-R1's template does -- the history is
  rewritten at every turn;
* ``llama3``: Llama 3.1-style JSON tool calling: ``Environment: ipython`` in the system turn, the tools as JSON in
  the first user turn, a call is the turn's JSON ``{"name": ..., "parameters": ...}`` (parser ``llama3_json``),
  results in ``ipython`` turns.
"""

from __future__ import annotations

__all__ = ["CHAT_TEMPLATES", "chat_template"]

CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# {drop_before}: the index below which an assistant turn loses its reasoning
_HERMES_TOOLS = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within ' }}
{{- '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}' }}
{{- '\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- set drop_before = DROP_BEFORE %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{%- set content = m.content or '' %}
{%- if loop.index0 < drop_before and '</think>' in content %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>assistant\\n' + content }}
{%- for call in (m.tool_calls or []) %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{{- (fn.arguments if fn.arguments is string else fn.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\nGENERATION_OPENS' }}{%- endif %}
"""

QWEN3 = _HERMES_TOOLS.replace("DROP_BEFORE", "ns.last_user").replace("GENERATION_OPENS", "").strip()
DEEPSEEK_R1 = (
    _HERMES_TOOLS.replace("DROP_BEFORE", "messages | length - 1")
    .replace("GENERATION_OPENS", "<think>\\n")
    .strip()
)

LLAMA3 = """
{%- if messages[0].role == 'system' %}
{%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}
{%- set system = '' %}{%- set rest = messages %}
{%- endif %}
{{- '<|im_start|>system\\n' }}
{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- system + '<|im_end|>\\n' }}
{%- set ns = namespace(first_user=true) %}
{%- for m in rest %}
{%- if m.role == 'user' %}
{{- '<|im_start|>user\\n' }}
{%- if tools and ns.first_user %}
{{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments that '}}
{{- 'best answers the given prompt.\\n\\nRespond in the format {"name": function name, "parameters": dictionary of ' }}
{{- 'argument name and its value}. Do not use variables.\\n\\n' }}
{%- for tool in tools %}{{- (tool | tojson(indent=4)) + '\\n\\n' }}{%- endfor %}
{%- set ns.first_user = false %}
{%- endif %}
{{- m.content + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (m.content or '') }}
{%- for call in (m.tool_calls or []) %}
{%- set fn = call.function if call.function is defined else call %}
{{- '{"name": "' + fn.name + '", "parameters": ' }}
{{- (fn.arguments if fn.arguments is string else fn.arguments | tojson) + '}' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' or m.role == 'ipython' %}
{{- '<|im_start|>ipython\\n' + (m.content if m.content is string else m.content | tojson) + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
""".strip()

CHAT_TEMPLATES = {"chatml": CHATML, "qwen3": QWEN3, "deepseek_r1": DEEPSEEK_R1, "llama3": LLAMA3}


def chat_template(name: str) -> str:
    """The template ``name`` (one of ``CHAT_TEMPLATES``)."""
    if name not in CHAT_TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}; choose one of {sorted(CHAT_TEMPLATES)}")
    return CHAT_TEMPLATES[name]
