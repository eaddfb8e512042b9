"""HERMES: hierarchical KV-cache compression for streaming video LLMs (the method and the model glue).

Two policies share this engine: HERMES (`hermes.config`, `hermes.reference`) and H2SVC (`hermes.h2svc`).

`hermes.config`, `hermes.rope` and `hermes.reference` need only torch; the model glue (`hermes.cache`,
`hermes.attention`, `hermes.stream`) imports transformers when it is imported itself.
"""
from .config import HermesConfig
from .h2svc import H2SVCConfig
from .reference import CompressResult

__all__ = ["HermesConfig", "H2SVCConfig", "CompressResult"]
