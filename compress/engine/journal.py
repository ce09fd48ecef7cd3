"""A run's progress, recorded block by block in its temporary output directory, so that a killed run resumes.

After each finished and written block the engine hands `BlockJournal.block_done` what the next block needs (it
records it unless that would take more than `RECORD_SHARE` of the run's time):
the calibration inputs (hidden states and the block's other arguments), the per-layer reports so far, the
layers written packed (for the format's config) and what the methods and the block observer learned over
the blocks (``learned_state``: e.g. static input scales, KV-cache maxima). They go to ``.progress/``::

    progress.json       {"block": 3, "fingerprint": {...}, "writer": {ShardedWriter.state()}, "state": "state-3.pt"}
    state-3.pt          torch.save of the reports, packed layers, learned state and the inputs' batch count
    inputs-3/0-0.pt ... torch.save of each calibration batch's inputs, ``RANK-BATCH.pt`` (one at a time: the run's
                        ``--activation-memory`` budget holds while they are written and read back)
    inputs-3/reference-0-0.pt ...  with asymmetric calibration, the uncompressed model's inputs of each batch

``inputs-N/`` (written as ``inputs-N.partial/`` and renamed) and ``state-N.pt`` are written first, then
``progress.json`` is replaced atomically, then the previous block's files are removed, so a kill at any point
leaves a record that names complete files. Under a launcher every process writes its own share of the inputs
into the main process's directory (one machine, or a shared file system), and the main process writes the record
once all have; a resumed run needs the same number of processes (it is in the fingerprint). After the last block
no inputs are kept: nothing runs on them. The fingerprint is the run's settings, the model's file digests and the
calibration tokens' digest: a resumed run with another one is refused, naming the first difference. `restore` puts the engine, its methods and the writer back where
the record was taken; the engine then continues with the next block and ends with the same bytes as a run
never interrupted (the inputs are restored bit for bit, and a block's work depends only on them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch

from compress.checkpoints.output import PROGRESS, PROGRESS_RECORD
from compress.errors import CompressError
from compress.formats.base import PackedLayer
from compress.engine.methods.base import LayerReport
from compress.quantizers.float_grid import FloatFormat, FloatGrid, FloatScheme
from compress.quantizers.grid import QuantScheme

log = logging.getLogger(__name__)

RECORD_VERSION = 3  # 2: inputs in a folder of per-batch files; 3: per process
# the most of a run's time its progress records may take (see `BlockJournal.block_done`): 2 %, so a record follows
# at least 50x its write time of work (GPTQ on SmolLM2's first 8 blocks: 2 s blocks and 50 ms records, so a record
# every few blocks rather than 0.44 s of a 16 s run on a record after every block)
RECORD_SHARE = 0.02
# the only classes a state file may hold besides tensors and containers (torch.load weights_only)
SAFE_CLASSES = [PackedLayer, QuantScheme, FloatScheme, FloatFormat, FloatGrid, LayerReport]


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flatten(item, f"{prefix}.{key}" if prefix else str(key)).items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in _flatten(item, f"{prefix}[{i}]").items()} or {prefix: []}
    return {prefix: value}


def fingerprint(settings: dict[str, Any], model: dict[str, Any], calibration: torch.Tensor | None) -> dict[str, Any]:
    """What a resumed run must share with the killed one: ``settings`` (JSON), the model's file digests
    (`compress.checkpoints.integrity.input_digests`) and the calibration tokens."""
    tokens = None
    if calibration is not None:
        tokens = hashlib.sha256(calibration.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
        tokens = f"{tuple(calibration.shape)} sha256 {tokens}"
    return {"settings": _flatten(settings), "model": model["sha256"], "calibration": tokens}


def _difference(recorded: dict[str, Any], current: dict[str, Any]) -> str | None:
    """The first difference between two fingerprints, in words (None: the same)."""
    old, new = recorded.get("settings", {}), current["settings"]
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            return f"setting {key} was {json.dumps(old.get(key))}, now {json.dumps(new.get(key))}"
    old_files, new_files = recorded.get("model", {}), current["model"]
    for name in sorted(set(old_files) | set(new_files)):
        if old_files.get(name) != new_files.get(name):
            return f"model file {name} changed (SHA-256 {str(old_files.get(name))[:12]} → {str(new_files.get(name))[:12]})"
    if recorded.get("calibration") != current["calibration"]:
        return f"the calibration tokens changed ({recorded.get('calibration')} → {current['calibration']})"
    return None


def read_record(directory: Path) -> dict[str, Any]:
    path = directory / PROGRESS / PROGRESS_RECORD
    try:
        record = json.loads(path.read_text())
        if record.get("version") != RECORD_VERSION:
            raise ValueError(f"version {record.get('version')}")
        return record
    except (OSError, ValueError, AttributeError) as exc:
        raise CompressError(f"--resume: {path} is unreadable ({type(exc).__name__}): remove {directory} and run without --resume") from None


def check_resumable(directory: Path, current: dict[str, Any]) -> None:
    """Refuse to continue the run in ``directory`` if its fingerprint differs from ``current``."""
    difference = _difference(read_record(directory).get("fingerprint", {}), current)
    if difference is not None:
        raise CompressError(
            f"--resume: the interrupted run in {directory} differs: {difference}; resume with its settings, "
            f"or remove it (rm -rf {directory}) and run without --resume"
        )


def _learners(engine) -> list:
    """The objects whose ``learned_state`` attributes outlive a block: each stage's method instances, the observer."""
    found = [method for stage in engine.stages for method in stage.methods()]
    return found + ([engine.observer] if engine.observer is not None else [])


class BlockJournal:
    """The progress record of a run writing into ``directory`` (its temporary output directory)."""

    def __init__(self, directory: Path, current: Callable[[], dict[str, Any]], ready: Callable[[], bool] = lambda: True):
        """``current``: the run's `fingerprint`, computed on first use (a fresh run needs it only for its first record);
        ``ready``: whether ``current`` returns without waiting (the model's digests are hashed on a thread)."""
        self.root = directory / PROGRESS
        self._current = current
        self._ready = ready
        self._cost = 0.0  # seconds the last record took to write (none yet: the first record is due once `ready`)
        self._since = time.perf_counter()  # when the last record was finished

    @property
    def fingerprint(self) -> dict[str, Any]:
        return self._current()

    def restore(self, engine, writer) -> tuple[int, list, list[LayerReport]] | None:
        """(first unfinished block, its calibration inputs, the reports so far) from the record, with the
        engine's packed layers, learned state and ``writer`` put back; None without a record (a fresh run)."""
        rank = engine.ranks.rank
        if not (self.root / PROGRESS_RECORD).is_file():  # written only once every process has its part
            if engine.ranks.main:
                self.root.mkdir(exist_ok=True)
            return None
        record = read_record(self.root.parent)
        check_resumable(self.root.parent, self.fingerprint)
        try:
            with torch.serialization.safe_globals(SAFE_CLASSES):
                state = torch.load(self.root / record["state"], map_location=engine.device, weights_only=True)
                inputs, reference = engine.new_activations(), engine.new_activations()
                for batch in range(state["batches"][rank]):
                    inputs.append(*torch.load(self.root / state["inputs"] / f"{rank}-{batch}.pt", map_location=engine.device, weights_only=True))
                for batch in range(state["reference_batches"][rank]):
                    reference.append(*torch.load(self.root / state["inputs"] / f"reference-{rank}-{batch}.pt", map_location=engine.device,
                                                 weights_only=True))
        except Exception as exc:  # noqa: BLE001 - unpickling fails in many types; the record is then useless
            raise CompressError(
                f"--resume: {self.root / record['state']} is unreadable ({type(exc).__name__}): remove {self.root.parent} and run without --resume"
            ) from None
        if engine.ranks.main:
            writer.restore(record["writer"])
        if engine.needs_reference:
            engine.start_reference(reference)
        engine.packed.update(state["packed"])
        for learner, learned in zip(_learners(engine), state["learned"]):
            for name, value in learned.items():
                setattr(learner, name, value)
        log.info("resuming after block %d of %d", record["block"] + 1, len(engine.handle.blocks))
        return record["block"] + 1, inputs, state["layers"]

    def block_done(self, index: int, engine, writer, inputs: list, layers: list[LayerReport]) -> None:
        """Record that blocks up to ``index`` are written; ``inputs`` are the next block's (this process's share).

        Skipped while the records would cost more than `RECORD_SHARE` of the run's time: the work since the last
        record took less than its write time / `RECORD_SHARE` (short blocks on many calibration windows, where
        writing the activations costs a sizeable part of a block). A kill then loses at most that much work more,
        and the resumed run still ends with the same bytes (it continues from the last record). The last block is
        always recorded, the first once the run's fingerprint is ready: hashing an 8B model's 16 GB takes longer than
        its first blocks of RTN, which would otherwise wait for it (a kill before then resumes nothing). The main
        process decides for all."""
        ranks = engine.ranks
        last = index + 1 == len(engine.handle.blocks)  # after the last block nothing runs on the inputs
        due = last or self._ready() and time.perf_counter() - self._since >= self._cost / RECORD_SHARE
        if not ranks.broadcast_object(due):
            return
        start = time.perf_counter()
        self._record(index, engine, writer, inputs, layers, last)
        self._since = time.perf_counter()
        self._cost = self._since - start

    def _record(self, index: int, engine, writer, inputs: list, layers: list[LayerReport], last: bool) -> None:
        ranks = engine.ranks
        name, folder = f"state-{index}.pt", f"inputs-{index}"
        kept = [] if last else inputs
        reference = [] if last or engine.reference is None else engine.reference.inputs
        partial = self.root / f"{folder}.partial"
        if ranks.main:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
        ranks.barrier()  # the folder exists for every process's files
        for batch, entry in enumerate(kept):
            torch.save(entry, partial / f"{ranks.rank}-{batch}.pt")
        for batch, entry in enumerate(reference):
            torch.save(entry, partial / f"reference-{ranks.rank}-{batch}.pt")
        counts = ranks.gather((len(kept), len(reference)))  # also: every process's files are complete
        if not ranks.main:
            return
        os.replace(partial, self.root / folder)
        learned = [{name: getattr(obj, name) for name in getattr(obj, "learned_state", ()) if hasattr(obj, name)} for obj in _learners(engine)]
        partial = self.root / f"{name}.partial"
        torch.save({"inputs": folder, "batches": [c[0] for c in counts], "reference_batches": [c[1] for c in counts], "layers": layers,
                    "packed": dict(engine.packed), "learned": learned}, partial)
        os.replace(partial, self.root / name)
        record = {"version": RECORD_VERSION, "block": index, "blocks": len(engine.handle.blocks), "state": name,
                  "writer": writer.state(), "fingerprint": self.fingerprint}
        partial = self.root / f"{PROGRESS_RECORD}.partial"
        partial.write_text(json.dumps(record) + "\n")
        os.replace(partial, self.root / PROGRESS_RECORD)
        for old in [*self.root.glob("state-*.pt"), *self.root.glob("inputs-*")]:
            if old.name not in (name, folder):
                shutil.rmtree(old) if old.is_dir() else old.unlink()

    def remove(self) -> None:
        """The run's blocks are all written: the record goes (it must not be part of the output)."""
        shutil.rmtree(self.root, ignore_errors=True)
