"""OLMo 2: RMSNorm after attention and after the MLP instead of before them, and of each whole query
and key projection before RoPE. Its GGUF files are not read yet."""

from shoal.model.families.family import Family

FAMILY = Family(name="olmo2", hf_model_types=("olmo2",), gguf_architectures=(), qk_norm="projection", norms_after=True)
