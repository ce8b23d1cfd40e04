"""Chat templates a family uses when its file has none (as llama.cpp's built-in list does)."""

# ChatML, the format of Qwen and SmolLM and llama.cpp's default for a file without a template.
CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
