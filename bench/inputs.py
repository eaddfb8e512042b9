"""Synthetic inputs of one benchmark point (`Spec` -> `Inputs` for the HERMES stages, `H2SVCInputs` for the H2SVC
ones), at real model shapes: caches laid out as a stream leaves them, positions like a streamed cache's, guidance
queries and pooled attention without ties. Shared by the speed and memory runs (`bench/stages.py`).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

import hermes_kernels as hk
from hermes_kernels import H2SVCConfig, HermesConfig
from hermes_kernels.policies.hermes import reference
from hermes_kernels.policies.h2svc.config import EPISODIC, INSTANT, SHORT

from .shapes import GRID_WIDTH, MROPE_TIME_STEP, PREFIX_LEN, TOKENS_PER_FRAME, ModelShape

GUIDANCE_MIXED = 40     # query tokens of the mixed prompt (local + "; " + global), mid layers
GUIDANCE_GLOBAL = 20    # query tokens of the global prompt, deep layers


@dataclasses.dataclass(frozen=True)
class Spec:
    """One benchmark point: a model shape at a budget, chunk size and cache dtype on a device.

    The cache holds what one compression step sees: the prefix P, `budget` tokens kept by earlier steps and
    one freshly encoded chunk, so N = P + budget + chunk_frames * tokens_per_frame.
    """

    shape: ModelShape
    budget: int
    chunk_frames: int
    dtype: torch.dtype
    device: torch.device
    batch: int = 1
    prefix_len: int = PREFIX_LEN
    tokens_per_frame: int = TOKENS_PER_FRAME
    reindex: str = "eager"
    seed: int = 0
    policy: str = "hermes"  # "h2svc": the per-class frame memories of H2SVC (budget unused, 0)

    @property
    def chunk_tokens(self) -> int:
        return self.chunk_frames * self.tokens_per_frame

    @property
    def num_tokens(self) -> int:
        """N, cache length at the start of the step (H2SVC: the episodic block's, P + (N_e + F)·T_f)."""
        if self.policy == "h2svc":
            return self.prefix_len + self.h2svc_cfg.window(EPISODIC) * self.tokens_per_frame + self.chunk_tokens
        return self.prefix_len + self.budget + self.chunk_tokens

    @property
    def num_visual(self) -> int:
        """V = N - P."""
        return self.budget + self.chunk_tokens

    @functools.cached_property
    def cfg(self) -> HermesConfig | H2SVCConfig:
        """The policy's config at this point (HERMES at `budget`; H2SVC with the default head map)."""
        return self.h2svc_cfg if self.policy == "h2svc" else self.shape.config(self.budget, self.prefix_len,
                                                                                self.reindex)

    @functools.cached_property
    def h2svc_cfg(self) -> H2SVCConfig:
        return self.shape.h2svc_config(self.prefix_len, self.tokens_per_frame, self.reindex)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def label(self) -> str:
        memory = "h2svc" if self.policy == "h2svc" else f"b={self.budget}"
        return f"{self.shape.name} {memory} chunk={self.chunk_frames}f {self.dtype_name}"


def distinct_values(gen: torch.Generator, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """float32 `shape` whose last axis is a random permutation of 1..n, scaled to (0, 1]: never zero, no ties."""
    n = shape[-1]
    perm = torch.rand(shape, generator=gen, device=device).argsort(dim=-1)
    return (perm.to(torch.float32) + 1.0) / n


def visual_positions(spec: Spec, gen: torch.Generator) -> torch.Tensor:
    """Position ids of the whole cache as after earlier steps: int64 [L, B, N] (1D) or [L, B, 3, N] (M-RoPE).

    Prefix 0..P-1 on every axis. The `budget` retained tokens of each (layer, stream) are a random ascending
    subset of a history twice as long (so positions have gaps), and the chunk follows the history. For M-RoPE
    a visual token of frame f at merged-grid cell (r, c) sits at (P + MROPE_TIME_STEP*f, P + r, P + c).
    """
    L, B, P, device = spec.shape.geometry.num_layers, spec.batch, spec.prefix_len, spec.device
    T = spec.tokens_per_frame
    history = math.ceil(2 * spec.budget / T) * T
    draw = torch.rand(L * B, history, generator=gen, device=device)
    retained = draw.argsort(dim=-1)[:, :spec.budget].sort(dim=-1).values
    chunk = history + torch.arange(spec.chunk_tokens, device=device).expand(L * B, -1)
    token = torch.cat([retained, chunk], dim=-1).view(L, B, spec.num_visual)
    prefix = torch.arange(P, device=device).expand(L, B, P)
    if not spec.shape.geometry.mrope:
        return torch.cat([prefix, P + token], dim=-1).contiguous()
    frame, cell = token // T, token % T
    visual = torch.stack([frame * MROPE_TIME_STEP, cell // GRID_WIDTH, cell % GRID_WIDTH], dim=2) + P
    return torch.cat([prefix.unsqueeze(2).expand(L, B, 3, P), visual], dim=-1).contiguous()


class Inputs:
    """Random inputs of one `Spec` on its device, built once and shared by every stage and backend.

    keys/values [L, B, Hkv, N, D] `spec.dtype` (pristine) and work copies that in-place stages modify;
    positions (see `visual_positions`); attn, scores float32 [L, B, V] without ties; keep int64 [L, B, n]
    from the reference selection of `scores`; guidance queries [B, H, Q, D] and keys [B, Hkv, N + Q, D]
    (layer 0's cache followed by the queries' own keys).
    """

    def __init__(self, spec: Spec):
        self.spec = spec
        geometry, device = spec.shape.geometry, spec.device
        gen = torch.Generator(device=device).manual_seed(spec.seed)
        L, B, Hkv, D = geometry.num_layers, spec.batch, geometry.num_kv_heads, geometry.head_dim
        cache_shape = (L, B, Hkv, spec.num_tokens, D)
        self.keys = torch.randn(cache_shape, generator=gen, device=device, dtype=spec.dtype)
        self.values = torch.randn(cache_shape, generator=gen, device=device, dtype=spec.dtype)
        self.positions = visual_positions(spec, gen)
        self.attn = distinct_values(gen, (L, B, spec.num_visual), device)
        self.scores = distinct_values(gen, (L, B, spec.num_visual), device)
        self.inv_freq = spec.shape.inv_freq(device)
        self.guidance = {}
        for q_len in (GUIDANCE_MIXED, GUIDANCE_GLOBAL):
            q = torch.randn(B, geometry.num_heads, q_len, D, generator=gen, device=device, dtype=spec.dtype)
            own = torch.randn(B, Hkv, q_len, D, generator=gen, device=device, dtype=spec.dtype)
            self.guidance[q_len] = (q, torch.cat([self.keys[0], own], dim=2))
        self.work_keys = self.keys.clone()
        self.work_values = self.values.clone()
        self.work_positions = self.positions.clone()
        self._keep = None

    @property
    def keep(self) -> torch.Tensor:
        """Kept indices for the compaction stage, from the reference selection (the contract's format)."""
        if self._keep is None:
            self._keep = reference.select_keep(self.scores, self.spec.cfg)
        return self._keep

    def reset(self) -> None:
        """Restore the work cache from the pristine copy (outside any timed region)."""
        self.work_keys.copy_(self.keys)
        self.work_values.copy_(self.values)
        self.work_positions.copy_(self.positions)


class ClassBlock:
    """One H2SVC class block as the step finds it (engine interface, docs/h2svc.md §7): `held` = W frames in the home
    slots (full memory) and the chunk's F arrivals at frame slots W .. W+F-1, each with its positions.

    keys/values [H_c, B, C, D] (C = P + (W + F)·T_f), positions [H_c, B, C] or [H_c, B, 3, C], slot_frames
    [H_c, B, W], features [H_c, B, W, D] float32 (episodic only), and pristine copies of what a step writes (the
    home slots' K/V, positions, slot_frames, features) for `reset`.
    """

    def __init__(self, spec: "Spec", cls: int, first_frame: int, gen: torch.Generator):
        cfg, device, B = spec.h2svc_cfg, spec.device, spec.batch
        W, P, T, F = cfg.window(cls), spec.prefix_len, spec.tokens_per_frame, spec.chunk_frames
        H, D = cfg.num_rows(cls), spec.shape.geometry.head_dim
        self.window = W
        C = P + (W + F) * T
        self.keys = torch.randn(H, B, C, D, generator=gen, device=device, dtype=spec.dtype)
        self.values = torch.randn(H, B, C, D, generator=gen, device=device, dtype=spec.dtype)
        # held frames: FIFO rings hold the newest W frames at slot frame % W; the episodic memory holds W frames
        # spread over the stream so far, in shuffled slots (as after many steps of moves)
        if cls == EPISODIC:
            frames = torch.rand(H * B, first_frame, generator=gen, device=device).argsort(dim=-1)[:, :W]
        else:
            newest = torch.arange(first_frame - W, first_frame, device=device)
            frames = newest[(torch.arange(W, device=device) - first_frame) % W].expand(H * B, W)
        self.slot_frames = frames.reshape(H, B, W).contiguous()
        slot_frame = torch.cat([self.slot_frames, first_frame + torch.arange(F, device=device).expand(H, B, F)], -1)
        token = torch.arange(T, device=device)
        frame_of_token = slot_frame.repeat_interleave(T, dim=-1)  # [H, B, (W + F)·T]
        token_in_frame = token.repeat(W + F)
        prefix = torch.arange(P, device=device)
        if not spec.shape.geometry.mrope:
            visual = (P + frame_of_token * T + token_in_frame).unsqueeze(2)
            axes = 1
        else:  # as `visual_positions`: frame f, merged-grid cell (r, c) at (P + 2f, P + r, P + c)
            visual = torch.stack([P + MROPE_TIME_STEP * frame_of_token,
                                  (P + token_in_frame // GRID_WIDTH).expand_as(frame_of_token),
                                  (P + token_in_frame % GRID_WIDTH).expand_as(frame_of_token)], dim=2)
            axes = 3
        positions = torch.cat([prefix.expand(H, B, axes, P), visual], dim=-1)
        self.positions = (positions[:, :, 0] if axes == 1 else positions).contiguous()
        self.features = None
        if cls == EPISODIC:
            self.features = hk.frame_features(self.values[:, :, P:P + W * T], T, backend="torch")
        home = P + W * T
        self._home = home
        self._pristine = [self.keys[:, :, :home].clone(), self.values[:, :, :home].clone(), self.positions.clone(),
                          self.slot_frames.clone(), None if self.features is None else self.features.clone()]

    def reset(self) -> None:
        keys, values, positions, slot_frames, features = self._pristine
        self.keys[:, :, :self._home].copy_(keys)
        self.values[:, :, :self._home].copy_(values)
        self.positions.copy_(positions)
        self.slot_frames.copy_(slot_frames)
        if features is not None:
            self.features.copy_(features)


class H2SVCInputs:
    """Random inputs of one H2SVC `Spec`: the three class blocks of a model (default ratios, default head map)
    with full memories and one just-prefilled chunk of F frames, plus the episodic arrivals' features (stage (b)
    input). The stream has seen first_frame = 2·N_e frames. The step re-indexes when spec.reindex is "eager",
    to next_position = P + N_e·T_f (the model's largest retained count, the episodic memory's).
    `movers[c]`: kept frames the step moves into freed home slots, summed over rows and streams (FIFO: min(F, W)
    per row; episodic: from one STCE run on these inputs), for the bytes the step must move.
    """

    def __init__(self, spec: "Spec"):
        self.spec = spec
        cfg = spec.h2svc_cfg
        gen = torch.Generator(device=spec.device).manual_seed(spec.seed)
        T, P, F = spec.tokens_per_frame, spec.prefix_len, spec.chunk_frames
        self.first_frame = 2 * cfg.window(EPISODIC)
        next_position = P + cfg.window(EPISODIC) * T
        # the stream clock of every block (held = its full window: `clock.at`)
        self.clock = hk.StreamClock(held=0, num_frames=F, first_frame=self.first_frame,
                                    reindexed=torch.tensor(spec.reindex == "eager"), next_position=next_position)
        self.inv_freq = spec.shape.inv_freq(spec.device)
        self.blocks = {cls: ClassBlock(spec, cls, self.first_frame, gen)
                       for cls in (INSTANT, SHORT, EPISODIC) if cfg.num_rows(cls)}
        self.movers = {cls: min(F, block.window) * cfg.num_rows(cls) * spec.batch
                       for cls, block in self.blocks.items()}
        self.arriving = None
        if EPISODIC in self.blocks:
            block = self.blocks[EPISODIC]
            W = block.window
            self.arriving = hk.frame_features(block.values[:, :, P + W * T:P + (W + F) * T], T, backend="torch")
            kept = hk.stce_select(block.features, block.slot_frames, self.arriving, self.first_frame, W,
                                  backend="torch")
            self.movers[EPISODIC] = int((kept >= self.first_frame).sum())

    def reset(self) -> None:
        for block in self.blocks.values():
            block.reset()


def make_inputs(spec: "Spec") -> Inputs | H2SVCInputs:
    """The inputs of `spec`'s policy."""
    return H2SVCInputs(spec) if spec.policy == "h2svc" else Inputs(spec)
