"""The HERMES ops that score (`hermes_scores`, `compress_step`, `compress_stacks`) and the released-code adapter
(`compat.accelerate`) with `group=`, on 2 ranks (gloo on CPU, tests/ranks.py): every rank holds half the KV heads
and its own pooled attention (the mean over its heads); the op averages the ranks' attention with one all-reduce
and must then do exactly what one process does with the whole: the same keep indices, scores and positions on
every rank, and each rank's keys equal to its heads' rows of the one-process cache. Bad input raises the same error
on every rank with nothing written and the ranks still in step (docs/multi-gpu.md#what-crosses).

One spawned run holds every check (process start dominates the cost).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import hermes_kernels as hk
from hermes_kernels import HermesConfig
from hermes_kernels.compat import accelerate, read_layers, write_layers
from hermes_kernels.policies.hermes.tensor_parallel import group_mean
from tests.hermes_kernels.compat.cases import Case, make_instance, random_chunks, record_keeps
from tests.ranks import run_ranks
from tests.utils import inv_freq_for, synthetic_positions

L, B, KV_HEADS, D, P, V, BUDGET = 6, 2, 4, 16, 3, 30, 12


def test_two_ranks_match_one_process():
    run_ranks(_two_ranks, 2, timeout_s=20)


def _two_ranks(rank: int, world: int) -> None:
    group = dist.group.WORLD
    _group_mean(rank, world, group)
    _ops(rank, world, group)
    _bad_input(rank, world, group)
    _adapter(rank, world, group)


def _shares(world: int, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every rank's pooled attention [L, B, V] (drawn alike on every rank) and their mean, the one-process value."""
    g = torch.Generator().manual_seed(seed)
    shares = [torch.rand(L, B, V, generator=g) / V for _ in range(world)]
    return shares, torch.stack(shares).sum(0) / world


def _group_mean(rank: int, world: int, group) -> None:
    shares, whole = _shares(world)
    strided = torch.zeros(L, B, V + 5)[..., :V]  # a view, as the cache's guidance buffer hands it out
    strided.copy_(shares[rank])
    mean = group_mean(strided, group)
    torch.testing.assert_close(mean, whole, msg="group_mean: not the mean of the ranks' shares")
    assert torch.equal(strided, shares[rank]), "group_mean wrote into its input"


def _cache(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(2, L, B, KV_HEADS, P + V, D, generator=g).unbind(0)
    return keys, values, synthetic_positions(L, B, P + V, P, g)


def _ops(rank: int, world: int, group) -> None:
    cfg = HermesConfig.llava_ov(L, BUDGET, P, reindex="eager")
    inv_freq = inv_freq_for(D)
    heads = slice(rank * KV_HEADS // world, (rank + 1) * KV_HEADS // world)
    shares, whole = _shares(world)
    keys, values, positions = _cache()

    torch.testing.assert_close(hk.hermes_scores(shares[rank], cfg, backend="torch", group=group),
                               hk.hermes_scores(whole, cfg, backend="torch"), msg="hermes_scores(group=)")

    one = [t.clone() for t in (keys, values, positions)]
    expected = hk.compress_step(*one, whole, cfg, inv_freq, backend="torch")
    for split in (None, 2):  # compress_step, then compress_stacks over two stacks
        mine = [keys[:, :, heads].clone(), values[:, :, heads].clone(), positions.clone()]
        if split is None:
            got = hk.compress_step(*mine, shares[rank], cfg, inv_freq, backend="torch", group=group)
        else:
            stacks = [(range(0, split), *(t[:split] for t in mine), inv_freq),
                      (range(split, L), *(t[split:] for t in mine), inv_freq)]
            got = hk.compress_stacks(stacks, shares[rank], cfg, backend="torch", group=group)
        what = "compress_step" if split is None else "compress_stacks"
        assert got.length == expected.length and bool(got.reindexed) == bool(expected.reindexed), what
        assert torch.equal(got.keep, expected.keep), f"{what}: keep differs from one process"
        torch.testing.assert_close(got.scores, expected.scores, msg=f"{what}: scores")
        n = got.length
        assert torch.equal(mine[2][..., :n], one[2][..., :n]), f"{what}: positions"
        torch.testing.assert_close(mine[0][..., :n, :], one[0][:, :, heads, :n], msg=f"{what}: this rank's keys")
        torch.testing.assert_close(mine[1][..., :n, :], one[1][:, :, heads, :n], msg=f"{what}: this rank's values")


def _raises_alike(call, error: type, match: str) -> str:
    try:
        call()
    except error as err:
        assert match in str(err), str(err)
        return str(err)
    raise AssertionError(f"no {error.__name__} ({match})")


def _bad_input(rank: int, world: int, group) -> None:
    cfg = HermesConfig.llava_ov(L, BUDGET, P, reindex="eager")
    inv_freq = inv_freq_for(D)
    shares, _ = _shares(world)
    keys, values, positions = _cache()
    mine = [keys[:, :, :KV_HEADS // world].clone(), values[:, :, :KV_HEADS // world].clone(), positions.clone()]
    before = [t.clone() for t in mine]
    messages = []
    # the same bad shape on every rank: refused before the all-reduce, alike everywhere
    messages.append(_raises_alike(lambda: hk.compress_step(*mine, shares[rank][..., :-1], cfg, inv_freq,
                                                            backend="torch", group=group), ValueError, "attn"))
    _raises_alike(lambda: hk.compress_step(*mine, shares[rank], cfg, inv_freq, group="world"), TypeError, "group")
    # a non-finite value on one rank only reaches every rank through the all-reduce: the same error everywhere
    poisoned = shares[rank].clone()
    if rank == world - 1:
        poisoned[4, 1, 7] = float("nan")
    messages.append(_raises_alike(lambda: hk.compress_step(*mine, poisoned, cfg, inv_freq, backend="torch",
                                                            group=group), ValueError, "non-finite values in layer"))
    for got, was in zip(mine, before):
        assert torch.equal(got, was), "a refused step wrote into the cache"
    every = [None] * world
    dist.all_gather_object(every, messages, group=group)  # also: the ranks are still in step (no pending collective)
    assert all(m == messages for m in every), f"ranks raised different errors: {every}"


def _rank_share(model, rank: int, world: int) -> None:
    """What tensor parallelism makes of a stand-in instance on rank `rank` (ours, for this test): each layer's
    q_proj / k_proj keep this rank's rows (its heads), the cache this rank's KV heads. The config's head counts
    stay the whole model's, as transformers leaves them."""
    config = model.language_model.config
    for layer in model._decoder_layers():
        attn = layer.self_attn
        for name, heads in (("q_proj", config.num_attention_heads), ("k_proj", config.num_key_value_heads)):
            whole = getattr(attn, name)
            width = heads // world * attn.head_dim
            part = nn.Linear(whole.in_features, width, bias=whole.bias is not None)
            part.weight.data.copy_(whole.weight[rank * width:(rank + 1) * width])
            if whole.bias is not None:
                part.bias.data.copy_(whole.bias[rank * width:(rank + 1) * width])
            setattr(attn, name, part)
    pairs, kind = read_layers(model.kv_cache)
    model.kv_cache = write_layers(model.kv_cache, kind, [_heads_of(pair, rank, world) for pair in pairs])


def _heads_of(pair, rank: int, world: int):
    k = pair[0].shape[1] // world
    return tuple(t[:, rank * k:(rank + 1) * k].clone() for t in pair)


def _adapter(rank: int, world: int, group) -> None:
    """compat.accelerate(group=) on a rank's share of a stand-in instance streams like the whole instance
    accelerated in one process: the same keep indices after every chunk, positions, and this rank's heads of the
    cache. Guidance from the prompt's input embeddings (the released sdpa path): it reads the projections only."""
    for kind in ("llava_ov", "qwen2_5_vl"):
        case = Case(kind=kind, chunks=4)
        whole, mine = make_instance(case), make_instance(case)
        _rank_share(mine, rank, world)
        accelerate(whole, backend="torch", guidance="embeddings")
        accelerate(mine, backend="torch", guidance="embeddings", group=group)
        whole_keeps, my_keeps = record_keeps(whole), record_keeps(mine)
        grid = (2, 3, 4) if kind == "qwen2_5_vl" else None
        for keys, values in random_chunks(case):
            whole.encode_chunk(keys, values, grid)
            mine.encode_chunk(*zip(*[_heads_of(pair, rank, world) for pair in zip(keys, values)]), grid)
            whole.predict_and_compress()
            mine.predict_and_compress()
            assert my_keeps == whole_keeps, f"{kind}: keep indices differ from one process"
            for layer, (ours, theirs) in enumerate(zip(read_layers(mine.kv_cache)[0], read_layers(whole.kv_cache)[0])):
                assert torch.equal(mine._position_ids_cache[layer], whole._position_ids_cache[layer]), kind
                for got, expected in zip(ours, _heads_of(theirs, rank, world)):
                    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4, msg=f"{kind} layer {layer}")
        assert whole_keeps, f"{kind}: no selection ran"
    _released_selection(rank, world, group)


def _released_selection(rank: int, world: int, group) -> None:
    """`prune_kv_cache_by_attention` with this rank's heads of every layer's attention maps [1, H/N, q, L + q]
    gives the keep indices of the whole maps in one process."""
    case = Case(chunks=1)
    whole, mine = make_instance(case), make_instance(case)
    _rank_share(mine, rank, world)
    handles = accelerate(whole, backend="torch"), accelerate(mine, backend="torch", group=group)
    g = torch.Generator().manual_seed(5)
    maps = [torch.rand(1, 4, 3, 43, generator=g).softmax(-1) for _ in range(whole.num_layers)]  # 35 visual keys
    heads = slice(rank * 4 // world, (rank + 1) * 4 // world)
    expected = handles[0].prune_kv_cache_by_attention(maps, maps, maps, 20)
    got = handles[1].prune_kv_cache_by_attention(*[[m[:, heads] for m in maps]] * 3, 20)
    assert [k.tolist() for k in got] == [k.tolist() for k in expected], "released selection: keep differs"


def test_non_finite_attention_on_one_rank_is_refused_by_every_rank():
    """`hermes_scores(..., group=)` (and `compress_stacks`, beside `compress_step` above) with a NaN in the last
    rank's pooled attention only: the NaN reaches every rank through the all-reduce, so every rank raises the same
    ValueError naming the layer, and then the ranks are still in step (they gather their messages, and score clean
    attention as one process does). A rank that checked its own share before the all-reduce would refuse alone and
    leave the others waiting in the collective: the group's timeout (20 s) turns that into a failure, not a hang."""
    run_ranks(_one_rank_non_finite, 2, timeout_s=20)


def _one_rank_non_finite(rank: int, world: int) -> None:
    group = dist.group.WORLD
    cfg = HermesConfig.llava_ov(L, BUDGET, P, reindex="eager")
    shares, whole = _shares(world)
    poisoned = shares[rank].clone()
    if rank == world - 1:
        poisoned[2, 1, 7] = float("nan")
    match = "attn: non-finite values in layer(s) [2]"
    messages = [_raises_alike(lambda: hk.hermes_scores(poisoned, cfg, backend="torch", group=group), ValueError,
                              match)]
    keys, values, positions = _cache()
    heads = slice(rank * KV_HEADS // world, (rank + 1) * KV_HEADS // world)
    mine = [keys[:, :, heads].clone(), values[:, :, heads].clone(), positions.clone()]
    before = [t.clone() for t in mine]
    inv_freq = inv_freq_for(D)
    stacks = [(range(0, 2), *(t[:2] for t in mine), inv_freq), (range(2, L), *(t[2:] for t in mine), inv_freq)]
    messages.append(_raises_alike(lambda: hk.compress_stacks(stacks, poisoned, cfg, backend="torch", group=group),
                                  ValueError, match))
    for got, was in zip(mine, before):
        assert torch.equal(got, was), "a refused step wrote into the cache"
    every = [None] * world
    dist.all_gather_object(every, messages, group=group)
    assert all(m == messages for m in every), f"ranks raised different errors: {every}"
    torch.testing.assert_close(hk.hermes_scores(shares[rank], cfg, backend="torch", group=group),
                               hk.hermes_scores(whole, cfg, backend="torch"), msg="hermes_scores after the refusal")
