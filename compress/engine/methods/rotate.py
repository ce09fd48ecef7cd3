"""Rotations fused offline as a method: QuaRot's (random) Hadamard R1 on the residual stream and R2 on each head's
values, written as an ordinary dense checkpoint with the same function. Placed first in a recipe, the stages after
it compress the rotated checkpoint, where outlier channels are spread over every channel before any grid is fitted.
Asked for, SpinQuant's R4 rotates each down projection's input online: fused into its weight, and recorded as
compressed-tensors' ``transform_config`` (`compress.checkpoints.transforms`) with its matrix, which every loader
(ours, compressed-tensors, vLLM) applies at run time.
Algorithms: `compress.quantizers.hadamard`, `compress.quantizers.rotation`; the rewrite: `compress.engine.rotation`.
"""

from __future__ import annotations

import enum
import json
import re
from typing import ClassVar, Optional

import torch
from pydantic import Field, model_validator

from compress.checkpoints.rotation_layouts import rotation_layout
from compress.checkpoints.transforms import DOWN_PROJ, INPUTS, R4, input_rotation_config, transform_key, with_transforms
from compress.engine.methods.base import CheckpointMethod, MethodConfig, Rewritten
from compress.engine.registry import register_method
from compress.engine.rotation import write_rotated
from compress.errors import CompressError
from compress.quantizers.hadamard import hadamard, random_hadamard, sylvester


class RotationKind(str, enum.Enum):
    hadamard = "hadamard"  # deterministic: H / √n (Sylvester × Paley)
    random_hadamard = "random-hadamard"  # H / √n · diag(±1), signs drawn from the seed (QuaRot)


class OnlineRotation(str, enum.Enum):
    r4 = "r4"  # a Hadamard on each down projection's input, at run time (SpinQuant's R4)
    inputs = "inputs"  # a Hadamard on every linear layer's input, at run time (QuIP's V, llm-compressor's QuIPModifier)


class RotateConfig(MethodConfig):
    kind: RotationKind = Field(RotationKind.random_hadamard, description="hadamard or random-hadamard (seeded signs)")
    seed: int = Field(0, description="random-hadamard: the signs' seed (R1 from it, R2 from seed + 1)")
    residual: bool = Field(True, description="R1: rotate the residual stream, each norm's scale folded into the layers "
                           "that read it; false: R2 and R4 alone, no norm folded")
    heads: bool = Field(True, description="also R2: rotate each attention head's values, undone in the output projection")
    block: Optional[int] = Field(None, gt=1, description="rotate in blocks of this many channels: every rotation block-"
                                 "diagonal (e.g. 16, NVFP4's scale group; 32, MXFP4's), so each block mixes only with "
                                 "itself; it divides every width; r4 with hadamard: a power of two")
    online: list[OnlineRotation] = Field(
        default_factory=list, description="online rotations, recorded as compressed-tensors transforms: r4 (each down "
        "projection's input; hadamard: Sylvester blocks of the largest power of two dividing the width; random-hadamard: "
        "the whole width, signs from seed + 2); inputs (every linear layer's input, each of its own width as r4's; "
        "random-hadamard signs from seed + 3)")

    @model_validator(mode="after")
    def _something_rotated(self) -> "RotateConfig":
        if not (self.residual or self.heads or self.online):
            raise ValueError("residual, heads and online are all off, so nothing is rotated: keep one (e.g. online: [r4])")
        if set(self.online) == {OnlineRotation.r4, OnlineRotation.inputs} or len(set(self.online)) < len(self.online):
            raise ValueError("online inputs rotates the down projections' inputs too: give r4 or inputs, once")
        return self


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _check_divides(block: int | None, width: int) -> None:
    if block is not None and width % block:
        raise CompressError(f"rotation: block {block} does not divide the width {width}: choose a block that divides it")


def _matrix(kind: RotationKind, n: int, seed: int, block: int | None = None):
    """The ``[n, n]`` rotation: one Hadamard of the width, or ``diag(B, …, B)`` for a ``[block, block]`` ``B``."""
    _check_divides(block, n)
    size = n if block is None else block
    try:
        base = hadamard(size) if kind is RotationKind.hadamard else random_hadamard(size, seed)
    except ValueError as exc:
        raise CompressError(f"rotation: {exc}: this width cannot be rotated here") from None
    return base if size == n else torch.block_diag(*[base] * (n // size))


@register_method("rotate")
class Rotate(CheckpointMethod):
    """Fuse an orthogonal rotation into the weights (the model computes the same function)."""

    Config = RotateConfig
    keeps_shapes: ClassVar[bool] = True

    def rewrite(self, handle, calibration, directory, device, batch_size, progress=None) -> Rewritten:
        cfg = self.config
        layout = rotation_layout(handle.config.model_type)
        config = json.loads((handle.path / "config.json").read_text())
        hidden, head_dim = config["hidden_size"], _head_dim(config)
        q = _matrix(cfg.kind, hidden, cfg.seed, cfg.block) if cfg.residual else None
        head_block = cfg.block if cfg.block and cfg.block < head_dim else None
        r = _matrix(cfg.kind, head_dim, cfg.seed + 1, head_block) if cfg.heads else None
        online, extra, notes = {}, {}, []
        for which in cfg.online:
            fused, stored, note = self._online(handle, layout, config, which)
            online, extra = {**online, **fused}, {**extra, **stored}
            notes.append(note)
        untied = write_rotated(handle, layout, q, r, directory, online=online, extra=extra)
        fused = ([f"the residual stream ({hidden} wide)"] if q is not None else []) + (
            [f"each head's values ({head_dim} wide)"] if r is not None else [])
        if fused:
            blocks = f" in blocks of {cfg.block}" if cfg.block else ""
            notes.insert(0, f"{cfg.kind.value} rotation{blocks} of " + " and of ".join(fused))
        if untied:
            config["tie_word_embeddings"] = False
            notes.append("the output layer is written apart from the embeddings: the final norm's scale folds into it alone")
        return Rewritten(config, self.record(), notes)

    def _online(self, handle, layout, config: dict, which: OnlineRotation) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], str]:
        """The online rotation ``which``: its normalized block by the weight it fuses into, its stored ±1 matrices,
        and a note; ``config`` gets the transforms recorded, one scheme per input width."""
        cfg = self.config
        if layout.down is None:
            raise CompressError(f"rotate online {which.value}: {config['model_type']}'s experts are held fused by transformers "
                                "and vLLM, not as the Linear layers an online transform hooks: rotate without it")
        hidden, mlp, r4 = config["hidden_size"], config["intermediate_size"], which is OnlineRotation.r4
        if r4:
            groups = {mlp: [layout.down]}
        else:  # each layer's own input width: the stream's readers, the output projection (heads × head size), down
            width = {layout.mixer: config["num_attention_heads"] * _head_dim(config), layout.down: mlp}
            groups: dict[int, list[str]] = {}
            for w in [w for readers in layout.norms.values() for w in readers] + list(layout.writers):
                groups.setdefault(width.get(w, hidden), []).append(w)
        fused, stored, transforms, parts = {}, {}, {}, []
        for n, weights in groups.items():
            block, h, kind = self._online_block(which, n, cfg.seed + (2 if r4 else 3))
            scheme = R4 if r4 else f"{INPUTS}{n}"
            target = DOWN_PROJ if r4 else "re:.*\\.(" + "|".join(re.escape(w.removesuffix(".weight")) for w in weights) + ")$"
            transforms.update(input_rotation_config(scheme, cfg.kind.value, None if block == n else block, [target])["config_groups"])
            stored[transform_key(f"{handle.blocks_name}.0.{weights[0].removesuffix('.weight')}", scheme)] = h.to(torch.float32)
            fused.update({w: h / block ** 0.5 for w in weights})
            parts.append(f"{kind} of {block} over {n} channels")
        config["quantization_config"] = with_transforms(config.get("quantization_config"), {"config_groups": transforms})
        what = "each down projection's input" if r4 else "every linear layer's input"
        return fused, stored, f"{which.value} online on {what} ({'; '.join(parts)}), recorded as transform_config"

    def _online_block(self, which: OnlineRotation, width: int, seed: int) -> tuple[int, torch.Tensor, str]:
        """The block order, the ±1 matrix and its description of an online rotation of inputs ``width`` wide."""
        cfg = self.config
        _check_divides(cfg.block, width)
        if cfg.kind is RotationKind.hadamard:  # compressed-tensors' deterministic hadamard: Sylvester's, powers of two
            block = cfg.block or width & -width
            if block & (block - 1):
                raise CompressError(f"rotate online {which.value} with hadamard: block {block} is not a power of two, which "
                                    "compressed-tensors' deterministic hadamard needs: use a power of two or random-hadamard")
            return block, sylvester(block), "Sylvester blocks"
        block = cfg.block or width  # the ±1 matrix of the whole width, or of one block
        return block, torch.sign(_matrix(cfg.kind, block, seed)), ("one random Hadamard" if block == width else "random Hadamard blocks")
