"""The output directory: written under a temporary name and renamed only when complete.

A failed or interrupted run leaves no half-written output, an existing output is replaced only with
``overwrite`` and only once the new one is complete, and the input checkpoint is never touched.

- One writer per output path: `OutputLock` holds ``.<name>.lock`` beside it (``flock``) while the output
  is written, so a second run writing the same path is a one-line error; the kernel releases the lock of
  a killed run. The lock holder also reports the temporary files a killed run left (``.<name>.partial-PID``
  and the like), with the command that removes them.
- A full disk (``ENOSPC``, quota, a file too large, a read-only filesystem) is a one-line error; the
  temporary directory is removed.
- A killed run's temporary directory holding a progress record (``.progress/``) is continued by a run
  with ``resume`` (``--resume``): checked, then renamed to that run's own; without it, it is reported with
  both commands (resume or remove) and never reused.
- Once the output is complete, the temporary files that dead runs left beside it are removed (the output
  supersedes them; a killed 70B run's is tens of GB), and one log line says which.
- The finished directory carries ``manifest.json``, the SHA-256 of every file and tensor
  (`compress.checkpoints.integrity`), which ``compress verify`` checks.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shlex
import shutil
from pathlib import Path
from typing import Any, Callable

from compress.checkpoints.integrity import MANIFEST, input_digests, write_manifest
from compress.errors import CompressError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock, the temporary names still differ per process
    fcntl = None

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
LAYER_REPORT = "compression_report.json"
NOT_COPIED = {"config.json", "README.md", "model.safetensors.index.json", "pytorch_model.bin.index.json", LAYER_REPORT, MANIFEST}
DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
TEMPORARY_MARKERS = ("partial", "old", "tmp", "awq")  # .<name>.<marker>-<pid>[-...]: what writers leave when killed
PROGRESS = ".progress"  # in a temporary output directory: what a resumed run continues from (`compress.engine.journal`)
PROGRESS_RECORD = "progress.json"


def resumable(path: Path) -> bool:
    """``path`` is the temporary directory of a killed run that recorded its progress (``--resume`` continues it)."""
    return (path / PROGRESS / PROGRESS_RECORD).is_file()


def report_stale(paths: list[Path]) -> None:
    """Log each temporary file of a killed run with the command that removes it (and, if it can be, resumed)."""
    for path in paths:
        resume = "continue it with the same command and --resume, or " if resumable(path) else ""
        log.warning("%s was left by an interrupted run and is not used; %sremove it with: rm -rf %s", path, resume, shlex.quote(str(path)))


def _writer_alive(path: Path, final: Path) -> bool:
    """The run that named ``path`` (``.<final>.<marker>-<pid>...``) is a live process other than this one."""
    pid = path.name[len(f".{final.name}."):].partition("-")[2].split("-")[0].split(".")[0]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_superseded(paths: list[Path], final: Path) -> list[Path]:
    """Remove the temporary files and folders that dead runs left beside ``final``, now complete (the caller holds
    its lock, so no live run writes them); logs one line naming them. Returns what was removed."""
    removed = []
    for path in paths:
        if path.exists() and not _writer_alive(path, final):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        log.warning("removed %d left by interrupted runs of %s, superseded by this one: %s",
                    len(removed), final, ", ".join(p.name for p in removed))
    return removed


def disk_error(final: Path, exc: BaseException) -> CompressError | None:
    """A one-line error for an ``OSError`` of a full or read-only disk while writing ``final`` (None for others)."""
    if not isinstance(exc, OSError) or exc.errno not in DISK_ERRORS:
        return None
    return CompressError(
        f"cannot write {final}: {os.strerror(exc.errno)} ({exc.filename or final.parent}); nothing was written: "
        "free space on that disk or choose another output path"
    )


class OutputLock:
    """``.<name>.lock`` beside ``final``, locked (``flock``) by the one run writing ``final``.

    Opened, locked without waiting, then checked to be still the file at that path (a holder that just
    finished removes it: the lock taken on the removed file would protect nothing, so it is taken again).
    """

    def __init__(self, final: Path):
        self.final = final
        self.path = final.parent / f".{final.name}.lock"
        self._fd: int | None = None

    def acquire(self, report: bool = True) -> list[Path]:
        """Take the lock or raise; returns the temporary files that killed runs left beside ``final`` (logged
        unless not ``report``)."""
        if fcntl is None:
            return []
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip()
                os.close(fd)
                raise CompressError(
                    f"another run{f' (pid {holder})' if holder.isdigit() else ''} is writing {self.final}: "
                    "wait for it to finish, or choose another output path"
                ) from None
            try:
                current = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self.stale_files(report)

    def stale_files(self, report: bool = True) -> list[Path]:
        """Temporary files and folders of earlier writers of ``final``: stale, since this run holds the lock."""
        found = []
        for marker in TEMPORARY_MARKERS:
            prefix = f".{self.final.name}.{marker}-"
            found += [p for p in self.final.parent.glob(prefix + "*") if p.name[len(prefix):].split("-")[0] != str(os.getpid())]
        if report:
            report_stale(sorted(found))
        return sorted(found)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # removed while still locked: see the class docstring
        finally:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - at interpreter exit os may be gone; the kernel drops the lock anyway
            pass


def check_outside_input(output: Path, model: Path) -> None:
    """The output is neither the input model nor inside it (a symlink to either counts as it): the input
    is never touched."""
    out, src = output.resolve(), model.resolve()
    if out == src:
        raise CompressError(f"output {output} is the input model: choose another output directory")
    if src in out.parents:
        raise CompressError(f"output {output} is inside the input model {model}: choose a path outside it")


class OutputDir:
    """``with OutputDir(path, overwrite) as tmp:`` write into ``tmp``; renamed to ``path`` on success, with
    its manifest. The output path is locked while inside the block (`OutputLock`).

    ``resume``: a callable checking a killed run's temporary directory (raising `CompressError` if it may not
    be continued); the one whose progress record (`resumable`) is the latest is checked, then renamed to this
    run's ``tmp`` and kept, and ``resumed`` is True. None there is an error; a refused one is left as it was."""

    def __init__(self, final: Path, overwrite: bool = False, protect: Path | None = None, resume: Callable[[Path], Any] | None = None):
        self.final = final
        self.overwrite = overwrite
        self.resume = resume
        self.resumed = False
        if protect is not None:
            check_outside_input(final, protect)
        self._check_final()
        self.tmp = final.parent / f".{final.name}.partial-{os.getpid()}"
        self.lock = OutputLock(final)
        self.stale: list[Path] = []  # temporary files of killed runs found beside the output (removed on success)

    def _check_final(self) -> None:
        if self.final.exists() and not self.overwrite:
            raise CompressError(f"output {self.final} already exists: pass --overwrite or choose another directory")
        if self.final.exists() and not self.final.is_dir():
            raise CompressError(f"output {self.final} is a file: choose a directory path")

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.stale = self.lock.acquire(report=self.resume is None)
        try:
            self._check_final()  # again, under the lock: another run may have finished meanwhile
            shutil.rmtree(self.tmp, ignore_errors=True)
            if self.resume is not None:
                self._adopt()
            else:
                self.tmp.mkdir()
        except BaseException:  # a signal too: __exit__ is not called when __enter__ fails
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.lock.release()
            raise
        return self.tmp

    def _adopt(self) -> None:
        """Continue the killed run that recorded the most progress: check it, then take its directory."""
        candidates = [p for p in self.stale if p.name.startswith(f".{self.final.name}.partial-") and resumable(p)]
        if not candidates:
            report_stale(self.stale)
            raise CompressError(
                f"--resume: no interrupted run of {self.final} to continue (no .{self.final.name}.partial-* with a progress record "
                "beside it): run without --resume"
            )
        chosen = max(candidates, key=lambda p: (p / PROGRESS / PROGRESS_RECORD).stat().st_mtime)
        report_stale([p for p in self.stale if p != chosen])
        self.resume(chosen)
        os.replace(chosen, self.tmp)
        self.stale.remove(chosen)
        self.resumed = True
        log.info("resuming the interrupted run in %s", chosen)

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                error = disk_error(self.final, exc)
                if error is not None:
                    raise error from None
                return
            try:
                write_manifest(self.tmp)
            except OSError as failed:
                shutil.rmtree(self.tmp, ignore_errors=True)
                raise disk_error(self.final, failed) or failed
            old = None
            if self.final.exists():
                old = self.final.parent / f".{self.final.name}.old-{os.getpid()}"
                os.replace(self.final, old)
            os.replace(self.tmp, self.final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            remove_superseded(self.stale, self.final)
        finally:
            self.lock.release()


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer, generation config and other small non-weight files of the checkpoint."""
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in NOT_COPIED and not f.name.endswith(WEIGHT_SUFFIXES) and not f.name.startswith("."):
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


def write_config(src: Path, dst: Path, record: dict[str, Any]) -> None:
    """The input's config.json plus a ``compression`` entry describing what was done."""
    config = json.loads((src / "config.json").read_text())
    history = config.get("compression", {}).get("history", [])
    if "compression" in config:
        history = history + [{k: v for k, v in config["compression"].items() if k != "history"}]
    config["compression"] = {**record, "history": history} if history else record
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def run_inputs(model: Path, **texts: Path | None) -> dict[str, dict]:
    """The SHA-256 of a run's inputs by role: the model's files (top level of its folder) and each text
    given (``calibration=``, ``evaluation=``, ``training=``: a file, or every file of a folder), for its
    record: an output can be traced back to exactly what made it."""
    inputs = {}
    for role, path in {"model": model, **texts}.items():
        if path is None:
            continue
        if not Path(path).exists():
            raise CompressError(f"{role} input {path} does not exist: give an existing path")
        inputs[role] = input_digests(path, recursive=role != "model")
    return inputs


def write_layer_report(dst: Path, layers: list) -> None:
    """Per-layer figures (shape, the method's error statistics) saved beside the weights. The seconds each
    layer took are printed and returned, not saved: the output's bytes do not depend on the clock."""
    from dataclasses import asdict

    rows = [{k: v for k, v in asdict(r).items() if k != "seconds"} for r in layers]
    (dst / LAYER_REPORT).write_text(json.dumps({"layers": rows}, indent=1) + "\n")


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write_model_card(dst: Path, title: str, record: dict[str, Any], figures: dict[str, Any] | None = None) -> None:
    """The output's README.md: source, stages and settings, calibration, figures, the command."""
    stages = record.get("stages", [])
    lines = [
        f"# {title}",
        "",
        f"Compressed with llm-compress {record.get('tool_version', '')} from `{record.get('source_model', '')}`.",
        "",
        "| stage | method | settings |",
        "| --- | --- | --- |",
    ]
    for i, stage in enumerate(stages, 1):
        settings = ", ".join(f"{k}={v}" for k, v in stage.items() if k != "method")
        lines.append(f"| {i} | {stage.get('method', '')} | {settings} |")
    if record.get("calibration"):
        cal = record["calibration"]
        lines += ["", f"Calibration: {cal.get('samples')} samples × {cal.get('seq_len')} tokens from `{cal.get('path')}` (seed {cal.get('seed')})."]
    weights = sum(f.stat().st_size for f in dst.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))
    figures = {**(figures or {}), **({"weights on disk": f"{weights / 1e6:.2f} MB"} if weights else {})}
    if figures:
        lines += ["", "| figure | value |", "| --- | --- |"]
        lines += [f"| {k} | {v} |" for k, v in figures.items()]
    if record.get("command"):
        lines += ["", "Reproduce with:", "", "```", record["command"], "```"]
    if record.get("inputs"):  # what the record in config.json (``compression.inputs``) holds
        lines += ["", "Inputs (SHA-256):", "", "| input | file | SHA-256 |", "| --- | --- | --- |"]
        for role, given in record["inputs"].items():
            lines += [f"| {role} `{given['path']}` | {name} | `{digest}` |" for name, digest in given["sha256"].items()]
    lines += ["", f"`{MANIFEST}` lists the SHA-256 of every file and tensor here; check them with `compress verify {title}`."]
    if record.get("source_model"):  # the final path is the card's folder name beside the temporary one
        lines += [
            "", "Compare with other outputs of the same model (perplexity, KLD, size, bits per weight; one protocol):", "",
            "```", f"compress report {title} ... --baseline {record['source_model']} --text EVAL.txt", "```",
        ]
    if record.get("format") == "dense":
        lines += [
            "",
            "The weights are stored dense, in the checkpoint's original floating-point dtype, so any",
            "transformers-compatible loader reads them: quantized weights lie exactly on the recorded integer",
            "grid (fake-quantized), pruned weights are exact zeros.",
        ]
    elif record.get("format"):
        lines += [
            "",
            f"Quantized layers are stored packed in the {record['format']} layout described by `quantization_config`",
            "in config.json (other layers dense); `compress eval` and `compress inspect` read it directly.",
        ]
    lines.append("")
    (dst / "README.md").write_text("\n".join(lines))
