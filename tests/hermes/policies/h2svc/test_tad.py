"""The profiler's attention and its TAD sums (`hermes.policies.h2svc.tad`) on their own, on small random tensors:
the blocked eager attention against a plain one (GQA, bottom-right causal, the default and a given scaling, fp32 and
bf16), the sums against a float64 loop over heads, rows and frames, and the block size. The meta device stands in
for CUDA: every tensor the code makes must follow its inputs there."""
import pytest
import torch

from hermes.policies.h2svc import tad
from hermes.policies.h2svc.tad import Queries, TADSums, profile_attention_forward


class Layer(torch.nn.Module):
    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx


def plain_attention(query, key, value, scaling):
    """Eager attention with repeat_kv's head order, the T queries being the last T of the N keys."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1).float(), value.repeat_interleave(group, dim=1).float()
    count, total = query.shape[2], key.shape[2]
    scores = query.float() @ key.transpose(-1, -2) * scaling
    visible = torch.arange(total) <= torch.arange(count)[:, None] + (total - count)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return (probs @ value).transpose(1, 2), probs[0]


def plain_tad(probs, queries: Queries):
    """float64 [H]: Σ_t Σ_j A[h, t, j]·w(t, j), A the probability mass of frame j, w = max(i_t − j, 0) for frame
    queries and n − 1 − j for text queries."""
    probs = probs.double()
    heads, rows, _ = probs.shape
    P, n, T_f = queries.visual_start, queries.num_frames, queries.tokens_per_frame
    out = torch.zeros(heads, dtype=torch.float64)
    for h in range(heads):
        for t in range(rows):
            for j in range(n):
                mass = probs[h, t, P + j * T_f:P + (j + 1) * T_f].sum()
                weight = max(int(queries.frames[t]) - j, 0) if queries.frames is not None else n - 1 - j
                out[h] += mass * weight
    return out


def inputs(dtype, heads=4, kv_heads=2, count=5, total=11, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, heads, count, dim, generator=generator).to(dtype)
    key = torch.randn(1, kv_heads, total, dim, generator=generator).to(dtype)
    value = torch.randn(1, kv_heads, total, dim, generator=generator).to(dtype)
    return query, key, value


def recording(sums: TADSums) -> list[torch.Tensor]:
    """The probability blocks `sums.add` is handed, in order (the sums are compared on exactly those)."""
    seen, add = [], sums.add

    def record(layer, probs, rows):
        seen.append(probs.clone())
        add(layer, probs, rows)

    sums.add = record
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, 0.3])
@pytest.mark.parametrize("block", [1, 2, None])
def test_blocked_attention_equals_plain_attention_and_its_tad(dtype, scaling, block):
    query, key, value = inputs(dtype)
    sums = TADSums(num_layers=2, query_block=block, decoder_layers=[1, 3])
    # frame queries: 5 rows of frames 0..2 over keys P=2 .. 2 + 3·3 = 11
    sums.queries = Queries(visual_start=2, num_frames=3, tokens_per_frame=3, frames=torch.tensor([0, 1, 1, 2, 2]))
    seen = recording(sums)
    out, weights = profile_attention_forward(Layer(3), query, key, value, None, scaling=scaling, h2svc_sums=sums)
    expected, probs = plain_attention(query, key, value, 8 ** -0.5 if scaling is None else scaling)
    assert weights is None and out.shape == (1, 5, 4, 8) and out.dtype == dtype
    tolerance = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), expected, **tolerance)
    handed = torch.cat(seen, dim=1)
    assert len(seen) == (1 if block is None else -(-5 // block)) and handed.dtype == torch.float32
    torch.testing.assert_close(handed, probs, atol=1e-6 if dtype == torch.float32 else 2e-2, rtol=0)
    assert sums.v2v[0] is None and sums.t2v == [None, None]
    got = sums.v2v[1]
    assert got.dtype == torch.float64  # float64 sums of the float32 probabilities
    torch.testing.assert_close(got, plain_tad(handed, sums.queries), atol=1e-13, rtol=1e-13)


def test_text_queries_sum_into_t2v_and_blocks_accumulate():
    query, key, value = inputs(torch.float32, count=3, total=9, seed=1)
    sums = TADSums(num_layers=1, query_block=2)
    sums.queries = Queries(visual_start=1, num_frames=2, tokens_per_frame=3, frames=None)
    seen = recording(sums)
    profile_attention_forward(Layer(0), query, key, value, None, h2svc_sums=sums)
    torch.testing.assert_close(sums.t2v[0], plain_tad(torch.cat(seen, dim=1), sums.queries), atol=1e-13, rtol=1e-13)
    first = sums.t2v[0].clone()
    profile_attention_forward(Layer(0), query, key, value, None, h2svc_sums=sums)
    torch.testing.assert_close(sums.t2v[0], 2 * first, atol=1e-12, rtol=1e-12)
    assert sums.v2v == [None]
    taken = sums.take("t2v")
    assert taken.shape == (1, 4) and sums.t2v == [None]
    with pytest.raises(RuntimeError, match="no t2v queries reached every layer"):
        sums.take("t2v")


def test_the_prefix_adds_nothing():
    sums = TADSums(num_layers=1)
    assert sums.queries is None and sums.query_block is None
    query, key, value = inputs(torch.float32)
    profile_attention_forward(Layer(0), query, key, value, None, h2svc_sums=sums)
    assert sums.v2v == [None] and sums.t2v == [None]


def test_layers_are_indexed_by_their_decoder_index():
    """A hybrid model's full-attention layers (decoder 1 and 3) are rows 0 and 1; without decoder_layers, decoder
    layer l is row l."""
    assert TADSums(2, decoder_layers=[1, 3]).index == {1: 0, 3: 1}
    assert TADSums(3).index == {0: 0, 1: 1, 2: 2}
    with pytest.raises(ValueError, match=r"^decoder_layers: expected 2 indices, got 3$"):
        TADSums(2, decoder_layers=[0, 1, 2])


def test_a_block_holds_as_many_rows_as_fit_its_bytes():
    assert TADSums(1, query_block=7).block_rows(4, 10**9) == 7
    heads, keys = 4, 1024
    assert TADSums(1).block_rows(heads, keys) == tad.BLOCK_BYTES // (4 * heads * keys) == 16384
    assert TADSums(1).block_rows(64, 10**8) == 1


def test_every_tensor_follows_the_inputs_device():
    """On the meta device (CUDA's stand-in here) a tensor made on the CPU would meet the inputs and fail."""
    query, key, value = (t.to("meta") for t in inputs(torch.float32))
    sums = TADSums(num_layers=1, query_block=2)
    sums.queries = Queries(visual_start=2, num_frames=3, tokens_per_frame=3, frames=torch.tensor([0, 1, 1, 2, 2]))
    out, _ = profile_attention_forward(Layer(0), query, key, value, None, h2svc_sums=sums)
    assert out.device.type == "meta" and sums.v2v[0].device.type == "meta"


def test_it_runs_only_inside_the_profiler_and_for_one_clip():
    query, key, value = inputs(torch.float32)
    with pytest.raises(RuntimeError, match="runs only inside profile_heads"):
        profile_attention_forward(Layer(0), query, key, value, None)
    with pytest.raises(RuntimeError, match="one clip at a time, got a batch of 2"):
        profile_attention_forward(Layer(0), query.expand(2, -1, -1, -1), key, value, None, h2svc_sums=TADSums(1))
