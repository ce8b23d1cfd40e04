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

# gpt-oss's harmony format, its plain turns: each message between <|start|>{role}<|message|> and
# <|end|>, the assistant's on its final channel.
HARMONY = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' -}}"
    "{%- else -%}{{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)
