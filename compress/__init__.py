"""llm-compress: offline compression toolkit for large language models."""

import sys as _sys
from pathlib import Path as _Path

__version__ = "0.1.0"


def _put_checkout_root_last_on_sys_path() -> None:
    """Move this source checkout's root to the end of ``sys.path`` when Python put it in front.

    The checkout keeps our sub-packages in top-level folders (``kernels/``, ``eval/``, ``formats/`` ...), which
    pyproject installs as ``compress.*``. ``python -m ...``, ``torchrun -m ...`` and ``python -c`` put the working
    directory first on ``sys.path``, so run from the checkout's root those folders were found under their bare names
    before installed distributions of the same name: transformers 5.25 imports the ``kernels`` distribution (its new
    dependency) and got our ``kernels/`` instead, and every model failed to load ("cannot import name
    'CUDAProperties' from 'kernels'"). Last, the root still serves what only it holds (``tests``, whose functions
    the multi-process tests hand to spawned children by that name); nothing of ours is imported from it by a bare
    name. Other entries, a user's own directories among them, keep their order."""
    root = _Path(__file__).resolve().parents[1]
    if not ((root / "pyproject.toml").is_file() and (root / "kernels" / "__init__.py").is_file()):
        return  # an installed copy, not a checkout: nothing shadows anything
    ours, others = [], []
    for entry in _sys.path:
        try:
            here = _Path(entry or ".").resolve()
        except (OSError, RuntimeError):  # an unreadable entry is not ours to judge
            here = None
        (ours if here == root else others).append(entry)
    if ours:
        _sys.path[:] = others + ours[:1]


_put_checkout_root_last_on_sys_path()
