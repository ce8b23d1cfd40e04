"""OLMo 2: RMSNorm after attention and after the MLP instead of before them, and of each whole query
and key projection before RoPE; from Hugging Face files or GGUF (rows not permuted)."""

from shoal.model.families.chat_templates import OLMO2
from shoal.model.families.family import Family

FAMILY = Family(
    name="olmo2",
    hf_model_types=("olmo2",),
    gguf_architectures=("olmo2",),
    qk_norm="projection",
    norms_before=False,
    norms_after=True,
    gguf_layer_names={
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    chat_template=OLMO2,
)
