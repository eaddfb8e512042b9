"""The released-style stages of `python -m bench` (`released_step`, `released_guidance`): what one call of
`hermes_kernels.compat.accelerate` buys a user of the released HERMES code.

Both backends of a point run one instance of `scaffolding.standin` (the released classes' step, written from their
documented behaviour) on the point's HERMES cache: "released" as it is, "torch" / "triton" after
`accelerate(instance, backend=...)`. docs/benchmarks.md#released-stages, docs/integrations.md#what-it-buys.
"""
from __future__ import annotations

import torch

from hermes_kernels.compat import accelerate
from scaffolding.standin import ReleasedLLaVAOV, ReleasedQwenVL, TinyCausalLM, TinyLanguageModel, TinyTokenizer

from .inputs import GUIDANCE_GLOBAL, GUIDANCE_MIXED, Inputs
from .stages import ADAPTER_BACKENDS, RELEASED, RELEASED_FAMILIES, Case, Unavailable


class ReleasedInputs:
    """What the released-style stages add to a point's `Inputs`, built once per point: the stand-in language model
    (shared weights, no MLP), the three prompts' attention lists, the guidance prompts."""

    def __init__(self, inputs: Inputs):
        spec = inputs.spec
        if spec.batch != 1:
            raise Unavailable("the released classes hold one stream (batch 1)")
        g, device = spec.shape.geometry, spec.device
        self.inputs, self.spec = inputs, spec
        self.qwen = g.mrope
        geometry = dict(num_layers=g.num_layers, heads=g.num_heads, kv_heads=g.num_kv_heads,
                        head_dim=g.head_dim, hidden=g.num_heads * g.head_dim,
                        max_positions=g.max_positions, theta=g.rope_theta, share_weights=True, mlp=False,
                        dtype=spec.dtype, seed=spec.seed)
        if self.qwen:
            geometry["mrope_section"] = g.rotary.counts
        self.language_model = (TinyLanguageModel(**geometry) if self.qwen else TinyCausalLM(**geometry)).to(device)
        gen = torch.Generator(device=device).manual_seed(spec.seed + 7)
        N, H = spec.num_tokens, g.num_heads

        def attention(q_len: int) -> torch.Tensor:
            return torch.rand(1, H, q_len, N + q_len, generator=gen, device=device).to(spec.dtype)

        prompts = [attention(GUIDANCE_GLOBAL), attention(GUIDANCE_GLOBAL), attention(GUIDANCE_MIXED)]
        self.attention_lists = [[weights] * g.num_layers for weights in prompts]
        self._pooled = None

    def pooled(self, model) -> torch.Tensor:
        """The attention lists pooled as the accelerated guidance pass hands them over, float32 [L, 1, V] (mid
        layers: the mixed prompt, deep: the global one, shallow: 0), so both rows select the same tokens."""
        if self._pooled is None:
            P, s, e = self.spec.prefix_len, model.short_term_threshold, model.long_term_threshold
            out = torch.zeros(self.spec.shape.geometry.num_layers, 1, self.spec.num_visual, device=self.spec.device)
            for layers, weights in ((range(s, e), self.attention_lists[2][0]), (range(e, out.shape[0]),
                                                                                self.attention_lists[1][0])):
                q = weights.shape[2]
                out[layers.start:layers.stop, 0] = weights[0].mean(0, dtype=torch.float32)[:, P:-q].mean(0)
            self._pooled = out
        return self._pooled

    def instance(self, work: bool):
        """A stand-in instance on the point's cache: the pristine tensors (the released shrink builds new ones), or
        the work copies an in-place step may overwrite (after `inputs.reset()`)."""
        spec = self.spec
        cls = ReleasedQwenVL if self.qwen else ReleasedLLaVAOV
        model = cls(self.language_model, TinyTokenizer(), spec.budget, streaming=spec.reindex == "lazy", hooks=False)
        model.visual_start_idx = spec.prefix_len
        self.load(model, work)
        return model

    def load(self, model, work: bool) -> None:
        inputs = self.inputs
        keys, values, positions = ((inputs.work_keys, inputs.work_values, inputs.work_positions) if work
                                   else (inputs.keys, inputs.values, inputs.positions))
        model.kv_cache = [(keys[layer], values[layer]) for layer in range(keys.shape[0])]
        model._position_ids_cache = [positions[layer, 0].to(torch.float32) if self.qwen else positions[layer, 0].clone()
                                     for layer in range(positions.shape[0])]


def released_inputs(inputs: Inputs) -> ReleasedInputs:
    """The point's ReleasedInputs, built on first use and kept on the Inputs."""
    if getattr(inputs, "_released", None) is None:
        inputs._released = ReleasedInputs(inputs)
    return inputs._released


def released_family(inputs: Inputs) -> None:
    """Unavailable unless the point's model family is one the released code has (LLaVA-OV, Qwen2.5-VL)."""
    if inputs.spec.shape.preset_name not in RELEASED_FAMILIES:
        raise Unavailable(f"the released code has no {inputs.spec.shape.preset_name} class (only {RELEASED_FAMILIES})")


def _adapter_backend(backend: str) -> str:
    if backend not in (RELEASED,) + ADAPTER_BACKENDS:
        raise Unavailable(f"{backend} has no released-style stage (backends: released, torch, triton)")
    return backend


def released_step_case(inputs: Inputs, backend: str, bytes_moved: int) -> Case:
    """One chunk's compression after the guidance pass. Released: `prune_kv_cache_by_attention` on the three
    prompts' per-layer attention [1, H, q, N + q] (local and global q = 20, mixed q = 40; one tensor per prompt,
    shared by the layers), then `_shrink_positions_and_rerotate_keys` (per-layer Python, new tensors per layer,
    cos/sin tables). Accelerated: the selection from the same attention pooled [L, 1, V] (as its guidance pass hands
    it over), then the same shrink call, in place. Both keep the same tokens."""
    backend = _adapter_backend(backend)
    released_family(inputs)
    r = released_inputs(inputs)
    budget = inputs.spec.budget
    if backend == RELEASED:
        model = r.instance(work=False)

        def run():
            keep = model.prune_kv_cache_by_attention(*r.attention_lists, num_keep=budget)
            model._shrink_positions_and_rerotate_keys(keep)

        case = Case(run=run, bytes_moved=bytes_moved, reset=lambda: r.load(model, work=False), has_floor=True)
        case.model = model  # the instance the case runs on (tests compare both rows' results)
        return case
    model = r.instance(work=True)
    handle = accelerate(model, backend=backend)

    def reset():
        inputs.reset()
        r.load(model, work=True)

    pooled = r.pooled(model)

    def run():
        model._shrink_positions_and_rerotate_keys(handle.select(pooled, budget))

    case = Case(run=run, bytes_moved=bytes_moved, reset=reset, has_floor=True)
    case.model = model
    return case


def released_guidance_case(inputs: Inputs, backend: str) -> Case:
    """One chunk's guidance pass. Released: the three manual attention passes (per layer: the prompt's q/k/v from
    its input embeddings, the cache concatenated and its KV heads repeated, probabilities materialised).
    Accelerated: `guidance_attention` (the mixed prompt for mid layers, the global one for deep layers, pooled
    without materialising). The language model is a random decoder at the shape's geometry with one set of weights
    for every layer (`ReleasedInputs`), so the prompt's projections cost what the real model's do."""
    backend = _adapter_backend(backend)
    released_family(inputs)
    r = released_inputs(inputs)
    model = r.instance(work=False)
    local, global_ = model.predict_next_question()
    spec = inputs.spec
    geometry = spec.shape.geometry
    kv = geometry.num_kv_heads * spec.num_tokens * geometry.head_dim * spec.dtype.itemsize
    moved = geometry.num_layers * kv  # every layer's keys read once (shallow layers included, released-style)
    if backend == RELEASED:
        def run():
            for text in (local, global_, local + "; " + global_):
                model._compute_attention_scores_manually(model._ids(text), model.kv_cache)

        return Case(run=run, bytes_moved=moved)
    handle = accelerate(model, backend=backend, guidance="embeddings")
    return Case(run=lambda: handle.guidance_attention(local, global_), bytes_moved=moved)
