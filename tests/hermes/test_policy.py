"""hermes.policy: a policy is built from one frozen `StreamSetup`, complete before the policy exists (model geometry
read off the loaded model, the stream's settings checked); the registry refuses what it cannot hold."""
import dataclasses

import pytest
import torch

from hermes.policy import StreamPolicy, StreamSetup, geometry_of, get_policy, register_policy
from hermes.stream import HermesStream
from scaffolding.models import tiny_llava_ov, tiny_qwen2_5_vl, tiny_qwen3_vl
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
