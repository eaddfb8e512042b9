"""HermesConfig: layer roles, per-layer vectors, presets, and field validation (docs/hermes.md §2.1–2.2)."""
import pytest
import torch

from hermes_kernels import HermesConfig


def test_llava_ov_7b_roles_and_vectors():
    cfg = HermesConfig.llava_ov(28, 6000, 14)
    roles = cfg.roles()
    assert roles[:2] == ["shallow"] * 2 and roles[2:19] == ["mid"] * 17 and roles[19:] == ["deep"] * 9
    assert torch.all(cfg.omega[:2] == 1) and torch.all(cfg.omega[19:] == 0)
    # mid: ω = 1 - 0.9 p, k = 20 - 19.5 p with p = (l - 2) / 17 (LLaVA-OV code constants)
    for layer in (2, 10, 18):
        p = (layer - 2) / 17
        assert cfg.omega[layer].item() == pytest.approx(1.0 - 0.9 * p, abs=1e-6)
        assert cfg.forget[layer].item() == pytest.approx(20 - 19.5 * p, abs=1e-5)
    assert torch.all(cfg.forget[:2] == 20) and torch.all(cfg.forget[19:] == 0)
    assert cfg.lam.tolist() == pytest.approx([0.1] * 2 + [0.3] * 17 + [0.4] * 9)
    assert cfg.layer_budget_list == [6000] * 19 + [5999] * 9
    assert cfg.cascade and cfg.summary and cfg.reindex == "lazy" and cfg.margin == 1024


def test_qwen_and_paper_presets():
    qwen = HermesConfig.qwen2_5_vl(28, 4000, 14)
    assert (qwen.omega0, qwen.gamma, qwen.k0, qwen.k_end, qwen.max_positions) == (0.75, 0.6, 20.0, 8.0, 128000)
    assert qwen.omega[2].item() == pytest.approx(0.75)
    paper = HermesConfig.paper(28, 4000, 14)
    assert not paper.cascade and paper.reindex == "eager" and paper.omega0 == 0.75
    no_summary = HermesConfig.llava_ov(28, 6000, 14, summary=False)
    assert no_summary.layer_budget_list == [6000] * 28


def test_qwen3_vl_preset_is_qwen2_5_vl_at_qwen3_vl_8b():
    """Qwen3-VL-8B: 36 layers, 262144 positions; the paper gives no constants of its own (docs/hermes.md §5 item 12),
    so everything else is the Qwen2.5-VL preset's, and the layer split follows from the depth fractions."""
    qwen3 = HermesConfig.preset("qwen3_vl", 36, 4000, 14)
    assert qwen3.max_positions == 262144
    assert qwen3 == HermesConfig.qwen2_5_vl(36, 4000, 14, max_positions=262144)
    assert qwen3.roles() == ["shallow"] * 3 + ["mid"] * 22 + ["deep"] * 11


def test_qwen3_5_preset_counts_full_attention_layers():
    """Qwen3.5: num_layers is the full-attention layers (8 of the default config's 32); Qwen2.5-VL's constants at
    32768 positions, the split by fraction of those 8 layers: no shallow layer, 0-4 mid, 5-7 deep."""
    qwen3_5 = HermesConfig.preset("qwen3_5", 8, 4000, 14)
    assert qwen3_5.max_positions == 32768
    assert qwen3_5 == HermesConfig.qwen2_5_vl(8, 4000, 14, max_positions=32768)
    assert qwen3_5.roles() == ["mid"] * 5 + ["deep"] * 3
    assert "qwen3_5" in HermesConfig.PRESETS


def test_device_copies_are_memoised():
    cfg = HermesConfig.llava_ov(4, 10, 2)
    assert cfg.on("cpu") is cfg.on("cpu")
    assert torch.equal(cfg.on("cpu").omega, cfg.omega)


@pytest.mark.parametrize("changes, field", [
    (dict(budget=1), "budget"),
    (dict(shallow_ratio=1.5), "shallow_ratio"),
    (dict(deep_ratio=-0.1), "deep_ratio"),
    (dict(shallow_ratio=0.8, deep_ratio=0.5), "shallow_ratio"),
    (dict(reindex="sometimes"), "reindex"),
    (dict(lambda_mid=2.0), "lambda_mid"),
    (dict(num_layers=0), "num_layers"),
    (dict(prefix_len=-1), "prefix_len"),
    (dict(margin=40000), "margin"),
])
def test_invalid_values_name_the_field(changes, field):
    args = dict(num_layers=28, budget=6000, prefix_len=14) | changes
    with pytest.raises(ValueError, match=rf"HermesConfig\.{field}"):
        HermesConfig.llava_ov(**args)


def test_budget_one_allowed_without_summary():
    assert HermesConfig.llava_ov(4, 1, 0, summary=False).layer_budget_list == [1] * 4
