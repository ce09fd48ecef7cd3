"""compress.checkpoints.transforms against compressed-tensors itself: the R4 config is the dump of its own
TransformConfig objects, and the online rotation our loaders hook computes what its HadamardTransform computes
(and what a dense matrix product computes); what it does not apply is refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compress.checkpoints.transforms import (ONLINE_ATTR, R4, install_online_transforms, r4_config, transform_key,
                                             with_transforms)
from compress.errors import CompressError
from compress.quantizers.hadamard import random_hadamard, sylvester

ct = pytest.importorskip("compressed_tensors.transform")


def _spinquant_r4(transform_type: str, head_dim: int | None):
    """llm-compressor's SpinQuantModifier R4 scheme (default precision), built from compressed-tensors' classes."""
    target = "re:.*down_proj$"
    scheme = ct.TransformScheme(type=transform_type, head_dim=head_dim, apply=[
        ct.TransformArgs(targets=[target], location="input"),
        ct.TransformArgs(targets=[target], location="weight_input", inverse=True),
    ])
    return ct.TransformConfig(config_groups={"R4": scheme})


@pytest.mark.parametrize("transform_type, head_dim", [("hadamard", 512), ("hadamard", None), ("random-hadamard", None)])
def test_the_r4_config_is_compressed_tensors_own(transform_type, head_dim):
    ours = r4_config(transform_type, head_dim)
    assert ours == _spinquant_r4(transform_type, head_dim).model_dump()
    assert ct.TransformConfig.model_validate(ours).model_dump() == ours  # its validation (extra fields forbidden) takes it
    assert with_transforms(None, ours)["transform_config"] == ours


class _Mlp(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.down_proj = nn.Linear(width, 8, bias=False, dtype=torch.float32)

    def forward(self, x):
        return self.down_proj(x)


def _ct_input(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What down_proj is fed once compressed-tensors' hooks (or ours) ran."""
    seen = []
    handle = model.down_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        model(x)
    handle.remove()
    return seen[0]


@pytest.mark.parametrize("transform_type, width, head_dim", [("hadamard", 96, 32), ("hadamard", 64, None),
                                                              ("random-hadamard", 96, None)])
def test_the_online_rotation_is_compressed_tensors_transform(transform_type, width, head_dim):
    block = head_dim or width
    stored = sylvester(block) if transform_type == "hadamard" else torch.sign(random_hadamard(width, 3))
    x = torch.randn(3, 5, width, generator=torch.Generator().manual_seed(0))
    theirs = _Mlp(width)
    ct.apply_transform_config(theirs, ct.TransformConfig.model_validate(r4_config(transform_type, head_dim)))
    if transform_type == "hadamard":  # its deterministic matrix is ours: Sylvester's, in scipy's order
        assert torch.equal(theirs.down_proj.R4_input.weight.double(), stored)
    with torch.no_grad():  # the stored matrix, as its loaders put it in place
        theirs.down_proj.R4_input.weight.copy_(stored)
    ours = _Mlp(width)
    earlier = []  # a hook registered first (an activation quantizer's) still sees the rotated input: ours runs first
    ours.down_proj.register_forward_pre_hook(lambda _m, args: earlier.append(args[0]))
    hooked = install_online_transforms(ours, {"quantization_config": with_transforms(None, r4_config(transform_type, head_dim))},
                                       lambda key: stored.float() if key == transform_key("down_proj", R4) else None)
    assert hooked == 1 and getattr(ours.down_proj, ONLINE_ATTR) is not None
    got, expected = _ct_input(ours, x), _ct_input(theirs, x)
    assert torch.equal(got, expected) and torch.equal(earlier[0], expected)
    dense = torch.block_diag(*[stored / block ** 0.5] * (width // block))  # the textbook product
    assert torch.allclose(got.double(), x.double() @ dense, atol=1e-6)


def _config(scheme_changes: dict = None, args_changes: dict = None) -> dict:
    tc = r4_config("hadamard", None)
    tc["config_groups"][R4].update(scheme_changes or {})
    tc["config_groups"][R4]["apply"][0].update(args_changes or {})
    return {"quantization_config": with_transforms(None, tc)}


@pytest.mark.parametrize("config, stored, needle", [
    (_config({"type": "random-matrix"}), True, "type 'random-matrix' is not applied here"),
    (_config(args_changes={"location": "output"}), True, "online location 'output' is not applied here"),
    (_config(), False, "has no stored matrix (down_proj.R4_input.weight)"),
    (_config({"head_dim": 48}), True, "is [64, 64], not [48, 48]"),
])
def test_what_is_not_applied_is_one_line(config, stored, needle):
    read = (lambda key: sylvester(64).float()) if stored else (lambda key: None)
    with pytest.raises(CompressError) as caught:
        install_online_transforms(_Mlp(64), config, read)
    assert needle in str(caught.value) and "\n" not in str(caught.value)
