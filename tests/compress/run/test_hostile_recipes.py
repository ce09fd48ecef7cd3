"""Hostile recipes: YAML tags that would run code, alias bombs, deep nesting, other encodings; one line each."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from compress.cli import app
from conftest import REFERENCE_MODEL

BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)
)  # 10^9 values once expanded, 90 in the file
CASES = {
    "python object tag": (f"model: !!python/object/apply:os.system ['touch {{marker}}']\nstages: [{{method: rtn}}]\noutput: {{path: o}}\n", "not valid YAML"),
    "billion laughs": (f"model: {REFERENCE_MODEL}\n{BOMB}stages: [{{method: rtn}}]\noutput: {{path: o}}\n", "expand to more than"),
    "deep nesting": ("model: " + "[" * 20000 + "]" * 20000 + "\n", "nested too deeply"),
}


@pytest.mark.parametrize("case", CASES)
def test_hostile_recipes_are_one_line_errors(tmp_path, case):
    text, words = CASES[case]
    marker = tmp_path / "pwned"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text.replace("{marker}", str(marker)))
    done = CliRunner().invoke(app, ["run", str(recipe)])
    assert done.exit_code == 2, done.output
    assert words in done.output and "recipe.yaml" in done.output and "Traceback" not in done.output
    assert not marker.exists()


def test_a_recipe_in_another_encoding(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes("model: caf\u00e9\n".encode("utf-16"))
    done = CliRunner().invoke(app, ["run", str(recipe)])
    assert done.exit_code == 2 and "not UTF-8" in done.output
