"""Rotations fused offline as a method: QuaRot's (random) Hadamard R1 on the residual stream and R2 on each head's
values, written as an ordinary dense checkpoint with the same function. Placed first in a recipe, the stages after
it compress the rotated checkpoint, where outlier channels are spread over every channel before any grid is fitted.
Algorithms: `compress.quantizers.hadamard`, `compress.quantizers.rotation`; the rewrite: `compress.engine.rotation`.
"""

from __future__ import annotations

import enum
import json
from typing import ClassVar

from pydantic import Field

from compress.checkpoints.rotation_layouts import rotation_layout
from compress.engine.methods.base import CheckpointMethod, MethodConfig, Rewritten
from compress.engine.registry import register_method
from compress.engine.rotation import write_rotated
from compress.errors import CompressError
from compress.quantizers.hadamard import hadamard, random_hadamard


class RotationKind(str, enum.Enum):
    hadamard = "hadamard"  # deterministic: H / √n (Sylvester × Paley)
    random_hadamard = "random-hadamard"  # H / √n · diag(±1), signs drawn from the seed (QuaRot)


class RotateConfig(MethodConfig):
    kind: RotationKind = Field(RotationKind.random_hadamard, description="hadamard or random-hadamard (seeded signs)")
    seed: int = Field(0, description="random-hadamard: the signs' seed (R1 from it, R2 from seed + 1)")
    heads: bool = Field(True, description="also R2: rotate each attention head's values, undone in the output projection")


def _matrix(kind: RotationKind, n: int, seed: int):
    try:
        return hadamard(n) if kind is RotationKind.hadamard else random_hadamard(n, seed)
    except ValueError as exc:
        raise CompressError(f"rotation: {exc}: this width cannot be rotated here") from None


@register_method("rotate")
class Rotate(CheckpointMethod):
    """Fuse an orthogonal rotation into the weights (the model computes the same function)."""

    Config = RotateConfig
    keeps_shapes: ClassVar[bool] = True

    def rewrite(self, handle, calibration, directory, device, batch_size, progress=None) -> Rewritten:
        cfg = self.config
        layout = rotation_layout(handle.config.model_type)
        config = json.loads((handle.path / "config.json").read_text())
        hidden = config["hidden_size"]
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        q = _matrix(cfg.kind, hidden, cfg.seed)
        r = _matrix(cfg.kind, head_dim, cfg.seed + 1) if cfg.heads else None
        untied = write_rotated(handle, layout, q, r, directory)
        notes = [f"{cfg.kind.value} rotation of the residual stream ({hidden} wide)"
                 + (f" and of each head's values ({head_dim} wide)" if r is not None else "")]
        if untied:
            config["tie_word_embeddings"] = False
            notes.append("the output layer is written apart from the embeddings: the final norm's scale folds into it alone")
        return Rewritten(config, self.record(), notes)
