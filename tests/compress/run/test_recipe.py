"""Tests for compress.run.recipe (YAML recipes → typed objects, line-numbered errors) and compress.engine.registry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from compress.engine import registry
from compress.errors import CompressError
from compress.engine.methods.base import Method, MethodConfig
from compress.engine.methods.rtn import RTN, WeightQuantConfig
from compress.run.recipe import (
    CalibrationSpec,
    Device,
    EvaluationSpec,
    OutputSpec,
    Recipe,
    StageSpec,
    load_recipe,
    parse_recipe,
)
from compress.engine.registry import method_class, method_names, register_method
from conftest import REPO

SHIPPED = sorted((REPO / "recipes").glob("*.yaml"))

VALID = """\
# a full recipe
model: models/tiny
device: cuda
calibration:
  path: calib.txt
  samples: 16
  seq_len: 64
stages:
  - method: rtn
    bits: 3
    group_size: 64
    symmetric: false
    exclude: ["mlp\\\\.down_proj"]
  - method: rtn
    include: [lm_head]
output:
  path: out/tiny-rtn
  overwrite: true
  shard_size_mb: 5
evaluation:
  text: eval.txt
  ctx: 128
"""

MINIMAL = """\
model: m
stages:
  - method: rtn
output:
  path: o
"""


def _write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _raises(fn, *args, **kwargs) -> str:
    """Call fn, require a CompressError with a one-line message, and return the message."""
    with pytest.raises(CompressError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert msg and "\n" not in msg, repr(msg)
    return msg


def _load_error(tmp_path: Path, text: str) -> tuple[Path, str]:
    path = _write(tmp_path, text)
    return path, _raises(load_recipe, path)


def _assert_at_line(msg: str, path: Path, line: int) -> None:
    assert msg.startswith(f"{path}:{line}:"), msg


# -- valid recipes ------------------------------------------------------------------------------------------


def test_valid_recipe_parses_into_typed_objects(tmp_path):
    recipe = load_recipe(_write(tmp_path, VALID))
    assert isinstance(recipe, Recipe)
    assert recipe.model == Path("models/tiny")
    assert isinstance(recipe.model, Path)
    assert recipe.device is Device.cuda
    assert recipe.trust_remote_code is False

    assert isinstance(recipe.calibration, CalibrationSpec)
    assert recipe.calibration.path == Path("calib.txt")
    assert (recipe.calibration.samples, recipe.calibration.seq_len) == (16, 64)
    assert recipe.calibration.seed == 0 and recipe.calibration.batch_size == 8  # defaults

    assert isinstance(recipe.output, OutputSpec)
    assert recipe.output.path == Path("out/tiny-rtn")
    assert recipe.output.overwrite is True
    assert recipe.output.shard_size_mb == 5

    assert isinstance(recipe.evaluation, EvaluationSpec)
    assert recipe.evaluation.text == Path("eval.txt")
    assert recipe.evaluation.ctx == 128
    assert recipe.evaluation.stride is None

    assert [type(s) for s in recipe.stages] == [StageSpec, StageSpec]
    first, second = recipe.stages
    assert first.method == "rtn"
    assert first.exclude == [r"mlp\.down_proj"]
    assert first.include == []
    assert first.method_config() == {"bits": 3, "group_size": 64, "symmetric": False}
    assert second.include == ["lm_head"]
    assert second.method_config() == {}

    methods = recipe.methods()
    assert [type(m) for m in methods] == [RTN, RTN]
    assert isinstance(methods[0].config, WeightQuantConfig)
    assert (methods[0].config.bits, methods[0].config.group_size, methods[0].config.symmetric) == (3, 64, False)
    assert (methods[1].config.bits, methods[1].config.group_size, methods[1].config.symmetric) == (4, "auto", True)  # the defaults
    assert methods[0].name == "rtn"
    assert methods[0].record() == {"method": "rtn", "bits": 3, "group_size": 64, "symmetric": False}


def test_minimal_recipe_defaults(tmp_path):
    recipe = load_recipe(_write(tmp_path, MINIMAL))
    assert recipe.device is Device.cpu
    assert recipe.calibration is None and recipe.evaluation is None
    assert recipe.output.overwrite is False
    assert recipe.output.shard_size_mb == 256


def test_parse_recipe_from_dict():
    recipe = parse_recipe(
        {"model": "m", "stages": [{"method": "rtn", "bits": 8, "group_size": -1}], "output": {"path": "o"}}
    )
    assert recipe.model == Path("m")
    (method,) = recipe.methods()
    assert isinstance(method, RTN)
    assert (method.config.bits, method.config.group_size) == (8, -1)


def test_parse_recipe_error_without_lines():
    msg = _raises(parse_recipe, {"model": "m", "stages": [{"method": "rtn"}], "output": {"path": "o"}, "x": 1}, "cli")
    assert msg.startswith("cli: ")
    assert "'x'" in msg


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_recipes_parse(path):
    recipe = load_recipe(path)
    assert recipe.stages or recipe.distill is not None  # distill-only recipes have no compression stage
    assert all(isinstance(m, Method) for m in recipe.methods())


def test_there_are_shipped_recipes():
    assert SHIPPED, "recipes/*.yaml should not be empty"
    assert any(p.name == "rtn-w4g128.yaml" for p in SHIPPED)


def test_shipped_rtn_recipe_values():
    recipe = load_recipe(REPO / "recipes" / "rtn-w4g128.yaml")
    (method,) = recipe.methods()
    assert isinstance(method, RTN)
    assert (method.config.bits, method.config.group_size, method.config.symmetric) == (4, 128, True)
    assert recipe.evaluation is not None and recipe.evaluation.ctx == 512


# -- errors with line numbers ----------------------------------------------------------------------------------


def test_unknown_top_level_key(tmp_path):
    path, msg = _load_error(tmp_path, MINIMAL + "quantise: yes\n")
    _assert_at_line(msg, path, 6)
    assert "'quantise'" in msg
    for key in ("model", "stages", "output", "calibration", "evaluation", "device", "trust_remote_code"):
        assert key in msg


@pytest.mark.parametrize(
    ("text", "line", "key", "valid"),
    [
        (MINIMAL + "  bogus: 1\n", 6, "output.bogus", ["path", "overwrite", "shard_size_mb"]),
        (
            "model: m\ncalibration:\n  path: c.txt\n  samplez: 3\nstages:\n  - method: rtn\noutput:\n  path: o\n",
            4,
            "calibration.samplez",
            ["path", "samples", "seq_len", "seed", "batch_size"],
        ),
        (
            MINIMAL + "evaluation:\n  text: e.txt\n  context: 5\n",
            8,
            "evaluation.context",
            ["text", "ctx", "stride", "batch_size", "max_tokens"],
        ),
    ],
    ids=["output", "calibration", "evaluation"],
)
def test_unknown_nested_key(tmp_path, text, line, key, valid):
    path, msg = _load_error(tmp_path, text)
    _assert_at_line(msg, path, line)
    assert key in msg
    for k in valid:
        assert k in msg


def test_unknown_stage_key(tmp_path):
    text = "model: m\nstages:\n  - method: rtn\n    bits: 4\n    grup_size: 64\noutput:\n  path: o\n"
    path, msg = _load_error(tmp_path, text)
    _assert_at_line(msg, path, 5)
    assert "grup_size" in msg
    assert "stage 1" in msg
    for key in ("include", "exclude", "bits", "group_size", "symmetric"):
        assert key in msg


def test_unknown_method(tmp_path):
    text = "model: m\nstages:\n  - method: rtn\n  - method: sparsify9000\noutput:\n  path: o\n"
    path, msg = _load_error(tmp_path, text)
    _assert_at_line(msg, path, 4)
    assert "sparsify9000" in msg
    assert "stage 2" in msg
    for name in method_names():
        assert name in msg


@pytest.mark.parametrize(("bits", "bound"), [(9, "8"), (1, "2")])
def test_bits_out_of_range(tmp_path, bits, bound):
    text = f"model: m\nstages:\n  - method: rtn\n    group_size: 64\n    bits: {bits}\noutput:\n  path: o\n"
    path, msg = _load_error(tmp_path, text)
    _assert_at_line(msg, path, 5)
    assert "bits" in msg
    assert bound in msg


def test_bits_not_an_integer(tmp_path):
    text = "model: m\nstages:\n  - method: rtn\n    bits: four\noutput:\n  path: o\n"
    path, msg = _load_error(tmp_path, text)
    _assert_at_line(msg, path, 4)
    assert "bits" in msg


def test_empty_stages(tmp_path):
    path, msg = _load_error(tmp_path, "model: m\nstages: []\noutput:\n  path: o\n")
    _assert_at_line(msg, path, 2)
    assert "stages" in msg


def test_stage_without_method(tmp_path):
    path, msg = _load_error(tmp_path, "model: m\nstages:\n  - bits: 4\noutput:\n  path: o\n")
    _assert_at_line(msg, path, 3)
    assert "method" in msg


def test_missing_required_key(tmp_path):
    path, msg = _load_error(tmp_path, "model: m\nstages:\n  - method: rtn\n")
    assert msg.startswith(f"{path}:")
    assert "output" in msg


def test_bad_device(tmp_path):
    path, msg = _load_error(tmp_path, MINIMAL + "device: tpu\n")
    _assert_at_line(msg, path, 6)
    assert "device" in msg


def test_out_of_range_nested_value(tmp_path):
    path, msg = _load_error(tmp_path, MINIMAL + "  shard_size_mb: 0\n")
    _assert_at_line(msg, path, 6)
    assert "output.shard_size_mb" in msg


@pytest.mark.parametrize("text", ["- model\n- stages\n", "just a string\n", "42\n"], ids=["list", "string", "number"])
def test_not_a_mapping(tmp_path, text):
    path, msg = _load_error(tmp_path, text)
    assert str(path) in msg
    assert "mapping" in msg


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("model: m\nstages:\n  - method: rtn\n    bits: 4\n   group_size: 3\noutput:\n  path: o\n", 5),
        ("model: m\n\tstages: 1\n", 2),
        ("model: m\nstages:\n  - method: rtn\noutput: [a, b\nfoo: 1\n", 5),
    ],
    ids=["indentation", "tab", "unclosed-flow"],
)
def test_invalid_yaml_syntax(tmp_path, text, line):
    path, msg = _load_error(tmp_path, text)
    _assert_at_line(msg, path, line)
    assert "not valid YAML" in msg


@pytest.mark.parametrize("text", ["", "# only a comment\n", "\n\n"], ids=["empty", "comment", "blank"])
def test_empty_file(tmp_path, text):
    path, msg = _load_error(tmp_path, text)
    assert str(path) in msg
    assert "empty" in msg


def test_missing_file(tmp_path):
    msg = _raises(load_recipe, tmp_path / "nope.yaml")
    assert str(tmp_path / "nope.yaml") in msg
    assert "does not exist" in msg


def test_directory_is_not_a_recipe(tmp_path):
    msg = _raises(load_recipe, tmp_path)
    assert str(tmp_path) in msg


def test_error_messages_have_file_and_line_format(tmp_path):
    path, msg = _load_error(tmp_path, MINIMAL + "foo: 1\n")
    assert re.match(rf"^{re.escape(str(path))}:\d+: ", msg)


# -- registry ---------------------------------------------------------------------------------------------------


def test_method_names_contains_rtn():
    names = method_names()
    assert "rtn" in names
    assert names == sorted(names)
    assert method_class("rtn") is RTN


def test_method_class_unknown():
    msg = _raises(method_class, "no-such-method")
    assert "no-such-method" in msg
    assert "rtn" in msg


def test_register_method_twice_raises(monkeypatch):
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))  # keep the global registry clean

    class Dummy(Method):
        Config = MethodConfig

    class Other(Method):
        Config = MethodConfig

    register_method("test-dummy")(Dummy)
    assert Dummy.name == "test-dummy"
    assert method_class("test-dummy") is Dummy
    assert "test-dummy" in method_names()
    with pytest.raises(RuntimeError, match="test-dummy"):
        register_method("test-dummy")(Other)
    assert method_class("test-dummy") is Dummy
    assert Other.name == ""


def test_register_builtin_name_again_raises(monkeypatch):
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    method_names()  # make sure built-ins are registered

    class Impostor(Method):
        Config = MethodConfig

    with pytest.raises(RuntimeError, match="rtn"):
        register_method("rtn")(Impostor)
    assert method_class("rtn") is RTN


def test_duplicate_key_is_an_error(tmp_path):
    from compress.errors import CompressError
    from compress.run.recipe import load_recipe

    path = tmp_path / "dup.yaml"
    path.write_text("model: m\nstages:\n  - method: rtn\n    bits: 4\n    bits: 8\noutput: {path: o}\n")
    with pytest.raises(CompressError, match=r"line 5: key 'stages\.0\.bits' is given twice"):
        load_recipe(path)
