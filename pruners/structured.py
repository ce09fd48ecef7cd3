"""Structured pruning: whole attention heads (KV groups), MLP channels, hidden channels and blocks.

Muralidharan et al., "Compact Language Models via Pruning and Knowledge Distillation" (Minitron),
NeurIPS 2024, arXiv:2407.14679 (activation importance, §2.2); block importance as ShortGPT's Block
Influence, Men et al. 2024, arXiv:2403.03853 (``1 − cos(x_in, x_out)`` of a block's input and output).

Objective. Remove the structures whose activations on calibration data are smallest, so that the
smaller *dense* model computes as nearly as possible what the original did (distillation repairs the
rest). Importance, each per token then aggregated by Minitron's best choice (mean over positions, L2
over samples): a query head by ‖its attention output‖₂ over ``head_dim`` (the input of ``o_proj``), a
KV group by the sum over its query heads (grouped-query attention keeps whole groups, so ``q``/``k``/``v``
stay consistent); an MLP channel by |its activation| (the input of ``down_proj``); a hidden channel by
|its normalized value| summed over every norm of every block; a block by its influence (or any score
where higher means keep). Every block keeps the same counts, so the config stays uniform.

Hidden channels are removed from every tensor of the residual stream at once (embeddings, each
block's norms and projections, the final norm, the LM head). An RMSNorm then averages over fewer
channels: with ``rescale_norms`` its weight is multiplied by ``sqrt(H / H')`` and its ε by ``H / H'``,
which keeps the function exactly when the removed channels are zero (and nearly, when they carry
little of the residual's energy, which is why they were chosen).

Shapes. Architecture knowledge is data (`StructuredLayout`): each tensor's dims are tagged with the
`Axis` they are indexed by. ``Q_HEADS`` dims have ``heads · head_dim`` rows in KV-group order (query
head ``h`` reads KV head ``h // heads_per_group``), ``KV_HEADS`` ``kv_heads · head_dim``. Inputs are
never modified; every function returns new tensors.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

import torch


class Axis(enum.Enum):
    HIDDEN = "hidden"
    Q_HEADS = "q_heads"
    KV_HEADS = "kv_heads"
    MLP = "mlp"


Dims = tuple[Axis | None, ...]  # per tensor dim: the axis it is indexed by (None: kept whole)


@dataclass(frozen=True)
class StructuredLayout:
    """Where each structure lives in one architecture; names are relative to a block unless 'outer'."""

    block_tensors: Mapping[str, Dims]  # e.g. "self_attn.q_proj.weight": (Q_HEADS, HIDDEN)
    outer_tensors: Mapping[str, Dims]  # full names outside the blocks (embeddings, final norm, head)
    head_outputs: str  # module whose input is the concatenated head outputs (o_proj)
    mlp_activations: str  # module whose input is the MLP's intermediate activation (down_proj)
    hidden_norms: tuple[str, ...]  # block modules whose outputs are normalized hidden states
    rms_norms: tuple[str, ...]  # tensors (block-relative or outer) of RMSNorms over the hidden size
    config_keys: Mapping[str, str] = field(default_factory=lambda: {
        "layers": "num_hidden_layers", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
        "head_dim": "head_dim", "mlp": "intermediate_size", "hidden": "hidden_size", "eps": "rms_norm_eps"})
    per_layer_lists: tuple[str, ...] = ("layer_types",)  # config lists with one entry per block
    hidden_per_head: bool = False  # the config requires hidden_size % num_attention_heads == 0 (LlamaConfig)


@dataclass(frozen=True)
class Geometry:
    """The sizes structured pruning changes (``heads`` counts query heads)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    hidden: int

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.kv_heads

    def width(self, axis: Axis) -> int:
        return {Axis.HIDDEN: self.hidden, Axis.MLP: self.mlp, Axis.Q_HEADS: self.heads * self.head_dim,
                Axis.KV_HEADS: self.kv_heads * self.head_dim}[axis]


AXES = ("heads", "mlp", "hidden", "layers")


def target_geometry(g: Geometry, targets: Mapping[str, float], hidden_per_head: bool = False) -> Geometry:
    """The pruned sizes. A value below 1 is the fraction removed (heads: of the KV groups); a whole
    number ≥ 1 is the size kept (heads: query heads, a multiple of the heads per KV group). With
    ``hidden_per_head`` the hidden size kept must be a multiple of the query heads kept."""
    sizes = {"heads": g.kv_heads, "mlp": g.mlp, "hidden": g.hidden, "layers": g.layers}  # heads in KV groups
    for key, value in targets.items():
        if key not in AXES:
            raise ValueError(f"unknown axis {key!r}: use heads, mlp, hidden or layers")
        n = sizes[key]
        if 0 < value < 1:
            keep = n - round(value * n)
            if keep == n:
                raise ValueError(f"{key}={value} removes none of {n}{' KV groups' if key == 'heads' else ''}: give a larger fraction")
        elif value >= 1 and value == int(value):
            keep = int(value)
            if key == "heads":
                if keep % g.heads_per_group:
                    raise ValueError(f"heads={keep} is not a multiple of the {g.heads_per_group} query heads per KV group: whole groups are pruned")
                keep //= g.heads_per_group
        else:
            raise ValueError(f"{key}={value} is neither a fraction in (0, 1) nor a whole size: write e.g. {key}=0.25 or {key}={n // 2 or 1}")
        if not 1 <= keep <= n:
            raise ValueError(f"{key}={value} keeps {keep} of {n}: keep between 1 and {n}")
        sizes[key] = keep
    heads = sizes["heads"] * g.heads_per_group
    if hidden_per_head and sizes["hidden"] % heads:
        fit = sizes["hidden"] // heads * heads
        raise ValueError(f"a hidden size of {sizes['hidden']} is not a multiple of the {heads} attention heads kept, which "
                         f"this architecture's config requires: set hidden={fit or heads}, or keep other heads")
    return replace(g, layers=sizes["layers"], kv_heads=sizes["heads"], heads=heads, mlp=sizes["mlp"], hidden=sizes["hidden"])


def parameter_count(block: Mapping[str, tuple[tuple[int, ...], Dims]], outer: Mapping[str, tuple[tuple[int, ...], Dims]],
                    before: Geometry, after: Geometry) -> int:
    """Parameters of the pruned model: ``after.layers`` blocks shaped like ``block`` plus ``outer``
    (each name → its original shape and axes), every tagged dim resized from ``before`` to ``after``."""
    def numel(shape, dims) -> int:
        return math.prod(after.width(a) if a is not None else n for n, a in zip(shape, dims))

    return after.layers * sum(numel(*v) for v in block.values()) + sum(numel(*v) for v in outer.values())


def solve_width(fixed: Geometry, count: Callable[[Geometry], int], target: int,
                axes: tuple[str, ...] = ("mlp", "hidden"), align: int = 8, hidden_per_head: bool = False) -> Geometry:
    """Scale the ``axes`` widths of ``fixed`` by one common ratio (each rounded down to a multiple of
    ``align`` where the original is one; with ``hidden_per_head`` the hidden width also to a multiple of
    ``fixed.heads``) to the most parameters not above ``target``."""
    def size(axis: str, n: int, ratio: float) -> int:
        step = align if n % align == 0 and n >= 2 * align else 1
        if axis == "hidden" and hidden_per_head:
            step = math.lcm(step, fixed.heads)
        return max(step, int(ratio * n) // step * step)

    def at(ratio: float) -> Geometry:
        return replace(fixed, **{a: size(a, getattr(fixed, a), ratio) for a in axes})

    if count(at(1.0)) <= target:
        return at(1.0)
    if count(at(0.0)) > target:
        raise ValueError(f"no {'/'.join(axes)} width reaches {target:,} parameters (the smallest has {count(at(0.0)):,}): prune heads or layers too")
    lo, hi = 0.0, 1.0
    for _ in range(50):  # count(at(ratio)) grows with ratio
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if count(at(mid)) <= target else (lo, mid)
    return at(lo)


def activation_score(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-group importance of one batch ``x [B, T, C]``: the ℓ2 norm of each of ``groups`` equal slices
    of the channels per token, meaned over T, squared and summed over B (``[groups]``, float32).
    Sum the batches' results and take the square root: Minitron's (batch L2, sequence mean)."""
    b, t, c = x.shape
    if c % groups:
        raise ValueError(f"{c} channels do not split into {groups} equal groups")
    per_token = x.detach().float().reshape(b, t, groups, c // groups).norm(dim=-1)  # [B, T, G]
    return per_token.mean(dim=1).square().sum(dim=0)


def block_influence(x_in: torch.Tensor, x_out: torch.Tensor) -> tuple[float, int]:
    """ShortGPT's Block Influence summed over tokens: Σ (1 − cos(x_in, x_out)), and the token count."""
    a, b = x_in.detach().float().flatten(0, -2), x_out.detach().float().flatten(0, -2)
    return float((1 - torch.nn.functional.cosine_similarity(a, b, dim=-1)).sum()), a.shape[0]


def top_indices(scores: torch.Tensor, keep: int) -> tuple[int, ...]:
    """The ``keep`` highest scores' indices in increasing order (ties: the lower index is kept)."""
    order = sorted(range(scores.numel()), key=lambda i: (-float(scores[i]), i))
    return tuple(sorted(order[:keep]))


@dataclass(frozen=True)
class StructuredPlan:
    """What is kept: blocks (original indices, in order) and per kept block its KV groups and MLP
    channels, and the hidden channels (shared by every block)."""

    before: Geometry
    layers: tuple[int, ...]
    kv_groups: tuple[tuple[int, ...], ...]
    mlp: tuple[tuple[int, ...], ...]
    hidden: tuple[int, ...]

    @property
    def after(self) -> Geometry:
        g = self.before
        return replace(g, layers=len(self.layers), kv_heads=len(self.kv_groups[0]),
                       heads=len(self.kv_groups[0]) * g.heads_per_group, mlp=len(self.mlp[0]), hidden=len(self.hidden))

    def index(self, axis: Axis, block: int | None) -> torch.Tensor:
        """Kept positions along ``axis`` in kept block number ``block`` (None: outside the blocks)."""
        g = self.before
        if axis is Axis.HIDDEN:
            return torch.tensor(self.hidden)
        if block is None:
            raise ValueError(f"{axis.value} channels exist only inside blocks")
        if axis is Axis.MLP:
            return torch.tensor(self.mlp[block])
        per = g.heads_per_group if axis is Axis.Q_HEADS else 1
        heads = [k * per + r for k in self.kv_groups[block] for r in range(per)]
        return torch.tensor([h * g.head_dim + d for h in heads for d in range(g.head_dim)])


def make_plan(before: Geometry, after: Geometry, head_scores: torch.Tensor, mlp_scores: torch.Tensor,
              hidden_scores: torch.Tensor, block_scores: torch.Tensor) -> StructuredPlan:
    """Keep the highest-scoring structures: ``head_scores [L, heads]`` (summed per KV group),
    ``mlp_scores [L, mlp]``, ``hidden_scores [hidden]``, ``block_scores [L]`` (higher: keep)."""
    expected = {"head_scores": (head_scores, (before.layers, before.heads)), "mlp_scores": (mlp_scores, (before.layers, before.mlp)),
                "hidden_scores": (hidden_scores, (before.hidden,)), "block_scores": (block_scores, (before.layers,))}
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    groups = head_scores.float().reshape(before.layers, before.kv_heads, before.heads_per_group).sum(dim=-1)
    layers = top_indices(block_scores, after.layers)
    return StructuredPlan(
        before, layers,
        tuple(top_indices(groups[i], after.kv_heads) for i in layers),
        tuple(top_indices(mlp_scores[i], after.mlp) for i in layers),
        top_indices(hidden_scores, after.hidden),
    )


def prune_tensor(tensor: torch.Tensor, dims: Dims, plan: StructuredPlan, block: int | None = None,
                 rms_norm: bool = False, rescale_norms: bool = True) -> torch.Tensor:
    """``tensor`` with each tagged dim indexed by the kept positions of kept block ``block``; an RMSNorm
    weight also multiplied by ``sqrt(H / H')`` (see the module docstring) when ``rescale_norms``."""
    if len(dims) != tensor.dim():
        raise ValueError(f"tensor of shape {tuple(tensor.shape)} has {tensor.dim()} dims, its layout names {len(dims)}")
    out = tensor
    for d, axis in enumerate(dims):
        if axis is not None:
            if tensor.shape[d] != plan.before.width(axis):
                raise ValueError(f"dim {d} of a tensor of shape {tuple(tensor.shape)} is not the {axis.value} width {plan.before.width(axis)}")
            out = out.index_select(d, plan.index(axis, block).to(tensor.device))
    if rms_norm and rescale_norms and len(plan.hidden) < plan.before.hidden:
        out = (out.double() * math.sqrt(plan.before.hidden / len(plan.hidden))).to(tensor.dtype)
    return out.clone() if out is tensor else out


def pruned_config(config: Mapping, layout: StructuredLayout, plan: StructuredPlan, rescale_norms: bool = True) -> dict:
    """The checkpoint's ``config.json`` for the pruned model (a new dict)."""
    keys, g, after = layout.config_keys, plan.before, plan.after
    new = dict(config)
    new.update({keys["layers"]: after.layers, keys["heads"]: after.heads, keys["kv_heads"]: after.kv_heads,
                keys["head_dim"]: g.head_dim, keys["mlp"]: after.mlp, keys["hidden"]: after.hidden})
    if rescale_norms and after.hidden < g.hidden and keys.get("eps") in config:
        new[keys["eps"]] = config[keys["eps"]] * g.hidden / after.hidden
    for key in layout.per_layer_lists:
        values = config.get(key)
        if isinstance(values, list) and len(values) == g.layers:
            new[key] = [values[i] for i in plan.layers]
    return new


def geometry_of(config: Mapping, layout: StructuredLayout) -> Geometry:
    """The sizes ``config`` (a config.json mapping) declares, by ``layout``'s key names."""
    keys = layout.config_keys
    heads = int(config[keys["heads"]])
    hidden = int(config[keys["hidden"]])
    head_dim = config.get(keys["head_dim"]) or hidden // heads
    return Geometry(int(config[keys["layers"]]), heads, int(config.get(keys["kv_heads"]) or heads), int(head_dim),
                    int(config[keys["mlp"]]), hidden)


def check_scores(scores: Sequence[torch.Tensor]) -> None:
    if any(not bool(torch.isfinite(s).all()) for s in scores):
        raise ValueError("importance scores contain NaN or inf (the model overflowed on the calibration data)")
