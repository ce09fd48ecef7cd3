"""MoE experts as per-expert linear layers, and how calibration routes tokens through them.

transformers 5 computes a block's experts from fused 3-D parameters (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``) through one of its experts implementations, which read the module's flags
(``has_gate``, ``is_concatenated``, ``has_bias``, ``has_post_expert_norm``, ``_apply_gate``). An
`UnfusedExperts` computes the same function from one ``nn.Linear`` per expert projection, named as the
checkpoint stores them (`compress.checkpoints.conversion` builds it), so the engine finds, calibrates and
compresses every expert's projections like any other linear layer.

Calibration: with ``calibrate_all_experts`` (llm-compressor's ``moe_calibrate_all_experts``), every
token goes through every expert, so each expert's statistics see all calibration tokens, while the
block's output stays the real routed output (only the routed tokens' results, weighted by the router,
are summed). The tokens the router actually sent to each expert are counted for the report.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# Flags transformers' ``use_experts_implementation`` sets on every experts module it wraps.
EXPERT_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


@dataclass(frozen=True)
class ExpertProjections:
    """One expert's projections: names of its linear layers relative to the experts module."""

    down: str
    up: str
    gate: str | None = None


class UnfusedExperts(nn.Module):
    """A fused experts module's function over per-expert ``nn.Linear`` layers (meta until materialized).

    ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, the signature of
    transformers' experts modules."""

    def __init__(self, fused: nn.Module, experts: list[ExpertProjections], widths: tuple[int, int]):
        super().__init__()
        hidden, inter = widths
        device = next(fused.parameters()).device
        dtype = next(fused.parameters()).dtype
        object.__setattr__(self, "_fused", fused)  # its activation and gating, not its parameters
        self.has_gate, self.is_concatenated = fused.has_gate, fused.is_concatenated
        self.has_post_expert_norm = getattr(fused, "has_post_expert_norm", False)
        if self.has_post_expert_norm:
            self.post_expert_norm = fused.post_expert_norm
        self.projections = list(experts)
        for projections in experts:
            for role, path in (("gate", projections.gate), ("up", projections.up), ("down", projections.down)):
                if path is None:
                    continue
                shape = (hidden, inter) if role == "down" else (inter, hidden)
                _add_module(self, path, nn.Linear(shape[1], shape[0], bias=fused.has_bias, device=device, dtype=dtype))
        self.calibrate_all_experts = False
        self._routed = [0] * len(experts)

    def routed_tokens(self) -> dict[str, int]:
        """Tokens the router sent to each expert since the last reset, by each of its layers' relative names."""
        return {
            path: count
            for projections, count in zip(self.projections, self._routed)
            for path in (projections.gate, projections.up, projections.down)
            if path is not None
        }

    def reset_routed_tokens(self) -> None:
        self._routed = [0] * len(self.projections)

    def _expert(self, projections: ExpertProjections, x: torch.Tensor) -> torch.Tensor:
        up = self.get_submodule(projections.up)(x)
        if self.has_gate:
            gate = self.get_submodule(projections.gate)(x)
            both = torch.cat([gate, up], dim=-1) if self.is_concatenated else torch.stack([gate, up], dim=-1).flatten(-2)
            hidden = self._fused._apply_gate(both)
        else:
            hidden = self._fused.act_fn(up)
        out = self.get_submodule(projections.down)(hidden)
        return self.post_expert_norm(out) if self.has_post_expert_norm else out

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert, projections in enumerate(self.projections):
            token, slot = torch.where(top_k_index == expert)
            self._routed[expert] += int(token.numel())
            if self.calibrate_all_experts:
                result = self._expert(projections, hidden_states)[token]  # every token calibrates; routed ones count
            elif token.numel():
                result = self._expert(projections, hidden_states[token])
            else:
                continue
            out.index_add_(0, token, (result * top_k_weights[token, slot, None]).to(out.dtype))
        return out


def _add_module(root: nn.Module, path: str, module: nn.Module) -> None:
    *parents, leaf = path.split(".")
    owner = root
    for part in parents:
        if part not in owner._modules:
            owner.add_module(part, nn.Module())
        owner = owner._modules[part]
    owner.add_module(leaf, module)


def routing_modules(module: nn.Module) -> dict[str, UnfusedExperts]:
    """The `UnfusedExperts` inside ``module``, by name relative to it."""
    return {name: m for name, m in module.named_modules() if isinstance(m, UnfusedExperts)}


def router_layers(model: nn.Module) -> set[str]:
    """Linear layers that decide routing (a Linear directly inside an MoE block, beside its experts, such as
    Qwen2-MoE's ``shared_expert_gate``): left dense unless selected explicitly."""
    routers = set()
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if not any(isinstance(c, UnfusedExperts) or all(hasattr(c, f) for f in EXPERT_FLAGS) for c in children.values()):
            continue
        routers.update(f"{name}.{child}" if name else child for child, c in children.items() if isinstance(c, nn.Linear))
    return routers


def expert_layers(model: nn.Module) -> list[str]:
    """Full names of every expert's linear layers."""
    return [
        f"{prefix}.{relative}" if prefix else relative
        for prefix, module in routing_modules(model).items()
        for relative in module.routed_tokens()
    ]
