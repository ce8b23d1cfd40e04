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
