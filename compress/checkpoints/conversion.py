"""The checkpoint's tensor names against the model's, by transformers' own weight-conversion mappings.

transformers 5 renames some weights between disk and memory (GPT-NeoX stores its output layer as
``embed_out``, Mixtral its MoE block as ``block_sparse_moe``) and keeps MoE experts as fused 3-D
parameters (``experts.gate_up_proj`` ``[E, 2I, H]``) while checkpoints hold one 2-D tensor per expert
projection (``experts.{e}.gate_proj.weight``). ``from_pretrained`` applies the mapping of
``transformers.conversion_mapping.get_model_conversion_mapping`` and ``save_pretrained`` reverses it
(``core_model_loading.revert_weight_conversion``). We use the same machinery, never a table of our own:

- `CheckpointNames`: each on-disk name renamed as transformers renames it (its ``WeightRenaming``
  transforms, ``rename_source_key``), so a model parameter finds its tensor; and back, for writing, so an
  output keeps the on-disk layout transformers reads (``embed_out.weight``, ``embed_out.weight_packed``).
- `unfuse_experts`: each fused experts module whose checkpoint stores per-expert tensors becomes an
  `UnfusedExperts` holding one ``nn.Linear`` per on-disk expert projection, named by renaming those
  on-disk names. Which on-disk tensor is which slice of the fused parameters (gate or up half, which
  expert) is found by running transformers' reverse conversion on parameters filled with their own
  element indices: every on-disk tensor is then a tensor of indices, matched to the gate/up/down
  slices that the experts' implementation flags (``has_gate``, ``is_concatenated``, ``is_transposed``,
  set by transformers' ``use_experts_implementation``) define. Loading and writing are then per tensor.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from compress.checkpoints.experts import EXPERT_FLAGS, ExpertProjections, UnfusedExperts
from compress.errors import CompressError

log = logging.getLogger(__name__)

_INDEX_SIZES = (2, 3)  # the small intermediate and hidden widths of the index tensors (distinct: transposes show)


def _transforms(model: nn.Module) -> list:
    """transformers' ordered weight transforms for ``model`` (empty before transformers 5)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # pragma: no cover - transformers 4.x: names on disk are the model's
        return []
    try:
        return get_model_conversion_mapping(model, add_legacy=True)
    except Exception as exc:  # noqa: BLE001 - a mapping transformers cannot build for this model
        log.warning("transformers' weight-conversion mapping for %s is unavailable (%s): names are used as stored",
                    type(model).__name__, exc)
        return []


def _renamings(transforms: list) -> list:
    from transformers.core_model_loading import WeightRenaming

    return [t for t in transforms if isinstance(t, WeightRenaming)]


class CheckpointNames:
    """Model parameter name ↔ on-disk tensor name, as transformers renames them when loading."""

    def __init__(self, model: nn.Module, disk_names: list[str], transforms: list | None = None):
        renamings = _renamings(transforms if transforms is not None else _transforms(model))
        self._disk_of: dict[str, str] = {}
        if renamings:
            from transformers.core_model_loading import rename_source_key

            expected = dict.fromkeys(model.state_dict(), True)
            prefix = getattr(model, "base_model_prefix", None)
            for key in disk_names:
                name, _ = rename_source_key(key, renamings, [], prefix, expected)
                if name not in expected and key in expected:
                    name = key
                self._disk_of.setdefault(name, key)
        # Only the renamings the checkpoint used are reversed on writing (as transformers saves).
        self._reverse = [t.reverse_transform() for t in reversed(renamings) if t.was_used()]

    def disk_key(self, name: str) -> str | None:
        """The on-disk name of model tensor ``name`` where transformers renames it (None: not renamed)."""
        return self._disk_of.get(name)

    def disk_name(self, name: str) -> str:
        """The name to write model tensor ``name`` (or a new tensor of a module, e.g. ``weight_packed``) under,
        in the checkpoint's own on-disk layout."""
        known = self._disk_of.get(name)
        if known is not None:
            return known
        module, _, leaf = name.rpartition(".")
        for sibling in ("weight", "bias"):
            stored = self._disk_of.get(f"{module}.{sibling}")
            if stored is not None:
                return f"{stored.rpartition('.')[0]}.{leaf}"
        if self._reverse:
            return _apply_renamings(name, self._reverse)
        return name

    def disk_module(self, name: str) -> str:
        """The on-disk name of module ``name`` (its weight's prefix)."""
        return self.disk_name(f"{name}.weight").rpartition(".")[0]


class RenamingWriter:
    """Hands every tensor to ``writer`` under its on-disk name (`CheckpointNames.disk_name`)."""

    def __init__(self, writer, names: CheckpointNames):
        self._writer, self._names = writer, names

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._writer.add(self._names.disk_name(name), tensor)

    def __getattr__(self, attr: str):
        return getattr(self._writer, attr)


# -- fused experts -----------------------------------------------------------------------------------
def _is_fused_experts(module: nn.Module) -> bool:
    return all(hasattr(module, flag) for flag in EXPERT_FLAGS) and any(
        p.dim() == 3 for p in module.parameters(recurse=False)
    )


def _index_tensors(module: nn.Module, prefix: str) -> dict[str, torch.Tensor] | None:
    """The module's own parameters at small widths, each element holding its unique index (float64); None
    when they are not the layout transformers' experts implementations read."""
    inter, hidden = _INDEX_SIZES
    experts = next(p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3)
    gated = 2 if module.has_gate else 1
    up_shape, down_shape = (experts, gated * inter, hidden), (experts, hidden, inter)
    if module.is_transposed:
        up_shape, down_shape = (experts, hidden, gated * inter), (experts, inter, hidden)
    shapes = {
        "gate_up_proj" if module.has_gate else "up_proj": up_shape,
        "down_proj": down_shape,
    }
    if module.has_bias:
        shapes["gate_up_proj_bias" if module.has_gate else "up_proj_bias"] = (experts, gated * inter)
        shapes["down_proj_bias"] = (experts, hidden)
    own = dict(module.named_parameters(recurse=False))
    missing = [n for n in shapes if n not in own]
    if missing or set(own) - set(shapes):
        log.info("%s (%s) has parameters %s, not %s: its experts stay fused", prefix, type(module).__name__, sorted(own), list(shapes))
        return None
    tensors, start = {}, 0
    for name, shape in shapes.items():
        count = int(torch.tensor(shape).prod())
        tensors[f"{prefix}.{name}"] = torch.arange(start, start + count, dtype=torch.float64).reshape(shape)
        start += count
    return tensors


def _canonical(module: nn.Module, prefix: str, ids: dict[str, torch.Tensor]) -> dict[tuple[str, int, str], torch.Tensor]:
    """(role, expert, kind) → the index tensor of that slice as an ``[out, in]`` weight or ``[out]`` bias."""
    inter = _INDEX_SIZES[0]

    def split(fused: torch.Tensor) -> dict[str, torch.Tensor]:  # [..., 2I(, H)] → gate/up halves on dim 1
        if not module.has_gate:
            return {"up": fused}
        if module.is_concatenated:
            return {"gate": fused[:, :inter], "up": fused[:, inter:]}
        return {"gate": fused[:, 0::2], "up": fused[:, 1::2]}

    first = "gate_up_proj" if module.has_gate else "up_proj"
    up = ids[f"{prefix}.{first}"]
    down = ids[f"{prefix}.down_proj"]
    if module.is_transposed:
        up, down = up.transpose(1, 2), down.transpose(1, 2)
    weights = {**split(up), "down": down}
    slices = {(role, e, "weight"): w[e] for role, w in weights.items() for e in range(w.shape[0])}
    if module.has_bias:
        biases = {**split(ids[f"{prefix}.{first}_bias"]), "down": ids[f"{prefix}.down_proj_bias"]}
        slices.update({(role, e, "bias"): b[e] for role, b in biases.items() for e in range(b.shape[0])})
    return slices


def _on_disk_layout(model: nn.Module, module: nn.Module, prefix: str) -> dict[tuple[str, int, str], str]:
    """(role, expert, kind) → the on-disk tensor name transformers saves that slice under."""
    from transformers.core_model_loading import revert_weight_conversion

    ids = _index_tensors(module, prefix)
    if ids is None:
        return {}
    try:
        stored = revert_weight_conversion(model, dict(ids))
    except Exception as exc:  # noqa: BLE001 - a conversion transformers cannot reverse: the experts stay fused
        log.info("transformers cannot map %s to its on-disk layout (%s): its experts stay fused", prefix, exc)
        return {}
    slices = _canonical(module, prefix, ids)
    by_first = {float(t.reshape(-1)[0]): key for key, t in slices.items()}
    layout: dict[tuple[str, int, str], str] = {}
    for disk, tensor in stored.items():
        key = by_first.get(float(tensor.reshape(-1)[0])) if tensor.numel() else None
        if key is None or not torch.equal(tensor, slices[key]):
            return {}  # fused on disk too, or another layout: the module stays fused
        layout[key] = disk
    return layout if len(layout) == len(slices) else {}



def _apply_renamings(name: str, renamings: list) -> str:
    """``name`` through each `WeightRenaming` in turn (transformers' ``apply_renamings``, which releases
    before 5.24 lack; ``rename_source_key`` is the method every release has)."""
    for renaming in renamings:
        name, _ = renaming.rename_source_key(name)
    return name

def unfuse_experts(model: nn.Module, disk_names: set[str], transforms: list) -> list[str]:
    """Replace each fused experts module whose checkpoint holds per-expert tensors by an `UnfusedExperts`
    with one ``nn.Linear`` per on-disk projection; returns the replaced modules' names."""
    renamings = _renamings(transforms)
    replaced = []
    for prefix, module in list(model.named_modules()):
        if not _is_fused_experts(module):
            continue
        layout = _on_disk_layout(model, module, prefix)
        stored_modules = {name.rpartition(".")[0] for name in disk_names}  # packed layers store weight_packed, ...
        if not layout or not any(name.rpartition(".")[0] in stored_modules for name in layout.values()):
            if any(f"{prefix}.{n}" in disk_names for n, _ in module.named_parameters(recurse=False)):
                log.info("%s is stored fused: its experts stay one module and are not compressed", prefix)
            continue
        projections: dict[int, dict[str, str]] = {}
        for (role, expert, kind), disk in layout.items():
            if kind != "weight":
                continue
            name = _apply_renamings(disk, renamings).removesuffix(".weight")
            if not name.startswith(prefix + "."):
                raise CompressError(
                    f"{disk} is {name} after transformers' renamings, outside {prefix}: this MoE layout is not supported"
                )
            projections.setdefault(expert, {})[role] = name[len(prefix) + 1:]
        widths = _real_widths(module)
        experts = [ExpertProjections(**projections[e]) for e in sorted(projections)]
        unfused = UnfusedExperts(module, experts, widths)
        owner, _, attr = prefix.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, attr, unfused)
        replaced.append(prefix)
    return replaced


def _real_widths(module: nn.Module) -> tuple[int, int]:
    """(hidden, intermediate) of the fused experts, from the down projection's shape."""
    down = module.down_proj.shape
    return (down[2], down[1]) if module.is_transposed else (down[1], down[2])


def checkpoint_names(model: nn.Module, disk_names: list[str]) -> CheckpointNames:
    """Unfuse ``model``'s per-expert-stored experts (in place), then map its names to the checkpoint's."""
    transforms = _transforms(model)
    if transforms:
        unfuse_experts(model, set(disk_names), transforms)
    return CheckpointNames(model, disk_names, transforms)
