"""The documentation against the project: every relative link and anchor of README.md and docs/ resolves, the
README's quickstarts run as written (the real-model one on a truncated SmolLM2), and every command the CLI lists
has its entry in the CLI reference."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
CLI_REFERENCE = ROOT / "docs" / "cli.md"


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (links there are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, every character but letters, digits, spaces,
    hyphens and underscores removed, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of ``path``'s headings, repeated ones numbered as GitHub numbers them (-1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for _, heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_slug_follows_github():
    assert slug("Speed beside llm-compressor") == "speed-beside-llm-compressor"
    assert slug("GGUF i-quants beside llama.cpp") == "gguf-i-quants-beside-llamacpp"
    assert slug("Float schemes (FP8, NVFP4, MXFP4)") == "float-schemes-fp8-nvfp4-mxfp4"
    assert slug("`compress eval ppl`") == "compress-eval-ppl"


GUIDES = ("quantize", "gguf", "allocation", "prune-distill", "evaluate", "scale-out", "integrity", "formats", "kernels",
          "architecture", "cli", "results")


def test_readme_is_short_and_links_every_guide():
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") <= 250
    assert not [g for g in GUIDES if f"](docs/{g}.md" not in readme and f"](docs/{g}.md#" not in readme]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(doc):
    broken = []
    for target in LINK.findall(_prose(doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not ours to check offline
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.name}")
    assert not broken, "\n".join(broken)


def test_no_history_in_code_or_docs():
    """Comments, docstrings and guides say what is: which stop of the work made it so belongs in the notes."""
    pattern = re.compile(r"\bstop [0-9]+", re.I)
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted(ROOT.rglob("*"))
        if path.suffix in {".py", ".md"} and not {".venv", ".git", "out"} & set(path.relative_to(ROOT).parts)
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found


# -- the README's quickstarts, run as written ------------------------------------------------------------
def _section_block(heading: str) -> str:
    """The first fenced bash block under the README heading that starts with ``heading``."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {heading}")
    match = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert match, f"no bash block under {heading}"
    return match.group(1)


def _lines(block: str) -> list[str]:
    """The block's command lines, continuation lines joined."""
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip() and not line.startswith("#")]


# The quickstarts' texts, cut to their first characters in the test's copy of eval/assets/: each command reads the
# file it names, with the options it gives, but calibrates on three windows of 512 tokens (the reference model's
# tokenizer and SmolLM2's alike; fewer than --samples asks for, which the run says and takes) and evaluates two
# windows, not 64 (or 32) and 40. What the test checks, that each command runs and writes what the next reads,
# does not depend on how many windows there are; the time does.
QUICKSTART_TEXTS = {"shakespeare-calib-slice.txt": 6000, "shakespeare-test-slice.txt": 4000}


def _workdir(tmp_path: Path) -> Path:
    """A folder laid out as the checkout's root for the commands (they name eval/ and recipes/ relatively), whose
    out/ is the test's own and whose eval/assets/ texts are cut short (QUICKSTART_TEXTS)."""
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    assets = tmp_path / "eval" / "assets"
    assets.mkdir(parents=True)
    for entry in (ROOT / "eval").iterdir():
        if entry.name != "assets":
            (tmp_path / "eval" / entry.name).symlink_to(entry)
    for entry in (ROOT / "eval" / "assets").iterdir():
        if entry.name in QUICKSTART_TEXTS:
            (assets / entry.name).write_text(entry.read_text(encoding="utf-8")[: QUICKSTART_TEXTS[entry.name]],
                                             encoding="utf-8")
        else:
            (assets / entry.name).symlink_to(entry)
    return tmp_path


def _run(script: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_reference_quickstart_runs_as_written(tmp_path):
    lines = _lines(_section_block("Quickstart: the shipped reference model"))
    assert lines and all(line.startswith("compress ") for line in lines), lines
    work = _workdir(tmp_path)
    for line in lines:
        _run(line, work, timeout=600)
    assert (work / "out" / "ref-gptq-w3" / "manifest.json").is_file()


@pytest.mark.smollm2
def test_real_model_quickstart_runs_on_truncated_smollm2(smollm2_2, tmp_path):
    """The real-model quickstart, every line as written, but for its conversion of the whole model: a copy of its
    first two blocks (the conversion itself is what the ``smollm2`` fixture runs) stands at out/smollm2."""
    lines = _lines(_section_block("Quickstart: a real model"))
    convert = [i for i, line in enumerate(lines) if line.startswith("compress convert ")]
    assert len(convert) == 1 and lines[0].startswith("SMOLLM2="), lines
    work = _workdir(tmp_path)
    shutil.copytree(smollm2_2, work / "out" / "smollm2")
    lines[convert[0]] = 'test -f "$SMOLLM2"'  # the shipped file the conversion reads is where the README says
    done = _run("\n".join(lines), work, timeout=900)
    assert (work / "out" / "smollm2-q4_k_m.gguf").is_file() and (work / "out" / "smollm2-report" / "report.md").is_file()
    assert "group size auto chose 64" in done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("The king")  # transformers generated from our W4A16 output


# -- the CLI reference covers the CLI --------------------------------------------------------------------
def _commands(group) -> list[str]:
    """Every command path under a (Typer's) Click group, e.g. 'quantize', 'eval ppl'."""
    names = []
    for name, command in sorted(group.commands.items()):
        if hasattr(command, "commands"):  # a group: Typer carries its own copy of Click's classes
            names += [f"{name} {sub}" for sub in _commands(command)]
        else:
            names.append(name)
    return names


def test_every_command_is_in_the_cli_reference():
    import typer

    from compress.cli.app import app

    commands = _commands(typer.main.get_command(app))
    assert {"quantize", "export", "eval ppl", "verify"} <= set(commands), commands
    reference = CLI_REFERENCE.read_text()
    missing = [c for c in commands if not re.search(rf"^#+ .*compress {re.escape(c)}\b", reference, re.M)]
    assert not missing, f"commands without a heading in {CLI_REFERENCE.name}: {missing}"


def test_export_help_names_every_gguf_architecture():
    from compress.cli import export
    from compress.export.gguf_arch import ARCHITECTURES

    summary = export.export_command.__doc__
    assert all(re.search(rf"\b{re.escape(kind)}\b", summary) for kind in ARCHITECTURES), summary


def test_version_prints_the_package_version():
    from compress import __version__

    compress = shutil.which("compress", path=str(Path(sys.executable).parent)) or "compress"
    done = subprocess.run([compress, "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"llm-compress {__version__}", done
