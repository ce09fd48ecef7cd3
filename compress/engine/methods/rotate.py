"""Rotations fused offline as a method: QuaRot's (random) Hadamard R1 on the residual stream and R2 on each head's
values, written as an ordinary dense checkpoint with the same function. Placed first in a recipe, the stages after
it compress the rotated checkpoint, where outlier channels are spread over every channel before any grid is fitted.
Asked for, SpinQuant's R4 rotates each down projection's input online: fused into its weight, and recorded as
compressed-tensors' ``transform_config`` (`compress.checkpoints.transforms`) with its matrix, which every loader
(ours, compressed-tensors, vLLM) applies at run time.
The ``learned`` kind starts from the random-hadamard R1 and R2 and trains them (one R2 per block) by Cayley SGD
against the quantized model's loss on the calibration windows (SpinQuant; `compress.engine.rotation_learning`).
Algorithms: `compress.quantizers.hadamard`, `compress.quantizers.rotation`, `compress.quantizers.cayley`; the
rewrite: `compress.engine.rotation`.
"""

from __future__ import annotations

import enum
import json
import os
import re
from typing import ClassVar, Optional

import torch
from pydantic import Field, model_validator

from compress.checkpoints.rotation_layouts import rotation_layout
from compress.checkpoints.transforms import (ATTENTION_LOCATIONS, DOWN_PROJ, INPUTS, R3, R4, input_rotation_config, r3_config,
                                             transform_config, transform_key, with_transforms)
from compress.engine.methods.base import CheckpointMethod, MethodConfig, Rewritten
from compress.engine.registry import register_method
from compress.engine.rotation import write_rotated
from compress.engine.rotation_learning import Training, learn_rotations
from compress.errors import CompressError
from compress.quantizers.activations import ActivationPreset
from compress.quantizers.grid import MAX_BITS, MIN_BITS, QuantScheme
from compress.quantizers.hadamard import hadamard, random_hadamard, sylvester


class RotationKind(str, enum.Enum):
    hadamard = "hadamard"  # deterministic: H / √n (Sylvester × Paley)
    random_hadamard = "random-hadamard"  # diag(±1) · H / √n, signs drawn from the seed (QuaRot)
    learned = "learned"  # random-hadamard's R1 and R2 trained against the quantized model's loss (SpinQuant)


class OnlineRotation(str, enum.Enum):
    r4 = "r4"  # a Hadamard on each down projection's input, at run time (SpinQuant's R4)
    inputs = "inputs"  # a Hadamard on every linear layer's input, at run time (QuIP's V, llm-compressor's QuIPModifier)
    r3 = "r3"  # a Hadamard on each head's queries and keys after RoPE, at run time (SpinQuant's R3), for a quantized KV cache


class RotateConfig(MethodConfig):
    kind: RotationKind = Field(RotationKind.random_hadamard, description="hadamard, random-hadamard (seeded signs) or "
                               "learned (random-hadamard's R1 and R2 trained on the calibration windows)")
    seed: int = Field(0, description="random-hadamard and learned: the signs' seed (R1 from it, R2 from seed + 1)")
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
        "random-hadamard signs from seed + 3); r3 (each head's queries and keys after RoPE, so a quantized KV cache "
        "stores rotated keys; the head size, or block; random-hadamard signs from seed + 4)")
    steps: int = Field(20, ge=1, description="learned: Cayley SGD steps (SpinQuant: 100)")
    lr: float = Field(1.5, gt=0, description="learned: the learning rate (SpinQuant's 1.5; each step is also at most 1 / ‖W‖₁)")
    momentum: float = Field(0.0, ge=0, lt=1, description="learned: Cayley SGD's momentum")
    windows: int = Field(4, ge=1, description="learned: calibration windows per step, taken in turn (cycling)")
    train_bits: Optional[int] = Field(4, ge=MIN_BITS, le=MAX_BITS, description="learned: the bits of the weights' grid the "
                                      "loss is measured on (round to nearest, symmetric); null: the weights in float, the "
                                      "inputs alone quantized (SpinQuant's setting before GPTQ, which then fits the weights)")
    train_group_size: int = Field(-1, description="learned: that grid's columns per scale; -1: one scale per output channel")
    train_activations: Optional[ActivationPreset] = Field(None, description="learned: also fake-quantize the layers' inputs: "
                                                    "a dynamic preset (int4-token, int8-token, fp8-token, fp8-group, mxfp4)")

    @model_validator(mode="after")
    def _learned_settings(self) -> "RotateConfig":
        given = sorted(self.model_fields_set & _LEARNED)
        if given and self.kind is not RotationKind.learned:
            raise ValueError(f"{', '.join(given)}: settings of kind learned: drop them, or use kind learned")
        if self.kind is RotationKind.learned:
            if self.block is not None:
                raise ValueError("a learned rotation mixes every channel: drop block (or use hadamard or random-hadamard)")
            if not (self.residual or self.heads):
                raise ValueError("learned trains R1 and R2: keep residual or heads (online rotations alone: random-hadamard)")
            if self.train_activations is not None and not self.train_activations.scheme().dynamic:
                raise ValueError(f"train_activations {self.train_activations.value} needs a calibrated static scale, which the training does "
                                 "not fit: use a dynamic preset (int4-token, int8-token, fp8-token, fp8-group, mxfp4)")
            if self.train_bits is None and self.train_activations is None:
                raise ValueError("train_bits null without train_activations quantizes nothing, and a rotation keeps the float "
                                 "model's loss: give train_bits or train_activations")
            if self.train_group_size != -1 and self.train_group_size < 1:
                raise ValueError(f"train_group_size {self.train_group_size}: give a positive number of columns, or -1")
        return self

    @model_validator(mode="after")
    def _something_rotated(self) -> "RotateConfig":
        if not (self.residual or self.heads or self.online):
            raise ValueError("residual, heads and online are all off, so nothing is rotated: keep one (e.g. online: [r4])")
        if {OnlineRotation.r4, OnlineRotation.inputs} <= set(self.online) or len(set(self.online)) < len(self.online):
            raise ValueError("online inputs rotates the down projections' inputs too: give r4 or inputs, once")
        return self


_LEARNED = {"steps", "lr", "momentum", "windows", "train_bits", "train_group_size", "train_activations"}


def training_grid(bits: int | None, group_size, options: dict) -> dict:
    """learned's training grid for the stage the rotation feeds: its input grid (``options``' ``activations``), the
    weights in float (SpinQuant's setting before GPTQ), where the stage sets one; else its weight grid (``bits``, and
    ``group_size`` where it is a number of columns)."""
    if "activations" in options:
        return {"train_bits": None, "train_activations": options["activations"]}
    group = str(group_size if group_size is not None else "")
    return {**({"train_bits": bits} if bits is not None else {}),
            **({"train_group_size": int(group)} if group.lstrip("-").isdigit() else {})}


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _record(config: dict, groups: dict) -> None:
    """``config`` with the transform schemes ``groups`` recorded beside those it records already."""
    recorded = transform_config(config) or {"config_groups": {}}
    config["quantization_config"] = with_transforms(config.get("quantization_config"),
                                                    {"config_groups": {**recorded["config_groups"], **groups}})


def _check_divides(block: int | None, width: int) -> None:
    if block is not None and width % block:
        raise CompressError(f"rotation: block {block} does not divide the width {width}: choose a block that divides it")


def _matrix(kind: RotationKind, n: int, seed: int, block: int | None = None):
    """The ``[n, n]`` rotation: one Hadamard of the width, or ``diag(B, …, B)`` for a ``[block, block]`` ``B``."""
    _check_divides(block, n)
    size = n if block is None else block
    try:  # learned: its starting point, random-hadamard's
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
        if cfg.kind is RotationKind.learned:
            q, r, note = self._learn(handle, layout, config, q, r, online, calibration, progress)
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

    def record(self) -> dict:
        """The method's settings; learned's only with kind learned."""
        record = super().record()
        return record if self.config.kind is RotationKind.learned else {k: v for k, v in record.items() if k not in _LEARNED}

    def _learn(self, handle, layout, config, q, r, online, calibration, progress):
        """R1 and one R2 per block trained from ``q`` and ``r`` (`compress.engine.rotation_learning`), and a note."""
        cfg = self.config
        if calibration is None:
            raise CompressError("rotate learned trains on calibration windows: give a calibration set (--calib, or a "
                                "calibration section)")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # every rank would write the output directory
            raise CompressError("rotate learned rewrites the checkpoint in one process: run it without a launcher "
                                "(torchrun), then launch the other stages on its output")
        blocks = config["num_hidden_layers"]
        r = None if r is None else r.expand(blocks, *r.shape).clone()
        weights = None if cfg.train_bits is None else QuantScheme(cfg.train_bits, True, cfg.train_group_size)
        # one window per forward pass: the whole model's activations are kept for the backward pass (SmolLM2 at 512
        # tokens: about 2.5 GB a window), where the engine's batch_size sizes one block's
        training = Training(cfg.steps, cfg.lr, cfg.momentum, cfg.windows, 1, weights,
                            None if cfg.train_activations is None else cfg.train_activations.scheme())
        learned = learn_rotations(handle, layout, q, r, online, calibration, training, progress=progress)
        handle.release(handle.model)  # the whole model the training loaded
        grid = ("float weights" if weights is None else f"W{cfg.train_bits}" + (f" g{cfg.train_group_size}" if cfg.train_group_size != -1 else "")) + (
            f", inputs {cfg.train_activations.value}" if cfg.train_activations else "")
        return learned.q, learned.r, (f"learned by {cfg.steps} Cayley SGD steps (lr {cfg.lr}, {cfg.windows} windows each) on the "
                                      f"{grid} model's loss: {learned.losses[0]:.4f} at the first step, {learned.losses[-1]:.4f} at the last")

    def _online(self, handle, layout, config: dict, which: OnlineRotation) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], str]:
        """The online rotation ``which``: its normalized block by the weight it fuses into, its stored ±1 matrices,
        and a note; ``config`` gets the transforms recorded, one scheme per input width."""
        cfg = self.config
        if which is OnlineRotation.r3:
            return self._online_r3(handle, layout, config)
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
            transforms.update(input_rotation_config(scheme, self._online_kind.value, None if block == n else block, [target])["config_groups"])
            stored[transform_key(f"{handle.blocks_name}.0.{weights[0].removesuffix('.weight')}", scheme)] = h.to(torch.float32)
            fused.update({w: h / block ** 0.5 for w in weights})
            parts.append(f"{kind} of {block} over {n} channels")
        _record(config, transforms)
        what = "each down projection's input" if r4 else "every linear layer's input"
        return fused, stored, f"{which.value} online on {what} ({'; '.join(parts)}), recorded as transform_config"

    def _online_r3(self, handle, layout, config: dict) -> tuple[dict, dict[str, torch.Tensor], str]:
        """R3: each head's queries and keys rotated alike at run time, so nothing is fused (the scores are unchanged);
        the matrix is stored once, under the first block's attention module."""
        head_dim = _head_dim(config)
        block, h, kind = self._online_block(OnlineRotation.r3, head_dim, self.config.seed + 4)
        attention = layout.mixer.rsplit(".", 2)[0]  # the module holding the output projection: self_attn
        target = f"re:.*{re.escape(attention)}$"
        _record(config, r3_config(self._online_kind.value, block, target))
        stored = {transform_key(f"{handle.blocks_name}.0.{attention}", R3, ATTENTION_LOCATIONS[0]): h.to(torch.float32)}
        note = f"r3 online on each head's queries and keys after RoPE ({kind} of {block} over {head_dim} channels)"
        return {}, stored, note + ", recorded as transform_config"

    @property
    def _online_kind(self) -> RotationKind:
        """The online rotations' kind: learned's are random-hadamard's (fixed, not trained)."""
        return RotationKind.random_hadamard if self.config.kind is RotationKind.learned else self.config.kind

    def _online_block(self, which: OnlineRotation, width: int, seed: int) -> tuple[int, torch.Tensor, str]:
        """The block order, the ±1 matrix and its description of an online rotation of inputs ``width`` wide."""
        cfg = self.config
        _check_divides(cfg.block, width)
        if self._online_kind is RotationKind.hadamard:  # compressed-tensors' deterministic hadamard: Sylvester's, powers of two
            block = cfg.block or width & -width
            if block & (block - 1):
                raise CompressError(f"rotate online {which.value} with hadamard: block {block} is not a power of two, which "
                                    "compressed-tensors' deterministic hadamard needs: use a power of two or random-hadamard")
            return block, sylvester(block), "Sylvester blocks"
        block = cfg.block or width  # the ±1 matrix of the whole width, or of one block
        return block, torch.sign(_matrix(self._online_kind, block, seed)), ("one random Hadamard" if block == width else "random Hadamard blocks")
