"""A stand-in of the released HERMES classes' compression step in plain per-layer PyTorch: the oracle of the adapter's
tests and the released-style baseline of `python -m bench` (docs/integrations.md#checked).

Written here from the released classes' documented behaviour (docs/hermes.md §5), not copied, and importing neither
transformers nor this project's packages. Modules: scaffolding/standin/released.py (`ReleasedLLaVAOV`,
`ReleasedQwenVL`), scaffolding/standin/language_model.py (the tiny decoder and `TinyTokenizer`),
scaffolding/standin/dynamic_cache.py (transformers 4.x / 5.x `DynamicCache` look-alikes).
"""
from .dynamic_cache import LayeredDynamicCache, LegacyDynamicCache, layer_pairs, with_layers
from .language_model import (RMSNorm, Rotary, TinyAttention, TinyCausalLM, TinyDecoderLayer, TinyLanguageModel,
                             TinyTokenizer, rope_tables, rotate_half)
from .released import GLOBAL_PROMPT, LOCAL_PROMPT, ReleasedLLaVAOV, ReleasedQwenVL

__all__ = ["ReleasedLLaVAOV", "ReleasedQwenVL", "LOCAL_PROMPT", "GLOBAL_PROMPT", "TinyLanguageModel", "TinyCausalLM",
           "TinyDecoderLayer", "TinyAttention", "RMSNorm", "Rotary", "TinyTokenizer", "rope_tables", "rotate_half",
           "LegacyDynamicCache", "LayeredDynamicCache", "layer_pairs", "with_layers"]
