"""HERMES configuration: every knob of docs/hermes.md §2 in one frozen dataclass, plus presets.

The per-layer vectors (role, recency weight ω_l, forgetting rate k_l, smoothing λ_l, budget b_l) are derived
once at construction and kept as CPU tensors; `cfg.on(device)` hands out memoised device copies so kernels
never rebuild them inside a step.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import ClassVar

import torch

from ...engine.checks import REINDEX_MODES

SHALLOW, MID, DEEP = 0, 1, 2
ROLE_NAMES = ("shallow", "mid", "deep")


@dataclasses.dataclass(frozen=True)
class HermesConfig:
    """One HERMES policy for a model with `num_layers` decoder layers.

    Fields (docs/hermes.md §2):
        num_layers      L, decoder layers of the language model.
        budget          b = |M|, visual tokens kept per layer (deep layers keep b-1 plus one summary when
                        `summary`); the system prefix is kept on top of it.
        prefix_len      P, system-prompt tokens at the head of the cache; never evicted, never re-numbered.
        shallow_ratio   layers l < int(shallow_ratio*L) are shallow (sensory memory, §2.1).
        deep_ratio      layers l >= int((1-deep_ratio)*L) are deep (long-term memory, §2.1).
        omega0, gamma   mid-layer recency weight ω = ω0 - γ·p, p = (l-s)/(e-s) (paper eq. 3).
        k0, k_end       forgetting rate: k0 in shallow layers, k0 - (k0-k_end)·p in mid layers, 0 in deep (eq. 1).
        lambda_shallow, lambda_mid, lambda_deep   cross-layer smoothing λ per role (eq. 5, appendix C).
        cascade         True: S~[l] blends S~[l+1] (released code); False: blends raw S[l+1] (paper eq. 5).
        summary         deep layers fold pruned tokens into one summary token (Alg. 1).
        reindex         "eager": compact positions every step; "lazy": only past max_positions - margin (§3.3).
        max_positions   the model's max_position_embeddings.
        margin          lazy compaction starts once a position exceeds max_positions - margin (code: 1024).
        eps             added to the min-max denominator (code: 1e-6).
    """

    num_layers: int
    budget: int
    prefix_len: int
    max_positions: int = 32768
    shallow_ratio: float = 0.1
    deep_ratio: float = 0.3
    omega0: float = 0.75
    gamma: float = 0.6
    k0: float = 20.0
    k_end: float = 8.0
    lambda_shallow: float = 0.1
    lambda_mid: float = 0.3
    lambda_deep: float = 0.4
    cascade: bool = True
    summary: bool = True
    reindex: str = "lazy"
    margin: int = 1024
    eps: float = 1e-6

    PRESETS: ClassVar[tuple[str, ...]] = ("llava_ov", "llava_ov1_5", "qwen2_5_vl", "qwen3_vl", "qwen3_5",
                                          "minicpmv4_6", "gemma4", "paper")

    role: torch.Tensor = dataclasses.field(init=False, repr=False, compare=False)
    omega: torch.Tensor = dataclasses.field(init=False, repr=False, compare=False)
    forget: torch.Tensor = dataclasses.field(init=False, repr=False, compare=False)
    lam: torch.Tensor = dataclasses.field(init=False, repr=False, compare=False)
    layer_budget: torch.Tensor = dataclasses.field(init=False, repr=False, compare=False)
    _device_copies: dict = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate()
        role, omega, forget, lam, budgets = [], [], [], [], []
        s, e = self.shallow_end, self.deep_start
        for layer in range(self.num_layers):
            if layer < s:
                r, w, k = SHALLOW, 1.0, self.k0
            elif layer >= e:
                r, w, k = DEEP, 0.0, 0.0
            else:
                p = (layer - s) / (e - s)
                r, w, k = MID, self.omega0 - self.gamma * p, self.k0 - (self.k0 - self.k_end) * p
            role.append(r)
            omega.append(w)
            forget.append(k)
            lam.append((self.lambda_shallow, self.lambda_mid, self.lambda_deep)[r])
            budgets.append(self.budget - 1 if (r == DEEP and self.summary) else self.budget)
        derived = {
            "role": torch.tensor(role, dtype=torch.int64),
            "omega": torch.tensor(omega, dtype=torch.float32),
            "forget": torch.tensor(forget, dtype=torch.float32),
            "lam": torch.tensor(lam, dtype=torch.float32),
            "layer_budget": torch.tensor(budgets, dtype=torch.int64),
            "_device_copies": {},
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def _validate(self) -> None:
        def need(ok: bool, field: str, why: str) -> None:
            if not ok:
                raise ValueError(f"HermesConfig.{field}: {why} (got {getattr(self, field)!r})")

        for field in ("num_layers", "budget", "prefix_len", "max_positions", "margin"):
            need(isinstance(getattr(self, field), int) and not isinstance(getattr(self, field), bool),
                 field, "must be an int")
        need(self.num_layers >= 1, "num_layers", "must be >= 1")
        need(self.prefix_len >= 0, "prefix_len", "must be >= 0")
        need(self.budget >= (2 if self.summary else 1), "budget",
             "must be >= 2 when summary=True (deep layers give one slot to the summary token), else >= 1")
        for field in ("shallow_ratio", "deep_ratio", "lambda_shallow", "lambda_mid", "lambda_deep"):
            need(0.0 <= getattr(self, field) <= 1.0, field, "must lie in [0, 1]")
        need(self.shallow_end <= self.deep_start, "shallow_ratio",
             f"shallow boundary int(shallow_ratio*L)={self.shallow_end} lies past the deep boundary "
             f"int((1-deep_ratio)*L)={self.deep_start}")
        need(self.reindex in REINDEX_MODES, "reindex", f"must be one of {REINDEX_MODES}")
        need(self.k0 >= 0 and self.k_end >= 0, "k0", "forgetting rates k0 and k_end must be >= 0")
        need(self.eps > 0, "eps", "must be > 0")
        need(0 <= self.margin < self.max_positions, "margin", "must lie in [0, max_positions)")
        need(self.prefix_len + self.budget + 1 <= self.max_positions, "max_positions",
             "must exceed prefix_len + budget (room for the compacted cache and its summary)")

    @property
    def shallow_end(self) -> int:
        """s = int(shallow_ratio*L): first non-shallow layer (§2.1)."""
        return int(self.shallow_ratio * self.num_layers)

    @property
    def deep_start(self) -> int:
        """e = int((1-deep_ratio)*L): first deep layer (§2.1)."""
        return int((1.0 - self.deep_ratio) * self.num_layers)

    @property
    def layer_budget_list(self) -> list[int]:
        """b_l per layer as Python ints (b, or b-1 in deep layers with summary on)."""
        return self.layer_budget.tolist()

    def roles(self) -> list[str]:
        """Role name of every layer, e.g. ['shallow', 'shallow', 'mid', ..., 'deep']."""
        return [ROLE_NAMES[r] for r in self.role.tolist()]

    def on(self, device: torch.device | str) -> SimpleNamespace:
        """The derived per-layer vectors on `device` (memoised): role, omega, forget, lam, layer_budget."""
        key = str(torch.device(device))
        if key not in self._device_copies:
            self._device_copies[key] = SimpleNamespace(
                role=self.role.to(device), omega=self.omega.to(device), forget=self.forget.to(device),
                lam=self.lam.to(device), layer_budget=self.layer_budget.to(device))
        return self._device_copies[key]

    def replace(self, **changes) -> "HermesConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str, num_layers: int, budget: int, prefix_len: int, **kwargs) -> "HermesConfig":
        """The preset called `name`, one of PRESETS (a model family names its own: `ModelFamily.preset_name`);
        `kwargs` as that preset takes them (max_positions, overrides)."""
        if name not in cls.PRESETS:
            raise ValueError(f"preset: HermesConfig has no preset {name!r}; presets: {cls.PRESETS}")
        return getattr(cls, name)(num_layers, budget, prefix_len, **kwargs)

    @classmethod
    def llava_ov(cls, num_layers: int, budget: int, prefix_len: int, max_positions: int = 32768,
                 **overrides) -> "HermesConfig":
        """LLaVA-OneVision, following the released `llavaov_hermes.py` (docs/hermes.md §5):

        - ω = 1.0 - 0.9·p in mid layers (code; the paper's eq. 3 has 0.75/0.6) — item 2;
        - k from 20 in shallow layers down to 0.5 across mid layers, distance normalised by the visual span — item 3;
        - layer split int(0.1·L) / int(0.7·L) — item 1; λ 0.1/0.3/0.4 (appendix C);
        - cascaded smoothing through already-smoothed deeper scores — item 4;
        - summary token in deep layers at budget-1 visual slots + 1 — item 8 and Alg. 1;
        - lazy re-indexing with a 1024 margin below max_position_embeddings (32768 for Qwen2-7B) — item 9.
        """
        params = dict(omega0=1.0, gamma=0.9, k0=20.0, k_end=0.5, cascade=True)
        params.update(overrides)
        return cls(num_layers=num_layers, budget=budget, prefix_len=prefix_len, max_positions=max_positions,
                   **params)

    @classmethod
    def llava_ov1_5(cls, num_layers: int, budget: int, prefix_len: int, max_positions: int = 32768,
                    **overrides) -> "HermesConfig":
        """LLaVA-OneVision-1.5 (docs/families.md#llava-onevision-1-5): neither the released code nor the paper has
        constants for it, so this is `llava_ov` (ours): the released path of the other 1D-RoPE family, whose chunks
        are likewise visual tokens alone. The policies pass the checkpoint's max_position_embeddings.
        """
        return cls.llava_ov(num_layers, budget, prefix_len, max_positions=max_positions, **overrides)

    @classmethod
    def qwen2_5_vl(cls, num_layers: int, budget: int, prefix_len: int, max_positions: int = 128000,
                   **overrides) -> "HermesConfig":
        """Qwen2.5-VL, following the released `qwenvl_hermes.py` (docs/hermes.md §5):

        - ω = 0.75 - 0.6·p in mid layers, as the paper's eq. 3 — item 2;
        - k from 20 in shallow layers down to 8 across mid layers — item 3;
        - same split, λ, cascade, summary and lazy margin as `llava_ov` — items 1, 4, 8, 9;
        - positions are 3D M-RoPE (t, h, w); compaction ranks each axis separately (appendix E.2).
        """
        params = dict(omega0=0.75, gamma=0.6, k0=20.0, k_end=8.0, cascade=True)
        params.update(overrides)
        return cls(num_layers=num_layers, budget=budget, prefix_len=prefix_len, max_positions=max_positions,
                   **params)

    @classmethod
    def qwen3_vl(cls, num_layers: int, budget: int, prefix_len: int, max_positions: int = 262144,
                 **overrides) -> "HermesConfig":
        """Qwen3-VL (docs/hermes.md §5 item 12): the released code has no Qwen3-VL wrapper and the paper gives
        no constants of its own for it, so this is `qwen2_5_vl` with Qwen3-VL-8B's 262144 positions. The layer
        split is by fraction of depth (36 layers: 0-2 shallow, 3-24 mid, 25-35 deep). Positions are 3D M-RoPE
        with interleaved sections (`RotaryLayout.interleaved`); compaction ranks each axis separately.
        """
        return cls.qwen2_5_vl(num_layers, budget, prefix_len, max_positions=max_positions, **overrides)

    @classmethod
    def qwen3_5(cls, num_layers: int, budget: int, prefix_len: int, max_positions: int = 32768,
                **overrides) -> "HermesConfig":
        """Qwen3.5 and Qwen3.5-MoE (docs/qwen3_5.md): `num_layers` counts the FULL-ATTENTION layers only, the ones
        whose cache grows and is compressed; the linear-attention layers hold no tokens and have no role. Constants
        are `qwen2_5_vl`'s (as for `qwen3_vl`: the paper gives none for this family) with the 32768 positions of
        transformers 5.24's default Qwen3.5 config. The split is by fraction of the full-attention depth: the
        default config's 8 full layers (of 32) give no shallow layer, 0-4 mid and 5-7 deep, counted in depth order
        over the full-attention layers. Positions are 3D M-RoPE, interleaved over the rotary part of each head.
        """
        return cls.qwen2_5_vl(num_layers, budget, prefix_len, max_positions=max_positions, **overrides)

    @classmethod
    def minicpmv4_6(cls, num_layers: int, budget: int, prefix_len: int, max_positions: int = 32768,
                    **overrides) -> "HermesConfig":
        """MiniCPM-V 4.6 (docs/families.md#minicpm-v-4-6): Qwen3.5's hybrid decoder, so `qwen3_5`'s constants over
        the FULL-ATTENTION layers only, with the 32768 positions of transformers 5.25's default MiniCPMV4_6Config.
        Positions are 1D (the model passes the token index on every M-RoPE axis), over the rotary part of each head.
        """
        return cls.qwen3_5(num_layers, budget, prefix_len, max_positions=max_positions, **overrides)

    @classmethod
    def gemma4(cls, num_layers: int, budget: int, prefix_len: int, max_positions: int = 131072,
               **overrides) -> "HermesConfig":
        """Gemma 4 (docs/gemma4.md): `num_layers` counts the layers the policies compress, the FULL-ATTENTION layers
        that keep keys and values of their own (5 of the 30 of transformers 5.25's default Gemma 4 text config); the
        sliding-window layers keep a window and the KV-shared layers read another layer's, neither has a role.
        Neither the released code nor the paper has constants for it, so this is `qwen2_5_vl`'s (the paper's eq. 3
        ω, k from 20 to 8, as for `qwen3_vl`, whose chunks likewise carry a text timestamp per frame) at that
        config's 131072 positions; positions are 1D. The split is by fraction of those layers, so every count >= 1
        has roles: 1 layer is deep, 2 are mid and deep, the default 5 are 0-2 mid and 3-4 deep (a shallow layer from
        10 layers on).
        """
        return cls.qwen2_5_vl(num_layers, budget, prefix_len, max_positions=max_positions, **overrides)

    @classmethod
    def paper(cls, num_layers: int, budget: int, prefix_len: int, max_positions: int = 32768,
              **overrides) -> "HermesConfig":
        """The paper as written: eq. 3 constants (ω0 = 0.75, γ = 0.6), smoothing from the raw deeper score
        S[l+1] as eq. 5 writes it (cascade=False, docs/hermes.md §5 item 4). The paper leaves k unstated (eq. 1), so
        the Qwen code's 20 → 8 is used; eager re-indexing as in the paper's §2 investigation ("re-indexing to
        contiguous [0, |M|)") — pass reindex="lazy" for streaming benchmarks (§4.1).
        """
        params = dict(omega0=0.75, gamma=0.6, k0=20.0, k_end=8.0, cascade=False, reindex="eager")
        params.update(overrides)
        return cls(num_layers=num_layers, budget=budget, prefix_len=prefix_len, max_positions=max_positions,
                   **params)
