"""The soak (`python -m bench.soak`) in small: 300 chunks per family, one stream (ragged question batches have
their own tests) with a question every 50 chunks, memory flat and positions bounded; and the soak does fail
when a chunk leaves something behind."""
import pytest
import torch

import hermes.stream
from bench.soak import FAMILIES, SoakFailure, main, soak

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("family", FAMILIES)
def test_300_chunks_flat_memory_and_bounded_positions(family):
    lines = []
    reports = soak(family, chunks=300, every=100, question_every=50, batch=1, progress=False, out=lines.append)
    assert [r.chunk for r in reports] == [100, 200, 300] and len(lines) == 3
    assert len({r.tensor_bytes for r in reports}) == 1 and reports[-1].steps >= 290
    assert reports[-1].reindexes >= 2 and all(r.positions[1] < 512 for r in reports)


def test_soak_fails_loudly_on_a_leak(monkeypatch, capsys):
    """A stream that keeps one small tensor per chunk is caught at the next report, and the command exits 1."""
    kept, append = [], hermes.stream.HermesStream.append_video

    def leaky(self, *args, **kwargs):
        kept.append(torch.zeros(16))
        return append(self, *args, **kwargs)

    monkeypatch.setattr(hermes.stream.HermesStream, "append_video", leaky)
    with pytest.raises(SoakFailure, match="live tensor bytes"):
        soak("llava_ov", chunks=30, every=10, question_every=10, progress=False, out=lambda line: None)
    assert main(["--chunks", "20", "--every", "10", "--family", "qwen2_5_vl", "--no-progress"]) == 1
    assert "SOAK FAILED" in capsys.readouterr().err
