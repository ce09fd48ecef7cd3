"""`compress/__init__`: run from the checkout's root, our top-level source folders do not shadow installed
distributions of the same name (transformers 5.25 imports the ``kernels`` distribution; our ``kernels/`` folder,
installed as ``compress.kernels``, was found first and every model failed to load)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ["kernels", "eval", "formats", "quantizers", "pruners", "distill", "recipes"]
FIND = "import importlib.util as u; print(*[str(getattr(u.find_spec(n), 'origin', None)) for n in {names!r}])"


def found_from_root(code: str) -> list[str]:
    """What ``python -c code`` prints, run with the checkout's root as the working directory (first on sys.path)."""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def installed_elsewhere() -> list[str]:
    """Our folder names that an installed distribution also provides (from here, the root is not first)."""
    return [n for n in FOLDERS if (s := importlib.util.find_spec(n)) is not None and Path(str(s.origin)).parent != REPO / n]


def test_the_folders_shadow_without_the_package():
    """The hazard is real: with nothing imported, the working directory's folders win (the test below can fail)."""
    origins = found_from_root(FIND.format(names=FOLDERS))
    assert all(Path(o).parent.parent == REPO for o in origins), origins


def test_after_importing_compress_installed_distributions_win():
    names = installed_elsewhere()
    if not names:
        pytest.skip("no installed distribution shares a name with our folders here (transformers >= 5.25 brings `kernels`)")
    for name, origin in zip(names, found_from_root("import compress; " + FIND.format(names=names))):
        assert Path(origin).parent != REPO / name, f"{name} still resolves to the checkout's {origin}"


def test_the_root_still_serves_what_only_it_holds_and_other_entries_keep_their_order():
    code = ("import sys; sys.path.insert(1, '/first-entry'); sys.path.append('/last-entry'); import compress, "
            "compress.kernels.dispatch, compress.formats.gguf.codecs, tests.conftest; "
            "print(compress.kernels.__file__, sys.path.index('/first-entry') < sys.path.index('/last-entry'))")
    kernels_file, order_kept = found_from_root(code)
    assert Path(kernels_file) == REPO / "kernels" / "__init__.py"
    assert order_kept == "True"
