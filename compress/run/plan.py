"""Plans: measured sensitivity in, one candidate per layer out, under a size budget or a KLD ceiling.

- The sensitivity file (`compress measure -o sensitivity.json`, JSON): per layer its shape and, per
  candidate, the stored bytes and the figures of `compress.engine.sensitivity` (``residual_error``,
  ``layer_error``, ``rel_error``, output layers' ``kld``), plus ``uniform_kld``: the calibration KLD with
  every layer at one candidate. A rerun with the same model, calibration and settings measures only the
  candidates the file lacks.
- The cost model: a layer's predicted KLD increase is its ``kld`` where measured exactly (the output layer
  and the input embeddings), else ``gain · residual_error``. ``gain`` is fitted to the uniform runs: for
  each candidate ``c``, ``gain_c = (uniform_kld_c − Σ exact klds) / Σ residual_error`` (over the layers
  without an exact kld), and ``gain`` is their geometric mean. Costs are assumed additive over layers; the prediction of a plan is their sum.
- Allocation: `compress.quantizers.allocation` (an exact DP, or within its stated slack).
- A plan: ``{"layers": {layer: candidate}}`` (JSON or YAML), written with its budget and prediction; a
  recipe stage takes one as ``plan:`` (a file, an inline ``layers:`` mapping, or a sensitivity file with
  a target), and so a user can edit it by hand. ``re:`` keys in an inline plan are regexes.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, model_validator

from compress.checkpoints.sizes import parse_size
from compress.errors import CompressError
from compress.formats.candidates import parse_candidate
from compress.quantizers.allocation import minimize_cost, minimize_size

SENSITIVITY_FORMAT = "llm-compress sensitivity 1"
PLAN_FORMAT = "llm-compress plan 1"


def read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise CompressError(f"{what} {path} does not exist: give the file `compress measure` or `compress allocate` wrote")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))  # JSON is YAML too; plans may be written by hand as YAML
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise CompressError(f"{path} is not JSON/YAML ({getattr(exc, 'problem', exc)}): fix or regenerate it") from None
    if not isinstance(data, dict):
        raise CompressError(f"{path} is not a mapping: it is not a {what}")
    return data


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON under a temporary name, then rename: never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


# -- the sensitivity file and its cost model ------------------------------------------------------
@dataclass
class Sensitivity:
    data: dict[str, Any]
    path: Path | None = None

    @property
    def candidates(self) -> list[str]:
        return list(self.data.get("uniform_kld", {}))

    @property
    def layers(self) -> dict[str, dict[str, Any]]:
        return self.data["layers"]

    def gains(self) -> dict[str, float]:
        """``gain_c`` per candidate (see the module docstring); candidates without residual error are left out."""
        gains = {}
        for c, kld in self.data["uniform_kld"].items():
            figures = [layer["candidates"][c] for layer in self.layers.values()]
            exact = sum(f["kld"] for f in figures if f.get("kld") is not None)
            residual = sum(f.get("residual_error") or 0.0 for f in figures if f.get("kld") is None)
            if residual > 0 and kld - exact > 0:
                gains[c] = (kld - exact) / residual
        return gains

    def gain(self) -> float:
        gains = [g for g in self.gains().values() if g > 0]
        if not gains:
            raise CompressError(f"{self.path or 'the sensitivity file'} has no usable uniform KLD: measure again with more calibration data")
        return math.exp(sum(map(math.log, gains)) / len(gains))

    def costs(self) -> dict[str, dict[str, float]]:
        """Predicted KLD increase per layer and candidate."""
        g = self.gain()
        return {
            name: {c: f["kld"] if f.get("kld") is not None else g * (f.get("residual_error") or 0.0) for c, f in layer["candidates"].items()}
            for name, layer in self.layers.items()
        }

    def weights(self) -> int:
        return sum(layer["shape"][0] * layer["shape"][1] for layer in self.layers.values())


def load_sensitivity(path: Path) -> Sensitivity:
    data = read_json(path, "sensitivity file")
    if data.get("format") != SENSITIVITY_FORMAT:
        raise CompressError(f"{path} is not a sensitivity file (format {data.get('format')!r}): give the file `compress measure -o` wrote")
    return Sensitivity(data, path)


# -- plans ----------------------------------------------------------------------------------------
@dataclass
class Plan:
    layers: dict[str, str]  # layer -> candidate name
    bytes: int = 0  # the planned layers as stored
    weights: int = 0  # their weight count
    predicted_kld: float | None = None
    budget: str = ""  # what was asked for, in words
    slack: int = 0  # the allocator's discretization bound (bytes)
    gain: float | None = None
    costs: dict[str, float] = field(default_factory=dict)  # predicted KLD per layer
    sizes: dict[str, int] = field(default_factory=dict)
    unit: int = 1  # the allocator's step (bytes)
    sensitivity: str | None = None  # the measurements it was allocated from (a hand-edited plan is re-predicted from them)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.bytes / max(self.weights, 1)

    def to_dict(self) -> dict[str, Any]:
        out = {"format": PLAN_FORMAT, **asdict(self), "bits_per_weight": round(self.bits_per_weight, 4)}
        return out


def allocate(
    sensitivity: Sensitivity,
    target_bytes: int | None = None,
    target_bpw: float | None = None,
    max_kld: float | None = None,
    fixed_bytes: int = 0,
    candidates: list[str] | None = None,
) -> Plan:
    """The plan with the lowest predicted KLD within ``target_bytes`` (a total of which ``fixed_bytes`` are
    not planned: embeddings, norms, headers) or ``target_bpw`` (over the planned layers), or the smallest
    one under ``max_kld``. ``candidates`` restricts the choice to some of the measured ones."""
    given = [x is not None for x in (target_bytes, target_bpw, max_kld)]
    if sum(given) != 1:
        raise CompressError("give exactly one of a target size, a target bits per weight or a KLD ceiling")
    costs = sensitivity.costs()
    names = list(sensitivity.layers)
    allowed = candidates or sensitivity.candidates
    unknown = [c for c in allowed if c not in sensitivity.candidates]
    if unknown:
        raise CompressError(f"candidate {unknown[0]} was not measured: measure it first, or choose among {', '.join(sensitivity.candidates)}")
    options = [[c for c in allowed] for _ in names]
    sizes = [[sensitivity.layers[n]["candidates"][c]["bytes"] for c in allowed] for n in names]
    cost_table = [[costs[n][c] for c in allowed] for n in names]
    weights = sensitivity.weights()
    if max_kld is not None:
        result = minimize_size(sizes, cost_table, max_kld)
        budget = f"predicted KLD <= {max_kld:g}"
    else:
        if target_bpw is not None:
            budget_bytes, budget = int(target_bpw * weights / 8), f"{target_bpw:g} bits per weight"
        else:
            budget_bytes, budget = target_bytes - fixed_bytes, f"{target_bytes} bytes ({fixed_bytes} not planned)"
        smallest = sum(map(min, sizes))
        if budget_bytes < smallest:
            raise CompressError(
                f"budget {budget} leaves {budget_bytes} bytes for the planned layers, below the smallest plan "
                f"({smallest} bytes, {8 * smallest / weights:.3f} bits per weight, every layer at its smallest candidate): "
                "raise the target or measure a smaller candidate"
            )
        result = minimize_cost(sizes, cost_table, budget_bytes)
    chosen = {n: options[i][k] for i, (n, k) in enumerate(zip(names, result.choice))}
    return Plan(
        chosen, result.size, weights, result.cost, budget, result.slack, sensitivity.gain(),
        {n: costs[n][c] for n, c in chosen.items()}, {n: sensitivity.layers[n]["candidates"][c]["bytes"] for n, c in chosen.items()},
        result.unit, str(sensitivity.path) if sensitivity.path else None,
    )


def uniform_plan(sensitivity: Sensitivity, candidate: str) -> Plan:
    """Every layer at ``candidate``, with its predicted KLD (for comparisons)."""
    costs = sensitivity.costs()
    names = list(sensitivity.layers)
    sizes = {n: sensitivity.layers[n]["candidates"][candidate]["bytes"] for n in names}
    per_layer = {n: costs[n][candidate] for n in names}
    return Plan({n: candidate for n in names}, sum(sizes.values()), sensitivity.weights(), sum(per_layer.values()),
                f"uniform {candidate}", 0, sensitivity.gain(), per_layer, sizes)


class PlanSpec(BaseModel):
    """A recipe stage's ``plan:``: a plan file, an inline ``layers:`` mapping (layer or ``re:`` pattern ->
    candidate), or a sensitivity file with one target (``target_bpw``, ``target_size``, ``max_kld``)."""

    model_config = ConfigDict(extra="forbid")
    path: Path | None = None
    layers: dict[str, str] | None = None
    target_bpw: float | None = None
    target_size: str | int | None = None
    max_kld: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _file_shorthand(cls, value):
        return {"path": value} if isinstance(value, (str, Path)) else value

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.layers is None):
            raise ValueError("a plan is a file (path) or an inline layers mapping: give exactly one")
        targets = sum(x is not None for x in (self.target_bpw, self.target_size, self.max_kld))
        if targets > 1:
            raise ValueError("give at most one of target_bpw, target_size, max_kld")
        if self.layers is not None and targets:
            raise ValueError("an inline plan takes no target: it is the allocation")
        return self


def resolve_plan(spec: PlanSpec, layer_names: list[str], fixed_bytes: int = 0) -> Plan:
    """The plan a stage's ``plan:`` names, over ``layer_names`` (the layers the stage selects): every
    planned layer must be selected; selected layers the plan does not list keep the stage's own settings."""
    if spec.layers is not None:
        chosen = _match_inline(spec.layers, layer_names)
        plan = Plan(chosen, budget="inline plan")
    else:
        data = read_json(spec.path, "plan")
        if data.get("format") == SENSITIVITY_FORMAT:
            sensitivity = Sensitivity(data, spec.path)
            if spec.target_bpw is None and spec.target_size is None and spec.max_kld is None:
                raise CompressError(f"{spec.path} holds measurements, not a plan: add a target (target_bpw, target_size or max_kld)")
            size = parse_size(spec.target_size) if spec.target_size is not None else None
            plan = allocate(sensitivity, size, spec.target_bpw, spec.max_kld, fixed_bytes)
        else:
            if spec.target_bpw is not None or spec.target_size is not None or spec.max_kld is not None:
                raise CompressError(f"{spec.path} is a plan already: drop the target, or give the sensitivity file instead")
            if not isinstance(data.get("layers"), dict):
                raise CompressError(f"{spec.path} has no layers mapping: it is not a plan (layer: candidate)")
            plan = _predicted(Plan({str(k): str(v) for k, v in data["layers"].items()}, budget=data.get("budget", str(spec.path)),
                                   sensitivity=data.get("sensitivity")))
    stray = [n for n in plan.layers if n not in layer_names]
    if stray:
        raise CompressError(f"the plan names {stray[0]}, which this stage does not select: select it (--include) or remove it from the plan")
    for name, candidate in plan.layers.items():
        parse_candidate(candidate)  # a bad name is a one-line error before any work
    return plan


def _match_inline(mapping: dict[str, str], layer_names: list[str]) -> dict[str, str]:
    chosen: dict[str, str] = {}
    for key, candidate in mapping.items():
        if key.startswith("re:"):
            pattern = re.compile(key[3:])
            hits = [n for n in layer_names if pattern.search(n)]
            if not hits:
                raise CompressError(f"plan pattern {key!r} matches no selected layer: fix the pattern")
            chosen.update({n: str(candidate) for n in hits})
        else:
            chosen[key] = str(candidate)
    return chosen


def _predicted(plan: Plan) -> Plan:
    """``plan`` with sizes and predicted KLD from the sensitivity file it names, when that file still holds
    every (layer, candidate) it uses (so a hand-edited plan is predicted afresh); else as it is."""
    if not plan.sensitivity or not Path(plan.sensitivity).is_file():
        return plan
    sensitivity = load_sensitivity(Path(plan.sensitivity))
    known = sensitivity.layers
    if not all(c in known.get(n, {}).get("candidates", {}) for n, c in plan.layers.items()):
        return plan
    costs = sensitivity.costs()
    plan.costs = {n: costs[n][c] for n, c in plan.layers.items()}
    plan.sizes = {n: known[n]["candidates"][c]["bytes"] for n, c in plan.layers.items()}
    plan.bytes, plan.predicted_kld, plan.gain = sum(plan.sizes.values()), sum(plan.costs.values()), sensitivity.gain()
    plan.weights = sum(known[n]["shape"][0] * known[n]["shape"][1] for n in plan.layers)
    return plan


def save_plan(path: Path, plan: Plan) -> None:
    write_json(path, plan.to_dict())


# -- a plan on the engine -------------------------------------------------------------------------
def check_plan_method(cls) -> None:
    """A plan sets each layer's weight grid (``bits``, ``group_size``), so it needs a method with that grid
    that transforms layer by layer (one that couples a block's layers, overriding ``transform_block``, cannot
    give each its own settings)."""
    from compress.engine.methods.base import Method
    from compress.engine.registry import method_class, method_names

    def takes(c) -> bool:
        return {"bits", "group_size"} <= set(c.Config.model_fields) and c.transform_block is Method.transform_block

    if not takes(cls):
        able = [n for n in method_names() if takes(method_class(n))]
        raise CompressError(f"method {cls.name} cannot take a per-layer plan: use one of {', '.join(able)}")


def plan_overrides(method_name: str, config: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Layer -> its own instance of ``method_name`` with the stage's ``config`` and the plan's grid
    (one instance per candidate)."""
    from compress.engine.registry import method_class

    cls = method_class(method_name)
    check_plan_method(cls)
    instances: dict[str, Any] = {}
    overrides = {}
    for layer, name in plan.layers.items():
        candidate = parse_candidate(name)
        if candidate.is_gguf:
            raise CompressError(f"the plan gives {layer} the GGML type {name}: GGUF plans are for compress export --plan")
        if name not in instances:
            scheme = candidate.scheme
            instances[name] = cls(cls.Config(**{**config, "bits": scheme.bits, "group_size": scheme.group_size, "symmetric": True}))
        overrides[layer] = instances[name]
    return overrides


def apply_plans(specs: list, stages: list, handle) -> list[tuple[int, Plan]]:
    """Give each planned stage (``specs[i].plan``) its per-layer method instances (``stages[i].overrides``);
    returns the plans by stage index. A ``target_size`` counts the checkpoint's unplanned tensors as fixed."""
    plans = []
    for index, (spec, stage) in enumerate(zip(specs, stages)):
        if spec.plan is None:
            continue
        fixed = 0
        if spec.plan.target_size is not None:
            keys = [handle.checkpoint_key(f"{n}.weight") for n in stage.layers]
            itemsize = handle.reader.get(keys[0]).element_size()  # one tensor read; the rest from the headers
            dense = sum(math.prod(handle.reader.shape(k)) * itemsize for k in keys)
            fixed = handle.reader.total_bytes() - dense
        plan = resolve_plan(spec.plan, list(stage.layers), fixed)
        if not plan.sizes:  # a hand-written plan: its sizes from the shapes
            from compress.checkpoints.model_io import get_weight

            itemsize = handle.reader.get(handle.checkpoint_key(f"{next(iter(plan.layers))}.weight")).element_size()
            shapes = {n: tuple(get_weight(stage.layers[n]).shape) for n in plan.layers}
            plan.sizes = {n: parse_candidate(c).stored_bytes(*shapes[n], itemsize) for n, c in plan.layers.items()}
            stray = next((n for n, size in plan.sizes.items() if size is None), None)
            if stray is not None:
                raise CompressError(f"the plan's {plan.layers[stray]} does not fit {stray} (shape {list(shapes[stray])}): choose another group size")
            plan.bytes, plan.weights = sum(plan.sizes.values()), sum(o * i for o, i in shapes.values())
        stage.overrides = plan_overrides(spec.method, spec.method_config(), plan)
        plans.append((index, plan))
    return plans


def gguf_plan(model: Path, spec: PlanSpec, config) -> tuple[Plan, dict[str, Any]]:
    """A GGUF export's per-tensor plan: ``spec`` resolved over the checkpoint's 2-D tensors (a ``target_size``
    is the whole file's, its unplanned part measured by `compress.export.sizing`), and the types by GGUF
    tensor name for `ExportConfig.types` (``config``: the export without a plan)."""
    from compress.checkpoints.shards import CheckpointReader
    from compress.export.gguf_tensors import tensor_plan
    from compress.export.gguf_arch import expert_count, read_config
    from compress.export.sizing import fixed_gguf_bytes

    hf = read_config(model)
    if expert_count(hf) > 1:
        raise CompressError("a per-tensor GGUF plan cannot type MoE experts one by one (each role's experts share one stacked "
                            "tensor): export MoE models with --type")
    # each matrix as the file stores it: its GGUF name and [rows, row length] (GPT-2's Conv1D transposed)
    matrices = [e for e in tensor_plan(CheckpointReader(model), hf, config.target) if len(e.shape) == 2 and e.sources[0].endswith(".weight")]
    shapes = {e.sources[0].removesuffix(".weight"): tuple(e.shape) for e in matrices}
    names = {e.sources[0].removesuffix(".weight"): e.gguf for e in matrices}
    fixed = 0
    if spec.target_size is not None:
        data = read_json(spec.path, "sensitivity file") if spec.path is not None else {}
        planned = {names[n] for n in data.get("layers", {}) if names.get(n)}
        fixed = fixed_gguf_bytes(config, planned)
    plan = resolve_plan(spec, [n for n, g in names.items() if g is not None], fixed)
    types = {}
    for layer, name in plan.layers.items():
        candidate = parse_candidate(name)
        if not candidate.is_gguf:
            raise CompressError(f"the plan gives {layer} the integer grid {name}: integer plans are for compress quantize --plan")
        types[names[layer]] = candidate.stored_type(shapes[layer][-1])
    if not plan.sizes:
        plan.sizes = {n: parse_candidate(c).stored_bytes(*shapes[n]) for n, c in plan.layers.items()}
        plan.bytes, plan.weights = sum(plan.sizes.values()), sum(shapes[n][0] * shapes[n][1] for n in plan.layers)
    return plan, types
