"""Granite 3: Llama's layout with multipliers on the embeddings, on each attention and MLP output
before the residual add, on the attention scores, and a divisor of the logits (LlamaConfig's
embedding_multiplier, residual_multiplier, attention_multiplier, logits_scaling)."""

from shoal.model.families.chat_templates import GRANITE
from shoal.model.families.family import Family

FAMILY = Family(
    name="granite",
    hf_model_types=("granite",),
    gguf_architectures=("granite",),
    gguf_rows_permuted=True,
    chat_template=GRANITE,
)
