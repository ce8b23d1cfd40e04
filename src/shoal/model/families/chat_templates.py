"""Chat templates a family uses when its file has none (as llama.cpp's built-in list does)."""

# ChatML, the format of Qwen and SmolLM and llama.cpp's default for a file without a template.
CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Gemma's turns: the assistant is "model", and a system message opens the first user turn (Gemma
# has no system role), as Gemma's own template and llama.cpp's built-in one do.
GEMMA = (
    "{{- bos_token -}}"
    "{%- set system = messages[0]['content'] ~ '\\n\\n' if messages and messages[0]['role'] == 'system' else '' -%}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\\n' + (system if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

# Phi-3, Phi-3.5 and Phi-4-mini: <|role|> turns closed by <|end|> (llama.cpp's "phi3").
PHI3 = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

# Granite 3: role headers between <|start_of_role|> and <|end_of_role|>, turns closed by
# <|end_of_text|> (llama.cpp's "granite").
GRANITE = (
    "{%- for message in messages -%}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_of_role|>assistant<|end_of_role|>' -}}{%- endif -%}"
)

# OLMo 2 Instruct (Tulu 3's format): <|system|>, <|user|> and <|assistant|> headers on their own
# lines, each assistant turn closed by the end-of-text token.
OLMO2 = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|assistant|>\\n' + message['content'] + eos_token + ('' if loop.last else '\\n') -}}"
    "{%- else -%}{{- '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

# Mistral and Mixtral Instruct (v1): [INST] user turns [/INST], assistant turns closed by the
# end-of-sequence token; a system message opens the first user turn (there is no system role).
MISTRAL = (
    "{{- bos_token -}}"
    "{%- set system = messages[0]['content'] ~ '\\n\\n' if messages and messages[0]['role'] == 'system' else '' -%}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' -}}"
    "{%- else -%}{{- message['content'] + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)

# gpt-oss's harmony format, as its own template and openai-harmony render it: a system message
# (identity, dates, `Reasoning: {reasoning_effort}`, medium by default, and the valid channels), a
# developer message with the first system or developer message's instructions and the tools as a
# TypeScript namespace, then each message between <|start|>{role} and <|end|>. An assistant message
# with tool calls keeps its reasoning_content (an analysis message), its content (a commentary
# preamble) and one commentary message a call to `functions.NAME`, ended by <|call|>; another
# assistant message is its final channel only (a finished turn's reasoning is dropped). A tool result
# comes from `functions.NAME` (the call its tool_call_id names) on the commentary channel.
HARMONY = r"""
{%- macro ts_type(schema) -%}
{%- set kind = schema.get('type') -%}
{%- if schema.get('enum') -%}{{- schema['enum'] | map('tojson') | join(' | ') -}}
{%- elif kind == 'string' -%}string
{%- elif kind in ('number', 'integer') -%}number
{%- elif kind == 'boolean' -%}boolean
{%- elif kind == 'array' -%}{{- ts_type(schema.get('items') or {}) + '[]' -}}
{%- elif kind == 'object' and schema.get('properties') -%}
{{- '{' -}}
{%- for name, field in schema['properties'].items() -%}
{{- ' ' + name + ('' if name in schema.get('required', []) else '?') + ': ' + ts_type(field) -}}
{{- ',' if not loop.last else ' ' -}}
{%- endfor -%}
{{- '}' -}}
{%- else -%}any
{%- endif -%}
{%- endmacro -%}
{%- macro functions_namespace(tools) -%}
{{- "## functions\n\nnamespace functions {\n\n" -}}
{%- for tool in tools -%}
{%- set function = tool.get('function', tool) -%}
{%- set parameters = function.get('parameters') or {} -%}
{%- if function.get('description') -%}{{- "// " + function['description'] + "\n" -}}{%- endif -%}
{%- if parameters.get('properties') -%}
{{- "type " + function['name'] + " = (_: {\n" -}}
{%- for name, field in parameters['properties'].items() -%}
{%- if field.get('description') -%}{{- "// " + field['description'] + "\n" -}}{%- endif -%}
{{- name + ('' if name in parameters.get('required', []) else '?') + ": " + ts_type(field) + ",\n" -}}
{%- endfor -%}
{{- "}) => any;\n\n" -}}
{%- else -%}
{{- "type " + function['name'] + " = () => any;\n\n" -}}
{%- endif -%}
{%- endfor -%}
{{- "} // namespace functions" -}}
{%- endmacro -%}
{{- "<|start|>system<|message|>" -}}
{{- model_identity if model_identity is defined else "You are ChatGPT, a large language model trained by OpenAI." -}}
{{- "\nKnowledge cutoff: 2024-06\nCurrent date: " + strftime_now("%Y-%m-%d") + "\n\n" -}}
{{- "Reasoning: " + (reasoning_effort if reasoning_effort is defined and reasoning_effort else "medium") + "\n\n" -}}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." -}}
{%- if tools -%}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}{%- endif -%}
{{- "<|end|>" -}}
{%- set instructed = messages and messages[0]['role'] in ('system', 'developer') -%}
{%- if instructed or tools -%}
{{- "<|start|>developer<|message|>" -}}
{%- if instructed -%}{{- "# Instructions\n\n" + messages[0]['content'] + "\n\n" -}}{%- endif -%}
{%- if tools -%}{{- "# Tools\n\n" + functions_namespace(tools) -}}{%- endif -%}
{{- "<|end|>" -}}
{%- endif -%}
{%- for message in (messages[1:] if instructed else messages) -%}
{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
{%- if message.get('reasoning_content') -%}
{{- "<|start|>assistant<|channel|>analysis<|message|>" + message['reasoning_content'] + "<|end|>" -}}
{%- endif -%}
{%- if message['content'] -%}
{{- "<|start|>assistant<|channel|>commentary<|message|>" + message['content'] + "<|end|>" -}}
{%- endif -%}
{%- for call in message['tool_calls'] -%}
{%- set function = call.get('function', call) -%}
{%- set arguments = function['arguments'] -%}
{{- "<|start|>assistant<|channel|>commentary to=functions." + function['name'] + " <|constrain|>json<|message|>" -}}
{{- (arguments if arguments is string else arguments | tojson(separators=(',', ':'))) + "<|call|>" -}}
{%- endfor -%}
{%- elif message['role'] == 'assistant' -%}
{{- "<|start|>assistant<|channel|>final<|message|>" + message['content'] + "<|end|>" -}}
{%- elif message['role'] == 'tool' -%}
{%- set called = namespace(name=message.get('name')) -%}
{%- for earlier in messages -%}
{%- for call in earlier.get('tool_calls') or [] if call.get('id') == message.get('tool_call_id') -%}
{%- set called.name = call.get('function', call)['name'] -%}
{%- endfor -%}
{%- endfor -%}
{%- if not called.name -%}
{{- raise_exception("tool message " + message.get('tool_call_id', '') + " answers no earlier tool call") -}}
{%- endif -%}
{{- "<|start|>functions." + called.name + " to=assistant<|channel|>commentary<|message|>" -}}
{{- message['content'] + "<|end|>" -}}
{%- else -%}
{%- set role = 'developer' if message['role'] == 'system' else message['role'] -%}
{{- "<|start|>" + role + "<|message|>" + message['content'] + "<|end|>" -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|start|>assistant" -}}{%- endif -%}
"""
