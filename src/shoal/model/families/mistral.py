"""Mistral: Llama's layout with a sliding window on every layer where config.json sets one."""

from shoal.model.families.chat_templates import MISTRAL
from shoal.model.families.family import Family
from shoal.model.families.windows import every_layer

FAMILY = Family(
    name="mistral",
    hf_model_types=("mistral",),
    gguf_architectures=("mistral",),
    gguf_rows_permuted=True,
    windows=every_layer,
    chat_template=MISTRAL,
)
