"""Llama 1-3.x (and SmolLM2): the layout the decoder runs, as it is."""

from shoal.model.families.chat_templates import CHATML
from shoal.model.families.family import Family

FAMILY = Family(
    name="llama",
    hf_model_types=("llama",),
    gguf_architectures=("llama",),
    gguf_rows_permuted=True,
    chat_template=CHATML,  # llama.cpp's default: the family's files come from many lineages
)
