"""HERMES: hierarchical KV-cache compression for streaming video LLMs (the method and the model glue).

`hermes.config`, `hermes.rope` and `hermes.reference` need only torch; the model glue (`hermes.cache`,
`hermes.attention`, `hermes.stream`) imports transformers when it is imported itself.
"""
from .config import HermesConfig
from .reference import CompressResult

__all__ = ["HermesConfig", "CompressResult"]
