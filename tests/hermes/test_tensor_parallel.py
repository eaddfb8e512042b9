"""`HermesStream` on a model loaded with `DistributedConfig(tp_size=N)`, on N ranks (gloo on CPU, tests/ranks.py),
against a one-process stream of the same tiny checkpoint in every rank: after every chunk the same step (keep
indices, H2SVC's host counters), every layer's positions identical and this rank's heads of keys and values equal
to the one-process cache's rows of those heads (float32 summation order apart); then the same averaged guidance
scores, next-token logits within float32 tolerance and the same greedy answers. HERMES lazy (a re-index inside the
run) and eager, H2SVC with head maps whose columns give the ranks different class sets; LLaVA-OV (1D RoPE),
Qwen2.5-VL (M-RoPE), Qwen3-VL (our plan, DeepStack) and Qwen3.5 (hybrid: every rank runs the whole linear-attention
layers and holds their states, compared too) on 2 ranks, LLaVA-OV with 4 KV heads on 4, loaded as the command loads
them. Failures on 2 ranks: the same bad chunk on every rank, a non-finite value in one rank's pooled attention or in
one rank's H2SVC heads, sampling, Qwen3-VL without its plan (refused), and last a fault inside one rank's layer
(docs/multi-gpu.md#failures).

The tiny models' KV heads must be a multiple of the rank count (docs/testing.md#scaffolding). One spawned run per
rank count holds every check: process start and imports dominate the cost.
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

import hermes_kernels as hk
from hermes.commands import load_model
from hermes.models.gemma4 import Gemma4
from hermes.models.qwen3_vl import Qwen3_VL
from hermes.stream import HermesStream
from scaffolding.models import tiny_gemma4, tiny_llava_ov, tiny_qwen2_5_vl, tiny_qwen3_5, tiny_qwen3_vl
from scaffolding.tokenizer import tiny_tokenizer
from tests.hermes.streams import CASES, GEMMA4, QUESTION, QWEN3_5, QWEN3_VL
from tests.ranks import run_ranks

CHUNKS = 5
# both policies' settings: HERMES keeps 40 visual tokens (every chunk after the first compresses); H2SVC's windows of
# 1, 2 and 3 frames evict from the second chunk on
HERMES = dict(budget=40, room=160)
H2SVC = dict(policy="h2svc", instant_frames=1, short_frames=2, episodic_frames=3, room=160)
# per rank of 2: rank 0's columns hold instant and short heads only, rank 1's episodic ones only
SPLIT_MAP = [[0, 2], [0, 2], [1, 2], [1, 2]]
# 4 ranks, one KV head each: rank 0 instant and short, rank 1 episodic only, ranks 2 and 3 a mix
MAP_4 = [[0, 2, 1, 2], [1, 2, 0, 1], [0, 2, 2, 2], [1, 2, 2, 0]]
TOL = dict(atol=1e-4, rtol=1e-4)  # float32 after the row-parallel all-reduces' summation order


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """name -> folder of a tiny model saved with save_pretrained (weights and config; the tokenizer is built)."""
    builders = {"llava_ov": tiny_llava_ov, "qwen2_5_vl": tiny_qwen2_5_vl, "qwen3_vl": tiny_qwen3_vl,
                "qwen3_5": tiny_qwen3_5, "gemma4": tiny_gemma4,
                "llava_ov_kv4": lambda: tiny_llava_ov(num_heads=8, num_kv_heads=4)}
    folders = {}
    for name, build in builders.items():
        folders[name] = str(tmp_path_factory.mktemp(name))
        build().save_pretrained(folders[name])
    return folders


def test_two_ranks_stream_as_one_process(checkpoints):
    run_ranks(_two_ranks, 2, checkpoints)


def test_four_ranks_stream_as_one_process(checkpoints):
    run_ranks(_four_ranks, 4, checkpoints)


def test_caches_refuse_what_tensor_parallelism_cannot_use():
    """In one process: a group that is not a process group, and an H2SVC class set that leaves out a class with
    heads in the rank's map, are refused naming the argument."""
    from hermes_kernels import H2SVCConfig, HermesConfig
    from hermes.policies.h2svc.cache import H2SVCCache
    from hermes.policies.hermes.cache import HermesCache

    common = dict(batch_size=1, head_dim=16, dtype=torch.float32, inv_freq=torch.ones(8))
    with pytest.raises(TypeError, match="group: expected a torch.distributed ProcessGroup"):
        HermesCache(HermesConfig.llava_ov(4, 8, 2), num_kv_heads=1, capacity=40, group="world", **common)
    cfg = H2SVCConfig.llava_ov(4, 1, 2, head_map=[[0], [1], [2], [2]], tokens_per_frame=4)
    h2svc = dict(cfg=cfg, num_heads=2, chunk_frames=2, room=8, **common)
    with pytest.raises(TypeError, match="group: expected"):
        H2SVCCache(group=object(), **h2svc)
    with pytest.raises(ValueError, match=r"classes: expected classes of \(0, 1, 2\) including those with heads"):
        H2SVCCache(classes=(1, 2), **h2svc)
    assert H2SVCCache(classes=(2, 0, 1), **h2svc).classes == (0, 1, 2)


def test_whole_heads_remedy_names_the_family_plan():
    """The refusal of attention left whole on every rank says how to load the model: with the family's plan where it
    has one (Qwen3-VL; the 2-rank run checks the refusal itself), else in one process or with device_map."""
    from hermes.models import family_of_type
    from hermes.parallel import whole_heads_remedy

    assert "load it with DistributedConfig(tp_size=4, tp_plan=Qwen3_VL.tp_plan) (hermes.models.qwen3_vl)" in \
        whole_heads_remedy(family_of_type("qwen3_vl"), 4)
    other = whole_heads_remedy(family_of_type("qwen2_5_vl"), 4)
    assert "tp_plan" not in other and other.endswith("run it in one process or split its layers over GPUs with "
                                                     "device_map")


# ---- what every rank runs --------------------------------------------------------------------------------------

def _load(folder: str, tp: int | None):
    """The model as the command loads it (`load_model`: under tp, `DistributedConfig` with the family's `tp_plan`);
    the checkpoint holds no processor, so a tokenizer stands in (the streams take theirs from the case)."""
    return load_model(folder, device="cpu" if tp is None else None, dtype="float32", processor=tiny_tokenizer(),
                      tp=tp).model


def _sharded_by_plan(model, plan: dict) -> None:
    """Every weight a rule of `plan` names is a DTensor split as the rule says (colwise: rows, Shard(0); rowwise:
    columns, Shard(1)) in every layer; the replicated norms are plain tensors."""
    placements = {"colwise": (Shard(0),), "rowwise": (Shard(1),), "replicated_with_grad_allreduce": None}
    layers = model.config.get_text_config().num_hidden_layers
    modules = dict(model.named_modules())
    for rule, style in plan.items():
        for layer in range(layers):
            weight = modules[rule.replace("*", str(layer))].weight
            if placements[style] is None:
                assert not isinstance(weight, DTensor), f"{rule} layer {layer}: {type(weight).__name__}"
            else:
                assert isinstance(weight, DTensor) and tuple(weight.placements) == placements[style], \
                    f"{rule} layer {layer}: {getattr(weight, 'placements', type(weight).__name__)}"


def _two_ranks(rank: int, world: int, checkpoints: dict) -> None:
    for family in ("llava_ov", "qwen2_5_vl"):
        models = _load(checkpoints[family], None), _load(checkpoints[family], world)
        case = CASES[family]
        max_positions = models[0].config.get_text_config().max_position_embeddings
        lazy = dict(HERMES, margin=max_positions - 60)  # positions pass 60 in the run: a lazy re-index fires
        head_map = SPLIT_MAP if family == "llava_ov" else None  # None: the default map of the whole model
        for kwargs in (lazy, dict(HERMES, reindex="eager"), dict(H2SVC, head_map=head_map, reindex="eager")):
            _compare(rank, world, models, case, kwargs)
    for case in (QWEN3_VL, QWEN3_5, GEMMA4):
        models = _load(checkpoints[case.name], None), _load(checkpoints[case.name], world)
        if case is QWEN3_VL:
            _sharded_by_plan(models[1], Qwen3_VL.tp_plan)
        if case is GEMMA4:  # our rules: the embedding and LM head whole, the heads split as transformers plans
            _sharded_by_plan(models[1], {**Gemma4.tp_plan, "model.language_model.layers.*.self_attn.q_proj": "colwise",
                                         "model.language_model.layers.*.self_attn.o_proj": "rowwise"})
        lazy = dict(HERMES, margin=models[0].config.get_text_config().max_position_embeddings - 60)
        for kwargs in (lazy, dict(H2SVC, reindex="eager")):
            _compare(rank, world, models, case, kwargs)
    models = _load(checkpoints["llava_ov"], None), _load(checkpoints["llava_ov"], world)
    _failures(rank, world, models, CASES["llava_ov"])
    _qwen3_vl_refused(world, checkpoints["qwen3_vl"])
    _layer_fault(rank, world, models, CASES["llava_ov"])  # last: it leaves the process group unusable


def _four_ranks(rank: int, world: int, checkpoints: dict) -> None:
    models = _load(checkpoints["llava_ov_kv4"], None), _load(checkpoints["llava_ov_kv4"], world)
    lazy = dict(HERMES, margin=models[0].config.get_text_config().max_position_embeddings - 60)
    for kwargs in (lazy, dict(H2SVC, head_map=MAP_4, reindex="eager")):  # 3 chunks: a re-index, STCE evicting
        _compare(rank, world, models, CASES["llava_ov"], kwargs, chunks=3)


def _streams(models, case, kwargs) -> tuple[HermesStream, HermesStream]:
    """(one process, this rank) streams of one configuration, free slots poisoned alike."""
    streams = tuple(HermesStream(model, case.tokenizer(), chunk_frames=case.frames, **case.stream_kwargs, **kwargs)
                    for model in models)
    for stream in streams:
        for buffer in stream.cache.buffers():
            if buffer.is_floating_point():
                buffer.fill_(float("nan"))
        stream.reset()
    return streams


def _chunk(case, g):
    return case.chunk(1, g)


def _compare(rank: int, world: int, models, case, kwargs, chunks: int = CHUNKS):
    one, mine = _streams(models, case, kwargs)
    assert mine.cache.num_kv_heads * world == one.cache.num_kv_heads, "the rank's cache holds its heads only"
    g = torch.Generator().manual_seed(0)
    for index in range(chunks):
        chunk = _chunk(case, g)
        expected, got = one.append_video(**chunk), mine.append_video(**chunk)
        _same_step(expected, got, f"{case.name} {kwargs} chunk {index}")
        _same_cache(one, mine, rank, world, f"{case.name} {kwargs} chunk {index}")
    what = f"{case.name} {kwargs}"
    assert one.stats()["reindexes"] > 0, f"{what}: no re-index in the run"
    if kwargs.get("policy", "hermes") == "hermes":
        torch.testing.assert_close(mine.guidance_scores(), one.guidance_scores(), msg=f"{what}: guidance scores")
    torch.testing.assert_close(mine.next_token_logits(QUESTION), one.next_token_logits(QUESTION), **TOL,
                               msg=f"{what}: next-token logits")
    assert mine.ask(QUESTION, max_new_tokens=4) == one.ask(QUESTION, max_new_tokens=4), f"{what}: answers"
    return one, mine


def _same_step(expected, got, what: str) -> None:
    assert (expected is None) == (got is None), f"{what}: a step ran in one process only"
    if expected is None:
        return
    if isinstance(expected, hk.CompressResult):
        assert got.length == expected.length and bool(got.reindexed) == bool(expected.reindexed), what
        assert torch.equal(got.keep, expected.keep), f"{what}: keep indices differ"
    else:
        assert (got.first_frame, got.num_frames, got.held, bool(got.reindexed), got.next_position) == \
            (expected.first_frame, expected.num_frames, expected.held, bool(expected.reindexed),
             expected.next_position), f"{what}: step {got} vs {expected}"


def _same_cache(one: HermesStream, mine: HermesStream, rank: int, world: int, what: str) -> None:
    """This rank's cache holds the one-process cache's rows of its heads: positions (and H2SVC's slot frames)
    identical, keys and values within float32 tolerance; the host counters identical."""
    assert mine.cache.counters == one.cache.counters, f"{what}: counters {mine.cache.counters} vs {one.cache.counters}"
    linear = mine.cache.linear_contents()  # a hybrid model: every rank holds the whole linear-attention states
    assert list(linear) == list(one.cache.linear_contents())
    for name, view in one.cache.linear_contents().items():
        torch.testing.assert_close(linear[name], view, **TOL, msg=f"{what}: {name}")
    share = one.cache.num_kv_heads // world
    heads = slice(rank * share, (rank + 1) * share)
    if one.cache.windows is not None:  # sliding windows: this rank's share of the sliding layers' KV heads
        sliding = one.cache.windows.layout.num_kv_heads // world
        rows, held = slice(rank * sliding, (rank + 1) * sliding), mine.cache.contents()
        for name, view in one.cache.contents().items():
            if name.startswith("sliding") and name.endswith("positions"):
                assert torch.equal(held[name], view), f"{what}: {name}"
            elif name.startswith("sliding"):
                torch.testing.assert_close(held[name], view[:, rows], **TOL, msg=f"{what}: {name}")
    if hasattr(one.cache, "layer_positions"):  # HERMES: every layer holds one sequence
        for layer in range(one.cfg.num_layers):
            assert torch.equal(mine.cache.layer_positions(layer), one.cache.layer_positions(layer)), \
                f"{what}: layer {layer} positions"
            torch.testing.assert_close(mine.cache.layer_keys(layer), one.cache.layer_keys(layer)[:, heads], **TOL,
                                       msg=f"{what}: layer {layer} keys")
            torch.testing.assert_close(mine.cache.layer_values(layer), one.cache.layer_values(layer)[:, heads],
                                       **TOL, msg=f"{what}: layer {layer} values")
        return
    for layer in range(one.cfg.num_layers):  # H2SVC: match every local head to its global one, class by class
        for cls in one.cache.classes:
            local = mine.cfg.heads_of(cls, layer)
            if not local:
                continue
            rows = [one.cfg.heads_of(cls, layer).index(heads.start + h) for h in local]
            for view in ("positions", "slot_frames", "keys", "values"):
                got = getattr(mine.cache, f"class_{view}")(cls, layer)
                expected = getattr(one.cache, f"class_{view}")(cls, layer)[:, rows]
                if view in ("positions", "slot_frames"):
                    assert torch.equal(got, expected), f"{what}: layer {layer} class {cls} {view}"
                else:
                    torch.testing.assert_close(got, expected, **TOL, msg=f"{what}: layer {layer} class {cls} {view}")


# ---- failures --------------------------------------------------------------------------------------------------

def _snapshot(stream: HermesStream) -> dict:
    return {"counters": stream.cache.counters, **{k: v.clone() for k, v in stream.cache.contents().items()}}


def _unchanged(stream: HermesStream, before: dict, what: str) -> None:
    after = _snapshot(stream)
    assert after["counters"] == before["counters"], f"{what}: counters moved"
    for name, view in before.items():
        if name != "counters":
            assert torch.equal(after[name], view), f"{what}: {name} changed"


def _refused(call, match: str, what: str) -> None:
    try:
        call()
    except ValueError as error:
        assert match in str(error), f"{what}: {error}"
        return
    raise AssertionError(f"{what}: not refused")


def _failures(rank: int, world: int, models, case) -> None:
    """Refusals raise the same error on every rank with every stream as it was, and the ranks stay in step: the
    next chunk streams as one process does."""
    for kwargs in (HERMES, dict(H2SVC, head_map=SPLIT_MAP)):
        one, mine = _streams(models, case, kwargs)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            chunk = _chunk(case, g)
            one.append_video(**chunk), mine.append_video(**chunk)
        faulty = rank == world - 1
        # what: (chunk, arm the fault on this rank -> disarm, the error's words here)
        faults = {"the same bad chunk on every rank": ({"video": torch.zeros(1, case.frames, 3, 8, 8)}, None,
                                                       "video: expected pixel values")}
        if kwargs is HERMES:  # a NaN in the last rank's pooled attention reaches every rank through the all-reduce
            faults["a non-finite pooled attention on one rank"] = (
                _chunk(case, g), _nan_pooled_attention if faulty else None, "attn: non-finite values in layer")
        else:  # a NaN in the last rank's (episodic) heads: its check refuses, the others learn it from the flag
            faults["non-finite values in one rank's heads"] = (
                _chunk(case, g), _nan_values if faulty else None,
                "values: non-finite values" if faulty else f"rank(s) [{world - 1}] refused")
        for what, (bad, arm, match) in faults.items():
            before = _snapshot(mine)
            disarm = arm(mine) if arm else None
            _refused(lambda: mine.append_video(**bad), match, what)
            if disarm:
                disarm()
            _unchanged(mine, before, what)
            chunk = _chunk(case, g)
            _same_step(one.append_video(**chunk), mine.append_video(**chunk), f"after {what}")
            _same_cache(one, mine, rank, world, f"after {what}")
    _refused(lambda: mine.ask(QUESTION, max_new_tokens=2, do_sample=True), "do_sample", "sampling")
    assert mine.ask(QUESTION, max_new_tokens=2) == one.ask(QUESTION, max_new_tokens=2), "answers after refusals"


def _nan_pooled_attention(stream: HermesStream):
    """The next guidance pass's first pooled attention comes out NaN on this rank. Returns the disarm."""
    original = hk.pooled_attention

    def pooled(*args, **kwargs):
        hk.pooled_attention = original
        return original(*args, **kwargs).fill_(float("nan"))

    hk.pooled_attention = pooled
    return lambda: setattr(hk, "pooled_attention", original)


def _nan_values(stream: HermesStream):
    """The next forward writes NaN values into this rank's heads of layer 3. Returns the disarm."""
    cache = stream.cache

    def write(forward, layer, key_states, value_states):
        if layer == 3:
            value_states = torch.full_like(value_states, float("nan"))
        return type(cache).write(cache, forward, layer, key_states, value_states)

    cache.write = write
    return lambda: vars(cache).pop("write")


def _qwen3_vl_refused(world: int, folder: str) -> None:
    """Qwen3-VL loaded under tensor parallelism without the family's plan (transformers' own: every head on every
    rank) is refused, the message naming the plan to load it with."""
    from transformers import AutoModelForImageTextToText, DistributedConfig

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32,
                                                        distributed_config=DistributedConfig(tp_size=world)).eval()
    _refused(lambda: HermesStream(model, tiny_tokenizer(digits=True), **HERMES),
             f"Qwen3-VL under tensor parallelism (tp_size={world}) holds every attention head on every rank: "
             f"transformers' plan for it does not split the heads; load it with DistributedConfig(tp_size={world}, "
             f"tp_plan=Qwen3_VL.tp_plan) (hermes.models.qwen3_vl)", "Qwen3-VL without its plan")


def _layer_fault(rank: int, world: int, models, case) -> None:
    """A fault inside the last rank's layer 2: it raises there; the others wait in that layer's all-reduce until
    its process leaves the group (or the group's timeout passes) and raise the group's error. Every rank's stream
    is as before the chunk, and every later call is refused (the ranks may be out of step)."""
    one, mine = _streams(models, case, HERMES)
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        chunk = _chunk(case, g)
        one.append_video(**chunk), mine.append_video(**chunk)
    before = _snapshot(mine)
    faulty = rank == world - 1
    if faulty:
        attend = mine.cache.attend

        def fault(module, layer, *args, **kwargs):
            if layer == 2:
                raise RuntimeError("injected fault in layer 2")
            return attend(module, layer, *args, **kwargs)

        mine.cache.attend = fault
    try:
        mine.append_video(**_chunk(case, g))
    except RuntimeError as error:
        assert ("injected" in str(error)) == faulty, f"rank {rank}: {error}"
    else:
        raise AssertionError(f"rank {rank}: the chunk did not fail")
    _unchanged(mine, before, "layer fault")
    for call in (lambda: mine.append_video(**_chunk(case, g)), lambda: mine.ask(QUESTION), mine.reset):
        try:
            call()
        except RuntimeError as error:
            assert "out of step" in str(error) or "different collectives" in str(error), str(error)
        else:
            raise AssertionError(f"rank {rank}: a call after the fault was not refused")


# ---- several KV heads per rank ---------------------------------------------------------------------------------

# 4 KV heads on 2 ranks: columns 1-2 give other classes than 2-3 in every layer, so a rank 1 that took heads [1, 3)
# instead of [2, 4) classifies its heads wrongly
MAP_2X2 = [[0, 1, 2, 0], [2, 0, 1, 1], [1, 2, 0, 2], [0, 0, 2, 1]]


def test_a_rank_s_kv_heads_start_at_its_index_times_its_share():
    """`HeadShard.kv_heads`: rank i of N holds KV heads [i·Hkv/N, (i+1)·Hkv/N), so the ranks' shares tile the heads
    in order; and `rank_config` gives H2SVC rank i the head map's columns of exactly those heads. With one KV head a
    rank (every other test) a share starting at `index` instead of `index · share` looks the same; here ranks hold 2
    and 3 KV heads."""
    from hermes_kernels import H2SVCConfig
    from hermes.parallel import HeadShard
    from hermes.policies.h2svc.policy import rank_config

    for count, kv_heads in ((2, 4), (2, 6), (4, 8)):
        share = kv_heads // count
        shards = [HeadShard(group=None, index=i, count=count, num_heads=2 * kv_heads, num_kv_heads=kv_heads)
                  for i in range(count)]
        assert [shard.kv_heads for shard in shards] == [range(i * share, (i + 1) * share) for i in range(count)]
        assert [h for shard in shards for h in shard.kv_heads] == list(range(kv_heads)), f"{count} x {share}"
    cfg = H2SVCConfig.llava_ov(4, 4, 2, head_map=MAP_2X2, tokens_per_frame=4)
    for index in range(2):
        shard = HeadShard(group=None, index=index, count=2, num_heads=8, num_kv_heads=4)
        mine = rank_config(cfg, shard)
        assert mine.num_kv_heads == 2
        assert torch.equal(mine.head_classes, torch.tensor(MAP_2X2)[:, 2 * index:2 * index + 2]), \
            f"rank {index}: head map columns {mine.head_classes.tolist()}"


def test_two_ranks_with_two_kv_heads_each_stream_as_one_process(checkpoints):
    """LLaVA-OV with 4 KV heads on 2 ranks (two KV heads a rank, the only run where a rank's share does not start at
    its index): H2SVC, whose rank configs take the head map's columns of the rank's heads (`HeadShard.kv_heads`),
    streams as one process does, heads compared class by class against the one-process cache's rows of the rank's
    own heads."""
    run_ranks(_two_kv_heads_a_rank, 2, checkpoints)


def _two_kv_heads_a_rank(rank: int, world: int, checkpoints: dict) -> None:
    models = _load(checkpoints["llava_ov_kv4"], None), _load(checkpoints["llava_ov_kv4"], world)
    one, mine = _compare(rank, world, models, CASES["llava_ov"], dict(H2SVC, head_map=MAP_2X2, reindex="eager"),
                         chunks=3)
    assert mine.setup.shard.kv_heads == range(2 * rank, 2 * rank + 2), mine.setup.shard
    assert torch.equal(mine.cfg.head_classes, one.cfg.head_classes[:, 2 * rank:2 * rank + 2]), "rank's map columns"


# ---- refusing_ranks over a group that is not the world ---------------------------------------------------------

# (members of a group made on 4 ranks): a pair that leaves out ranks 0 and 2, and a triple whose last member's
# world rank (3) is past the group's size
SUBGROUPS = ((1, 3), (0, 2, 3))


def test_refusing_ranks_of_a_subgroup_are_its_own_ranks():
    """`refusing_ranks` flags each rank at its place in the group (`dist.get_rank(group)`), not at its world rank:
    on 4 ranks, in groups (1, 3) and (0, 2, 3), every member learns the same list, the group ranks of the members
    that refused (none, each alone, the last two together). Every other run uses the world group, where both ranks
    are the same."""
    run_ranks(_subgroup_refusals, 4, timeout_s=30)


def _subgroup_refusals(rank: int, world: int) -> None:
    import datetime

    import torch.distributed as dist

    from hermes.parallel import refusing_ranks

    # every rank takes part in making every group, in the same order
    groups = {members: dist.new_group(list(members), timeout=datetime.timedelta(seconds=30))
              for members in SUBGROUPS}
    for members, group in groups.items():
        if rank not in members:
            continue
        what = f"rank {rank} in group {members}"
        assert refusing_ranks(group, False) == [], what
        for refuser in members:
            assert refusing_ranks(group, rank == refuser) == [members.index(refuser)], f"{what}, {refuser} refused"
        assert refusing_ranks(group, rank in members[-2:]) == [len(members) - 2, len(members) - 1], what
    dist.barrier()  # the ranks outside a group wait for its members
