"""A stand-in of the released HERMES classes' compression step, in plain per-layer PyTorch (docs/integrations.md).

Written here from the released classes' documented behaviour (docs/hermes.md §5 and docs/integrations.md), not
copied from them: the attributes they keep on the model object and the contracts of the methods the adapter
replaces — the selection (`prune_kv_cache_by_attention`), the shrink (`_shrink_positions_and_rerotate_keys`) and
the guidance pass (`pseudo_forward`, both its manual path and its eager `output_attentions=True` path) — with the
released numerics where they matter (attention pooled in the attention's dtype, fp16 softmax on the Qwen manual
path, rotary deltas through cos/sin tables in the cache dtype). It is the oracle of the adapter's tests and the
released-style baseline of `python -m bench`; a user of the released code can compare `accelerate` with it too.

Modules: standin/released.py, the stand-in classes `ReleasedLLaVAOV` and `ReleasedQwenVL`;
standin/language_model.py, the tiny random decoder (`TinyLanguageModel`, `TinyCausalLM`) and the tokenizer
(`TinyTokenizer`) they hold, so that they run without transformers; standin/dynamic_cache.py, look-alikes of
transformers' `DynamicCache` 4.x and 5.x (`LegacyDynamicCache`, `LayeredDynamicCache`).
"""
from .dynamic_cache import LayeredDynamicCache, LegacyDynamicCache
from .language_model import (RMSNorm, Rotary, TinyAttention, TinyCausalLM, TinyDecoderLayer, TinyLanguageModel,
                             TinyTokenizer, rope_tables, rotate_half)
from .released import GLOBAL_PROMPT, LOCAL_PROMPT, ReleasedLLaVAOV, ReleasedQwenVL

__all__ = ["ReleasedLLaVAOV", "ReleasedQwenVL", "LOCAL_PROMPT", "GLOBAL_PROMPT", "TinyLanguageModel", "TinyCausalLM",
           "TinyDecoderLayer", "TinyAttention", "RMSNorm", "Rotary", "TinyTokenizer", "rope_tables", "rotate_half",
           "LegacyDynamicCache", "LayeredDynamicCache"]
