"""The `model` extra alone: the glue imports, and a tiny random LLaVA-OneVision streams two chunks past its budget
and answers a question (HermesStream, the torch backend, the C row kernel or its torch fallback)."""
import torch

from hermes import HermesStream
from scaffolding.models import tiny_llava_ov
from scaffolding.pixels import llava_pixels
from scaffolding.tokenizer import tiny_tokenizer

generator = torch.Generator().manual_seed(0)
stream = HermesStream(tiny_llava_ov(), tiny_tokenizer(), budget=8, chunk_frames=2, room=160)
for _ in range(2):
    stream.append_video(llava_pixels(1, 2, generator))
answer = stream.ask("what is the person holding ?", max_new_tokens=2)
stats = stream.stats()
assert stats["steps"] >= 1, stats
print(f"model extra: {stats['steps']} compression steps, answer {answer!r}")
