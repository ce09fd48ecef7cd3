"""The recipe: one typed description of a compression run, from YAML or built by a CLI command.

```yaml
model: path/to/checkpoint
calibration: {path: calib.txt, samples: 128, seq_len: 512, seed: 0}   # only methods with statistics need it
stages:
  - method: rtn                    # a registered method; its config keys sit beside it
    bits: 4
    group_size: 128
    exclude: ["mlp\\.down_proj"]   # optional include/exclude regexes on layer names
output: {path: out/model-rtn-w4g128, overwrite: false, format: compressed-tensors}  # or gptq, fake
evaluation: {text: eval.txt, ctx: 512}                                 # optional: ppl and KLD after the run
kv_cache: {format: fp8, strategy: tensor}   # optional: calibrated KV-cache scales (k_scale/v_scale; fp8 or int8)
resume: false                                # true: continue a killed run of this output (as --resume)
```

Unknown keys and bad values are errors naming the YAML line and the valid keys.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from compress.distill.config import DistillSpec
from compress.errors import CompressError
from compress.run.export_stage import ExportSpec
from compress.checkpoints.calibration import CalibrationSpec
from compress.checkpoints.loading import ComputeDtype
from compress.formats.base import OutputFormat
from compress.quantizers.kv_cache import KVCacheFormat
from compress.engine.kv_calibration import KVCacheSpec
from compress.engine.methods.base import Method
from compress.engine.methods.schemes import SchemeName, expand_scheme
from compress.engine.registry import method_class
from compress.run.plan import PlanSpec, check_plan_method


class Device(str, enum.Enum):
    cpu = "cpu"
    cuda = "cuda"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StageSpec(BaseModel):
    """A method name, its typed config (validated against the method's own schema), layer selection."""

    model_config = ConfigDict(extra="allow")
    method: str
    scheme: SchemeName | None = Field(None, description="a named scheme (fp8-dynamic, nvfp4, ...): expands to the method's settings")
    include: list[str] = Field(default_factory=list)
    exclude: list[str] = Field(default_factory=list)
    plan: PlanSpec | None = Field(None, description="per-layer settings: a plan file, inline layers, or a sensitivity file and a target")

    def method_config(self) -> dict[str, Any]:
        settings = dict(self.model_extra or {})
        if self.scheme is None:
            return settings
        return expand_scheme(self.scheme, self.method, settings, set(method_class(self.method).Config.model_fields))

    def build(self) -> Method:
        cls = method_class(self.method)
        return cls(cls.Config(**self.method_config()))


class OutputSpec(_Strict):
    path: Path
    overwrite: bool = False
    shard_size_mb: int = Field(256, ge=1)
    format: OutputFormat = Field(
        OutputFormat.compressed_tensors,
        description="how quantized layers are stored: packed (compressed-tensors, gptq) or fake (dense, dequantized)",
    )


class EvaluationSpec(_Strict):
    text: Path
    ctx: int = Field(512, ge=2)
    stride: int | None = Field(None, ge=1)
    batch_size: int = Field(8, ge=1)
    max_tokens: int | None = Field(None, ge=2, description="evaluate only the first N tokens of the text")
    kv_cache: KVCacheFormat | Literal["none"] | None = Field(
        None, description="KV-cache format simulated in the attention (default: the output's calibrated kv_cache, if any)"
    )


class Recipe(_Strict):
    model: Path
    stages: list[StageSpec] = Field(default_factory=list)
    output: OutputSpec
    calibration: CalibrationSpec | None = None
    evaluation: EvaluationSpec | None = None
    device: Device = Device.cpu
    # the block forwards' dtype: auto = the checkpoint's where the device computes it natively, else float32
    compute_dtype: ComputeDtype = ComputeDtype.auto
    trust_remote_code: bool = False
    distill: DistillSpec | None = None  # after the stages (if any): distil into the compressed model
    export: ExportSpec | None = None  # after the run: also write the output checkpoint as one GGUF file
    kv_cache: KVCacheSpec | None = None  # calibrate and store static KV-cache scales (needs calibration)
    resume: bool = False  # continue the killed run of this output from its first unfinished block (--resume)

    _source: Path | None = PrivateAttr(None)  # the GGUF file ``model`` was converted from, if any

    def methods(self) -> list[Method]:
        return [stage.build() for stage in self.stages]

    @property
    def source_model(self) -> Path:
        """What the user named as the model (records and model cards say this, not a scratch conversion)."""
        return self._source or self.model

    def with_converted_model(self, directory: Path) -> "Recipe":
        """This recipe run on ``directory``, the float conversion of its (GGUF) model."""
        converted = self.model_copy(update={"model": directory})
        converted._source = self.source_model
        return converted


def _line_index(node: yaml.Node, path: tuple = ()) -> dict[tuple, int]:
    """Map each key path in a YAML document to its 1-based line."""
    lines = {path: node.start_mark.line + 1}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if path + (key.value,) in lines:
                where = ".".join(str(p) for p in path + (key.value,))
                raise CompressError(f"line {key.start_mark.line + 1}: key {where!r} is given twice: keep one")
            lines[path + (key.value,)] = key.start_mark.line + 1
            lines.update({k: v for k, v in _line_index(value, path + (key.value,)).items() if k != path + (key.value,)})
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines.update(_line_index(item, path + (i,)))
    return lines


def _describe(exc: ValidationError | CompressError, loc: tuple) -> str:
    if isinstance(exc, CompressError):
        return str(exc)
    err = exc.errors()[0]
    where = ".".join(str(p) for p in loc + tuple(err["loc"]))
    if err["type"] == "extra_forbidden":
        return f"unknown key {where!r}"
    return f"{where}: {err['msg']}" if where else err["msg"]


def _valid_keys(model: type[BaseModel]) -> str:
    return ", ".join(model.model_fields)


def parse_recipe(data: Any, source: str = "recipe", lines: dict[tuple, int] | None = None) -> Recipe:
    """Validate recipe data; errors name the key, the line (from YAML) and what is allowed."""
    lines = lines or {}
    if not isinstance(data, dict):
        raise CompressError(f"{source}: a recipe is a mapping with keys {_valid_keys(Recipe)}")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        message = _describe(exc, ())
        if err["type"] == "extra_forbidden":
            owner = {(): Recipe, ("calibration",): CalibrationSpec, ("output",): OutputSpec, ("evaluation",): EvaluationSpec,
                     ("distill",): DistillSpec, ("export",): ExportSpec, ("kv_cache",): KVCacheSpec}
            model = owner.get(loc[:-1])
            if model is not None:
                message += f": valid keys are {_valid_keys(model)}"
        raise CompressError(f"{source}{_at_line(lines, loc)}: {message}") from None
    if not recipe.stages and recipe.distill is None and recipe.kv_cache is None:
        raise CompressError(f"{source}{_at_line(lines, ('stages',))}: stages: give at least one stage (or a distill or kv_cache section)")
    if recipe.kv_cache is not None:
        _check_kv_cache(recipe, source, lines)
    for index, stage in enumerate(recipe.stages):
        _check_stage(stage, index, source, lines)
    if recipe.export is not None and recipe.export.method.calibrated and recipe.calibration is None:
        where = _at_line(lines, ("export", "method"))
        raise CompressError(f"{source}{where}: export.method {recipe.export.method.value} needs calibration data: add a calibration section")
    return recipe


def _check_kv_cache(recipe: Recipe, source: str, lines: dict[tuple, int]) -> None:
    where = _at_line(lines, ("kv_cache",))
    if recipe.calibration is None:
        raise CompressError(f"{source}{where}: kv_cache calibrates its scales: add a calibration section (--calib PATH)")
    if recipe.output.format == OutputFormat.gptq:
        raise CompressError(f"{source}{where}: kv_cache scales are stored in compressed-tensors' kv_cache_scheme: use format compressed-tensors")
    if recipe.distill is not None:
        raise CompressError(f"{source}{where}: kv_cache with distill is not supported: calibrate the distilled model's KV cache in a second run")


def _check_stage(stage: StageSpec, index: int, source: str, lines: dict[tuple, int]) -> None:
    """Validate one stage's method and config; errors name the exact key and its line."""
    try:
        cls = method_class(stage.method)
    except CompressError as exc:
        raise CompressError(f"{source}{_at_line(lines, ('stages', index, 'method'))}: stage {index + 1}: {exc}") from None
    try:
        cls.Config(**stage.method_config())
    except CompressError as exc:  # a scheme the method cannot take
        raise CompressError(f"{source}{_at_line(lines, ('stages', index, 'scheme'))}: stage {index + 1}: {exc}") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        key = err["loc"][0] if err["loc"] else "method"
        message = _describe(exc, ())
        if err["type"] == "extra_forbidden":
            message += f": {stage.method} takes {', '.join(['include', 'exclude', 'plan', *cls.Config.model_fields])}"
        where = _at_line(lines, ("stages", index, key))
        raise CompressError(f"{source}{where}: stage {index + 1} ({stage.method}): {message}") from None
    if stage.plan is not None:
        try:
            check_plan_method(cls)
        except CompressError as exc:
            raise CompressError(f"{source}{_at_line(lines, ('stages', index, 'plan'))}: stage {index + 1}: {exc}") from None


def _at_line(lines: dict[tuple, int], loc: tuple) -> str:
    for end in range(len(loc), -1, -1):
        if loc[:end] in lines:
            return f":{lines[loc[:end]]}"
    return ""


MAX_RECIPE_NODES = 100_000  # a recipe is a few hundred values; aliases must not expand it exponentially


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Values in the document with every alias expanded, counted in time linear in the composed graph
    (a node reached through several aliases is counted each time, but computed once)."""
    if id(node) not in sizes:
        sizes[id(node)] = 1  # a cycle (a node aliased inside itself) counts once
        children = [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode) else (
            node.value if isinstance(node, yaml.SequenceNode) else [])
        sizes[id(node)] = min(1 + sum(_expanded_size(child, sizes) for child in children), MAX_RECIPE_NODES + 1)
    return sizes[id(node)]


def load_recipe(path: Path) -> Recipe:
    """Read and validate a YAML recipe; relative paths in it are taken from the working directory."""
    if not path.is_file():
        problem = "is a directory" if path.is_dir() else "does not exist"
        raise CompressError(f"recipe {path} {problem}: give the path of a YAML recipe file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CompressError(f"recipe {path} is not UTF-8 text: save it as UTF-8 YAML") from None
    try:
        node = yaml.compose(text)  # safe: no tags run code (python/object tags fail in safe_load below)
        if node is not None and _expanded_size(node, {}) > MAX_RECIPE_NODES:
            raise CompressError(f"{path}: its anchors and aliases expand to more than {MAX_RECIPE_NODES} values: write the recipe out plainly")
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise CompressError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    except RecursionError:
        raise CompressError(f"{path}: nested too deeply to be a recipe: write the recipe out plainly") from None
    if node is None:
        raise CompressError(f"{path} is empty: a recipe needs model, stages and output")
    try:
        lines = _line_index(node)
    except CompressError as exc:
        raise CompressError(f"{path}: {exc}") from None
    return parse_recipe(data, str(path), lines)
