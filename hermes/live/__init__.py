"""Live video: sources of timestamped frames (`open_source`) and the session that streams them into a
`HermesStream` as they play, answering questions meanwhile (`LiveSession`): docs/live.md."""
from __future__ import annotations

import importlib

from hermes.live.frames import LiveFrame, LiveSource, SourceEnded

# loaded on first use, not with `import hermes.live`: the session imports torch and transformers, the sources their
# decoders, and the command line checks a --live source (hermes.live.sources) before either may load
_LAZY = {"open_source": "hermes.live.sources", **dict.fromkeys(
    ("Answer", "ChunkDone", "Ended", "Event", "FramesDropped", "LiveSession"), "hermes.live.session")}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = ["Answer", "ChunkDone", "Ended", "Event", "FramesDropped", "LiveFrame", "LiveSession", "LiveSource",
           "SourceEnded", "open_source"]
