"""hermes.policy: a policy is built from one frozen `StreamSetup`, complete before the policy exists (model geometry
read off the loaded model, the stream's settings checked); the registry refuses what it cannot hold."""
import dataclasses
import types

import pytest
import torch

import hermes.policy as policy_module
from hermes.linear_state import LinearLayout
from hermes.parallel import HeadShard
from hermes.policy import StreamPolicy, StreamSetup, attention_layers, geometry_of, get_policy, register_policy
from hermes.stream import HermesStream
from scaffolding.models import tiny_llava_ov, tiny_qwen2_5_vl, tiny_qwen3_5, tiny_qwen3_vl
from scaffolding.tokenizer import tiny_tokenizer

BUILDERS = {"llava_ov": (tiny_llava_ov, {}), "qwen2_5_vl": (tiny_qwen2_5_vl, {"frame_size": (16, 16)}),
            "qwen3_vl": (tiny_qwen3_vl, {"frame_size": (8, 8)})}
SEEN: list[StreamSetup] = []


@register_policy
class Probe(StreamPolicy):
    """Records the setup it is built from, then stands on HERMES's config and cache."""

    name = "probe-setup"

    def __init__(self, setup, **policy_args):
        super().__init__(setup)
        SEEN.append(setup)
        hermes = get_policy("hermes")(setup, **policy_args)
        self.cfg, self.cache = hermes.cfg, hermes.cache


@pytest.mark.parametrize("family", list(BUILDERS))
def test_geometry_is_read_off_the_loaded_model(family):
    build, _ = BUILDERS[family]
    model = build(num_layers=3)
    text = model.config.get_text_config()
    geometry = geometry_of(model)
    assert (geometry.num_layers, geometry.num_heads, geometry.num_kv_heads, geometry.max_positions) == \
        (3, text.num_attention_heads, text.num_key_value_heads, text.max_position_embeddings)
    assert geometry.head_dim == model.model.language_model.layers[0].self_attn.head_dim
    assert geometry.rope_theta == text.rope_parameters["rope_theta"]
    sections = text.rope_parameters.get("mrope_section")
    assert geometry.mrope == (sections is not None)
    assert geometry.rotary.counts == (tuple(sections) if sections else (geometry.head_dim // 2,))
    rotary = model.model.language_model.rotary_emb
    assert torch.allclose(geometry.inv_freq(), rotary.inv_freq.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("family", list(BUILDERS))
def test_the_policy_is_built_from_a_complete_frozen_setup(family):
    """Everything the policy reads is in the setup when its __init__ runs: the checked settings, the prefix, the
    chunk size, the geometry and the model's own dtype, inverse frequencies and layer devices."""
    build, stream_kwargs = BUILDERS[family]
    model = build()
    tokenizer = tiny_tokenizer(digits=family == "qwen3_vl")
    SEEN.clear()
    stream = HermesStream(model, tokenizer, policy="probe-setup", budget=40, batch_size=2, chunk_frames=4, room=96,
                          system_prompt="Watch.", backend="torch", **stream_kwargs)
    (setup,) = SEEN
    assert stream.setup is setup and stream.policy.setup is setup
    family_of = setup.family
    assert setup.model is model and setup.tokenizer is tokenizer and setup.language_model is model.model.language_model
    assert (setup.batch_size, setup.room, setup.backend, setup.frame_size) == \
        (2, 96, "torch", stream_kwargs.get("frame_size"))
    assert setup.prefix_ids == tuple(tokenizer(family_of.prefix_text("Watch."), add_special_tokens=False)["input_ids"])
    assert setup.prefix_len == len(setup.prefix_ids) == stream.cfg.prefix_len
    assert setup.chunk_tokens == family_of.tokens_per_chunk(model, 4, stream_kwargs.get("frame_size"),
                                                            tokenizer=tokenizer)
    assert setup.geometry == geometry_of(model)
    assert setup.dtype == model.model.language_model.layers[0].self_attn.k_proj.weight.dtype
    assert torch.equal(setup.inv_freq, family_of.rotary(model)[0])
    assert setup.layer_devices == tuple(torch.device("cpu") for _ in model.model.language_model.layers)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setup.room = 1


def test_settings_are_checked_before_the_policy_is_built():
    """A bad stream setting is refused naming it, and the policy is never constructed."""
    model = tiny_llava_ov()
    SEEN.clear()
    for kwargs, match in (({"batch_size": 0}, "batch_size"), ({"room": -1}, "room"),
                          ({"chunk_tokens": 0}, "chunk_tokens"), ({"backend": "cuda"}, "backend")):
        with pytest.raises(ValueError, match=match):
            HermesStream(model, tiny_tokenizer(), policy="probe-setup", budget=40, **kwargs)
    with pytest.raises(TypeError, match="processor"):
        HermesStream(model, None, policy="probe-setup")
    assert SEEN == []


def test_switching_the_backend_reaches_the_policy():
    stream = HermesStream(tiny_llava_ov(), tiny_tokenizer(), budget=40)
    stream.backend = "torch"
    assert stream.setup.backend == stream.policy.setup.backend == "torch"
    with pytest.raises(ValueError, match="backend"):
        stream.backend = "cuda"
    assert stream.policy.setup.backend == "torch"


def test_the_registry_refuses_what_it_cannot_hold():
    class Nameless(StreamPolicy):
        pass

    class Taken(StreamPolicy):
        name = "probe-setup"

    with pytest.raises(ValueError, match="needs a class attribute `name`"):
        register_policy(Nameless)
    with pytest.raises(ValueError, match="taken by Probe"):
        register_policy(Taken)
    with pytest.raises(TypeError, match="StreamPolicy subclass"):
        register_policy(object)
    with pytest.raises(ValueError, match="policy: expected one of"):
        get_policy("no-such-policy")
    assert register_policy(Probe) is Probe  # the same class again is fine


def test_the_hybrid_model_s_setup_holds_its_full_attention_layers_and_linear_layout():
    """A hybrid decoder (Qwen3.5): the layers that hold keys are the full-attention ones, in depth order, read without
    a family given; the linear-attention layers' states are described by the setup's `linear` layout; a model whose
    every layer is full attention has none."""
    model = tiny_qwen3_5()
    language_model = model.model.language_model
    kinds = tuple(model.config.get_text_config().layer_types)
    full = [layer for layer, kind in zip(language_model.layers, kinds) if kind == "full_attention"]
    assert 0 < len(full) < len(kinds)
    assert attention_layers(model) == full
    setup = StreamSetup.build(model, tiny_tokenizer(digits=True), frame_size=(8, 8), backend="torch")
    assert setup.linear is not None and setup.linear.kinds == kinds
    assert setup.linear == LinearLayout.of(language_model, kinds)
    assert setup.geometry.num_layers == len(full) and len(setup.layer_devices) == len(full)
    assert StreamSetup.build(tiny_llava_ov(), tiny_tokenizer()).linear is None


def test_build_s_defaults_are_the_stream_s():
    """StreamSetup.build called without the stream's settings: one stream, 16-frame chunks, 512 slots of room, the
    "auto" backend, no tensor parallelism."""
    model = tiny_llava_ov()
    tokenizer = tiny_tokenizer()
    setup = StreamSetup.build(model, tokenizer)
    assert (setup.batch_size, setup.room, setup.backend, setup.frame_size, setup.shard) == (1, 512, "auto", None, None)
    assert setup.chunk_tokens == setup.family.tokens_per_chunk(model, 16, None, tokenizer=tokenizer)
    assert setup.chunk_tokens != setup.family.tokens_per_chunk(model, 17, None, tokenizer=tokenizer)


def test_a_processor_s_tokenizer_is_the_one_prompts_use():
    """A processor is kept as given and its `tokenizer` tokenizes; a processor that is not callable and has no
    tokenizer is refused naming `processor`."""
    model = tiny_llava_ov()
    tokenizer = tiny_tokenizer()
    processor = types.SimpleNamespace(tokenizer=tokenizer)
    setup = StreamSetup.build(model, processor)
    assert setup.processor is processor and setup.tokenizer is tokenizer
    for thing in (42, types.SimpleNamespace()):
        with pytest.raises(TypeError, match="^processor: "):
            StreamSetup.build(model, thing)


class _SpecialTokens:
    """A tokenizer that, like most, adds a begin-of-sequence token unless asked not to."""

    def __init__(self, tokenizer):
        self.inner = tokenizer  # not `tokenizer`: a processor's tokenizer would be taken instead

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, text, add_special_tokens=True, **kwargs):
        encoded = self.inner(text, add_special_tokens=False, **kwargs)
        if add_special_tokens:
            encoded["input_ids"] = [0, *encoded["input_ids"]]
        return encoded


def test_the_prefix_is_tokenized_without_special_tokens():
    tokenizer = tiny_tokenizer()
    wrapped = _SpecialTokens(tokenizer)
    setup = StreamSetup.build(tiny_llava_ov(), wrapped, system_prompt="Watch.")
    assert setup.tokenizer is wrapped
    plain = tokenizer(setup.family.prefix_text("Watch."), add_special_tokens=False)["input_ids"]
    assert setup.prefix_ids == tuple(plain) and setup.prefix_ids[0] != 0


@pytest.mark.parametrize("name", ["batch_size", "chunk_frames", "room", "chunk_tokens"])
def test_a_bad_setting_is_refused_with_its_own_name(name):
    with pytest.raises(ValueError, match=f"^{name}: expected a positive int, got 0$"):
        StreamSetup.build(tiny_llava_ov(), tiny_tokenizer(), **{name: 0})


def test_a_tensor_parallel_rank_s_setup_holds_its_shard_and_local_geometry(monkeypatch):
    """head_shard (hermes.parallel, run on 2 ranks in tests/hermes/test_tensor_parallel.py) is asked with the model,
    its family and decoder stack; its shard reaches the setup, whose geometry has the rank's head counts."""
    model = tiny_llava_ov()
    whole = geometry_of(model)
    shard = HeadShard(group=None, index=1, count=2, num_heads=whole.num_heads, num_kv_heads=whole.num_kv_heads)
    asked = []

    def fake_head_shard(*args):
        asked.append(args)
        return shard

    monkeypatch.setattr(policy_module, "head_shard", fake_head_shard)
    setup = StreamSetup.build(model, tiny_tokenizer())
    ((got_model, got_family, got_language_model),) = asked
    assert got_model is model and got_family is setup.family and got_language_model is model.model.language_model
    assert setup.shard is shard and setup.geometry == shard.local(whole) != whole
    assert (setup.geometry.num_heads, setup.geometry.num_kv_heads) == (whole.num_heads // 2, whole.num_kv_heads // 2)


def test_rope_theta_is_read_from_the_config_when_rope_parameters_are_absent(monkeypatch):
    """A text config without `rope_parameters` (as configs before transformers 5 are) gives its `rope_theta`."""
    model = tiny_llava_ov()
    text = model.config.get_text_config()
    fields = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "max_position_embeddings")
    older = types.SimpleNamespace(**{name: getattr(text, name) for name in fields},
                                  rope_theta=text.rope_parameters["rope_theta"] * 2)
    monkeypatch.setattr(model.config, "get_text_config", lambda *args, **kwargs: older)
    assert geometry_of(model).rope_theta == older.rope_theta


def test_a_one_layer_model_s_setup():
    """The head dim and the storage dtype are read off the first (here the only) layer that holds keys."""
    model = tiny_llava_ov(num_layers=1).to(torch.bfloat16)
    setup = StreamSetup.build(model, tiny_tokenizer())
    assert setup.geometry.num_layers == 1 and setup.dtype == torch.bfloat16
    assert setup.geometry.head_dim == model.model.language_model.layers[0].self_attn.head_dim
