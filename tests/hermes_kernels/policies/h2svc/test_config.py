"""H2SVCConfig: presets, class counts, the default head map, derived rows, head-map normalisation and field
validation (docs/h2svc.md §1–2, docs/h2svc.md §7)."""
import pytest
import torch

from hermes_kernels import H2SVCConfig
from hermes_kernels.policies.h2svc.config import (CLASS_NAMES, EPISODIC, INSTANT, SHORT, class_counts, class_id,
                                                  default_head_map)


def test_llava_ov_preset():
    cfg = H2SVCConfig.llava_ov(28, 4, 14)
    assert (cfg.tokens_per_frame, cfg.max_positions, cfg.margin, cfg.reindex) == (196, 32768, 1024, "lazy")
    assert cfg.windows == (4, 16, 64) and (cfg.instant_ratio, cfg.short_ratio) == (0.1, 0.4)
    assert [cfg.window(c) for c in (INSTANT, SHORT, EPISODIC)] == [4, 16, 64]
    assert [cfg.window(name) for name in CLASS_NAMES] == [4, 16, 64]
    # H = 112: n_i = floor(11.2 + 0.5) = 11, n_s = floor(56 + 0.5) - 11 = 45, episodic 56
    assert [cfg.num_rows(c) for c in (INSTANT, SHORT, EPISODIC)] == [11, 45, 56]
    assert not cfg.profiled and cfg.head_classes.dtype == torch.int64 and cfg.head_classes.shape == (28, 4)
    # depth order: layers 0-1 and three heads of layer 2 instant; layer 2 head 3 .. layer 13 short; rest episodic
    assert cfg.head_map[2] == (INSTANT, INSTANT, INSTANT, SHORT)
    assert cfg.head_map[13] == (SHORT,) * 4 and cfg.head_map[14] == (EPISODIC,) * 4


def test_qwen2_5_vl_preset():
    cfg = H2SVCConfig.qwen2_5_vl(28, 4, 20, episodic_frames=32, reindex="eager")
    assert (cfg.tokens_per_frame, cfg.max_positions, cfg.prefix_len) == (196, 128000, 20)
    assert cfg.windows == (4, 16, 32) and cfg.reindex == "eager"
    assert H2SVCConfig.qwen2_5_vl(2, 2, 0, tokens_per_frame=64).tokens_per_frame == 64


def test_qwen3_vl_preset():
    cfg = H2SVCConfig.preset("qwen3_vl", 36, 8, 20)
    assert (cfg.tokens_per_frame, cfg.max_positions, cfg.windows) == (196, 262144, (4, 16, 64))
    assert cfg == H2SVCConfig.qwen2_5_vl(36, 8, 20, max_positions=262144)


def test_qwen3_5_preset():
    """Qwen3.5: the head map is over the full-attention layers only (8 x 4 KV heads in the default config)."""
    cfg = H2SVCConfig.preset("qwen3_5", 8, 4, 20)
    assert (cfg.tokens_per_frame, cfg.max_positions, cfg.windows) == (196, 32768, (4, 16, 64))
    assert cfg == H2SVCConfig.qwen2_5_vl(8, 4, 20, max_positions=32768)
    assert cfg.head_classes.shape == (8, 4) and "qwen3_5" in H2SVCConfig.PRESETS


@pytest.mark.parametrize("H, ratios, expected", [
    (1, (0.1, 0.4), (0, 1, 0)),      # floor(0.6) = 0, floor(1.0) - 0 = 1
    (5, (0.1, 0.4), (1, 2, 2)),      # floor(1.0) = 1, floor(3.0) - 1 = 2
    (7, (0.1, 0.4), (1, 3, 3)),      # floor(1.2) = 1, floor(4.0) - 1 = 3
    (15, (0.1, 0.4), (2, 6, 7)),     # floor(2.0) = 2, floor(8.0) - 2 = 6
    (25, (0.1, 0.4), (3, 10, 12)),   # floor(3.0), floor(13.0) - 3
    (35, (0.1, 0.4), (4, 14, 17)),   # floor(4.0), floor(18.0) - 4
    (112, (0.1, 0.4), (11, 45, 56)),
    (6, (0.25, 0.25), (2, 1, 3)),    # floor(2.0) = 2, floor(3.5) - 2 = 1
    (9, (0.0, 1.0), (0, 9, 0)),
    (4, (1.0, 0.0), (4, 0, 0)),
    (3, (0.3, 0.7), (1, 2, 0)),      # floor(1.4) = 1, floor(3.5) - 1 = 2
    # exact decimals: in binary 0.35·90 + 0.5 and 0.7·45 + 0.5 are 31.999999999999996
    (90, (0.35, 0.0), (32, 0, 58)),   # floor(31.5 + 0.5) = 32
    (45, (0.1, 0.6), (5, 27, 13)),    # floor(4.5 + 0.5) = 5, floor(31.5 + 0.5) - 5 = 27
])
def test_class_counts(H, ratios, expected):
    assert class_counts(H, *ratios) == expected


def test_default_head_map_is_depth_order():
    # H = 9: n_i = floor(1.4) = 1, n_s = floor(5.0) - 1 = 4, episodic 4, filled in (layer, head) order
    assert default_head_map(3, 3).tolist() == [[0, 1, 1], [1, 1, 2], [2, 2, 2]]
    assert default_head_map(2, 5, 0.2, 0.2).tolist() == [[0, 0, 1, 1, 2], [2, 2, 2, 2, 2]]


@pytest.mark.parametrize("L, Hkv", [(1, 1), (3, 5), (7, 2), (4, 8)])
def test_derived_rows_are_consistent(L, Hkv):
    g = torch.Generator().manual_seed(L * 100 + Hkv)
    head_map = torch.randint(0, 3, (L, Hkv), generator=g)
    cfg = H2SVCConfig(num_layers=L, num_kv_heads=Hkv, prefix_len=3, tokens_per_frame=5, head_map=head_map)
    assert cfg.profiled and torch.equal(cfg.head_classes, head_map)
    seen = []
    for c in (INSTANT, SHORT, EPISODIC):
        rows = cfg.class_rows(c)
        assert cfg.num_rows(c) == len(rows) == int((head_map == c).sum())
        assert rows == sorted(rows) and all(int(head_map[layer, head]) == c for layer, head in rows)
        for layer in range(L):
            heads = [head for head in range(Hkv) if int(head_map[layer, head]) == c]
            assert cfg.heads_of(c, layer) == heads
            block = cfg.layer_rows(c, layer)
            assert block.step == 1 and [rows[r] for r in block] == [(layer, head) for head in heads]
        seen += rows
    assert sorted(seen) == [(layer, head) for layer in range(L) for head in range(Hkv)]


def test_head_map_normalisation():
    as_list = [[2, 0], [1, 2], [0, 0]]
    for given in (as_list, torch.tensor(as_list, dtype=torch.int32), tuple(tuple(r) for r in as_list)):
        cfg = H2SVCConfig(num_layers=3, num_kv_heads=2, prefix_len=0, tokens_per_frame=4, head_map=given)
        assert cfg.head_map == ((2, 0), (1, 2), (0, 0)) and cfg.profiled
        assert isinstance(hash(cfg), int)
    a = H2SVCConfig(num_layers=3, num_kv_heads=2, prefix_len=0, tokens_per_frame=4, head_map=as_list)
    b = H2SVCConfig(num_layers=3, num_kv_heads=2, prefix_len=0, tokens_per_frame=4, head_map=torch.tensor(as_list))
    assert a == b and hash(a) == hash(b)
    assert a != a.replace(head_map=[[2, 0], [1, 2], [0, 1]])


@pytest.mark.parametrize("head_map, why", [
    ([[0, 1], [2, 0]], "rows"),                          # 2 layers for L = 3
    ([[0, 1], [2, 0], [1]], "rows"),                     # ragged
    ([[0, 1], [2, 3], [1, 1]], "INSTANT=0"),            # class 3
    ([[0, 1], [2, -1], [1, 1]], "INSTANT=0"),
    ([[0, 1], [2, True], [1, 1]], "INSTANT=0"),         # bool is not a class
    ([[0, 1], [2, 1.0], [1, 1]], "INSTANT=0"),          # float is not a class
    (torch.zeros(3, 2), "integer tensor"),               # float tensor
    (torch.zeros(2, 3, dtype=torch.int64), "shape"),     # transposed
    ("instant", "nested sequence"),
    (7, "nested sequence"),
])
def test_head_map_refused(head_map, why):
    with pytest.raises(ValueError, match=rf"H2SVCConfig\.head_map: .*{why}"):
        H2SVCConfig(num_layers=3, num_kv_heads=2, prefix_len=0, tokens_per_frame=4, head_map=head_map)


@pytest.mark.parametrize("changes, field", [
    (dict(num_layers=0), "num_layers"),
    (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(num_layers=2.0), "num_layers"),
    (dict(prefix_len=-1), "prefix_len"),
    (dict(tokens_per_frame=0), "tokens_per_frame"),
    (dict(instant_frames=0), "instant_frames"),
    (dict(short_frames=0), "short_frames"),
    (dict(episodic_frames=1), "episodic_frames"),
    (dict(episodic_frames=True), "episodic_frames"),
    (dict(instant_ratio=-0.1), "instant_ratio"),
    (dict(short_ratio=1.5), "short_ratio"),
    (dict(instant_ratio=0.6, short_ratio=0.5), "short_ratio"),
    (dict(reindex="sometimes"), "reindex"),
    (dict(margin=-1), "margin"),
    (dict(margin=32768), "margin"),
    (dict(max_positions=14 + 64 * 196), "max_positions"),
])
def test_invalid_values_name_the_field(changes, field):
    args = dict(num_layers=28, num_kv_heads=4, prefix_len=14) | changes
    with pytest.raises(ValueError, match=rf"H2SVCConfig\.{field}"):
        H2SVCConfig.llava_ov(**args)


def test_max_positions_bound_is_exact():
    # bound: prefix_len + max(W_s, W_w, N_e)·tokens_per_frame + 1 <= max_positions
    ok = H2SVCConfig(num_layers=1, num_kv_heads=1, prefix_len=5, tokens_per_frame=3, short_frames=20,
                     episodic_frames=8, max_positions=5 + 20 * 3 + 1, margin=0)
    assert ok.max_positions == 66
    with pytest.raises(ValueError, match=r"H2SVCConfig\.max_positions"):
        ok.replace(max_positions=65)


def test_needs_reindex():
    lazy = H2SVCConfig(num_layers=1, num_kv_heads=1, prefix_len=0, tokens_per_frame=2, max_positions=1000,
                       margin=100)
    assert not lazy.needs_reindex(900) and lazy.needs_reindex(901)
    assert lazy.replace(reindex="eager").needs_reindex(0)


def test_replace_keeps_or_rebuilds_the_map():
    default = H2SVCConfig(num_layers=2, num_kv_heads=5, prefix_len=0, tokens_per_frame=2)
    grown = default.replace(num_layers=3)
    assert not grown.profiled and grown.head_classes.shape == (3, 5)
    assert torch.equal(grown.head_classes, default_head_map(3, 5))
    assert default.replace(short_ratio=0.0).num_rows(SHORT) == 0
    profiled = default.replace(head_map=[[2] * 5, [0] * 5])
    assert profiled.profiled and profiled.replace(margin=10).head_map == ((2,) * 5, (0,) * 5)
    with pytest.raises(ValueError, match=r"H2SVCConfig\.head_map"):
        profiled.replace(num_layers=3)


def test_class_id_and_row_queries_refuse_bad_arguments():
    cfg = H2SVCConfig(num_layers=2, num_kv_heads=2, prefix_len=0, tokens_per_frame=2)
    assert class_id("short") == SHORT and class_id(EPISODIC) == EPISODIC
    with pytest.raises(ValueError, match="cls"):
        class_id(3)
    with pytest.raises(ValueError, match="cls"):
        cfg.window("long")
    with pytest.raises(TypeError, match="cls"):
        cfg.num_rows(1.0)
    with pytest.raises(ValueError, match="layer"):
        cfg.layer_rows(SHORT, 2)
    with pytest.raises(ValueError, match="num_heads"):
        class_counts(0)
