"""Our imatrix files and importance-weighted GGUF export, checked against llama.cpp's own tools.

    python bench/gguf_imatrix_check.py [--model eval/assets/reference-llama] [--types q4_k q3_k q2_k]
        [--calib eval/assets/shakespeare-calib-slice.txt] [--samples N] [--seq-len 512] [--workdir DIR]

The model's weight matrices are first rounded to float16 (a copy, `f16_rounded_copy`) so that the F16 GGUF our
exporter writes for llama.cpp's tools holds exactly the values our exporter reads; then
(b) importance: ``compress imatrix`` and ``llama-imatrix`` (on that F16 file) collect an imatrix from the
    same text, by default every whole ``seq-len`` window of it, so both see the same tokens (llama-imatrix
    takes the first N windows in order, ours N random ones: only with all windows are they the same set).
    Per entry: token counts, Pearson correlation and relative difference of the importance
    ``in_sum2 / counts``. A gap here is HF float32 vs llama.cpp F16 arithmetic, or different tokenization.
(a) bytes: for each type and each of the two imatrix files, ``llama-quantize --pure --imatrix FILE`` (every
    matrix in the type, as our plain ``--type`` does) and ``compress export --method imatrix --imatrix FILE``
    must write the same bytes for every tensor (gguf-py, tensor by tensor). llama-quantize uses the imatrix
    only for tensors with an entry (not token_embd, nor output without --process-output); ours likewise.
Exits 1 when a tensor differs, an imatrix entry is missing on one side, or llama-quantize skips an entry.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from llama_cpp_tools import llama_imatrix, llama_quantize

from compress.export.gguf import ExportConfig, export_gguf
from compress.formats.gguf.imatrix import Imatrix, read_imatrix
from compress.formats.gguf.plan import FILE_TYPE, Target

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "eval" / "assets"
TYPES = ["q4_k", "q3_k", "q2_k"]


class Rejected(RuntimeError):
    """Our CLI refused the request (exit status 2: a user error, e.g. a method not implemented yet)."""


# -- our side ----------------------------------------------------------------------------------------------
def compress_cli(*args: object) -> dict:
    """Run ``compress ARGS --json`` in a subprocess (the code path users take); its JSON result."""
    done = subprocess.run([sys.executable, "-m", "compress.cli", *map(str, args), "--json"],
                          capture_output=True, text=True)
    if done.returncode == 2:
        raise Rejected((done.stdout + done.stderr).strip().splitlines()[-1])
    if done.returncode != 0:
        raise RuntimeError(f"compress {' '.join(map(str, args))} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def export_f16(model: Path, path: Path) -> Path:
    export_gguf(ExportConfig(model, path, Target.f16, overwrite=True))
    return path


def ours_imatrix(model: Path, calib: Path, out: Path, samples: int, seq_len: int) -> Path:
    compress_cli("imatrix", model, "--calib", calib, "-o", out, "--samples", samples, "--seq-len", seq_len, "--overwrite")
    return out


def ours_export(model: Path, out: Path, kind: str, method: str = "rtn", *options: object) -> dict:
    """``compress export MODEL --type KIND --method METHOD OPTIONS``, e.g. ``--imatrix FILE`` or
    ``--calib TEXT --samples N --seq-len L``."""
    return compress_cli("export", model, "--format", "gguf", "--type", kind, "--method", method, *options,
                        "-o", out, "--overwrite")


def f16_rounded_copy(model: Path, dst: Path) -> Path:
    """A copy of the checkpoint with every weight matrix rounded to float16 (dtype kept; 1-D tensors stay
    as they are, as the F16 GGUF stores them in F32). llama.cpp's tools read our F16 GGUF while our
    exporter reads the checkpoint: from this copy both see the same values."""
    import shutil

    from safetensors.torch import load_file, save_file

    files = sorted(model.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{model} has no .safetensors files to round")
    dst.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.suffix == ".safetensors":
            tensors = {k: v.half().to(v.dtype) if v.is_floating_point() and v.dim() > 1 else v
                       for k, v in load_file(f).items()}
            save_file(tensors, dst / f.name, metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy2(f, dst / f.name)
    return dst


def calibration_windows(model: Path, text: Path, seq_len: int) -> int:
    """How many disjoint ``seq_len``-token windows the text gives (our calibration sampler's limit)."""
    from compress.checkpoints.calibration import load_calibration_text
    from compress.checkpoints.loading import load_tokenizer

    ids = load_tokenizer(model)(load_calibration_text(text), add_special_tokens=False, verbose=False)["input_ids"]
    return len(ids) // seq_len


# -- comparisons -----------------------------------------------------------------------------------------
def tensor_bytes(path: Path) -> dict[str, tuple[str, bytes]]:
    from gguf import GGUFReader

    return {t.name: (t.tensor_type.name, np.array(t.data).tobytes()) for t in GGUFReader(str(path)).tensors}


def differing_tensors(theirs: Path, ours: Path) -> list[str]:
    """Names of tensors whose type or bytes differ (or that only one file has), with a short reason."""
    a, b = tensor_bytes(theirs), tensor_bytes(ours)
    out = [f"{n} (only in {theirs.name if n in a else ours.name})" for n in sorted(a.keys() ^ b.keys())]
    for name in sorted(a.keys() & b.keys()):
        (ta, da), (tb, db) = a[name], b[name]
        if ta != tb:
            out.append(f"{name} ({ta} vs {tb})")
        elif da != db:
            diff = np.frombuffer(da, np.uint8) != np.frombuffer(db, np.uint8)
            out.append(f"{name} ({int(diff.sum())}/{diff.size} bytes differ)")
    return out


def metadata(path: Path) -> dict[str, object]:
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    return {k: f.contents() for k, f in fields.items() if not k.startswith("GGUF.") and "tokenizer.ggml." not in k}


def metadata_differences(theirs: Path, ours: Path) -> list[str]:
    a, b = metadata(theirs), metadata(ours)
    return [f"{k}: llama-quantize {a.get(k, '-')!r} / ours {b.get(k, '-')!r}"
            for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]


def skipped_entries(log: Path) -> list[str]:
    """Tensors llama-quantize found no imatrix entry for (``did not find weights for X``)."""
    return re.findall(r"did not find weights for (\S+)", log.read_text())


def importances(entry) -> np.ndarray:
    """An entry's importance, every expert's row after the other for a stacked MoE entry (float64)."""
    rows = [entry.importance()] if entry.n_mat == 1 else [entry.importance(e) for e in range(entry.n_mat)]
    return np.concatenate(rows).astype(np.float64)


def importance_rows(ours: Imatrix, theirs: Imatrix) -> list[dict]:
    """Per common entry: token counts (summed over experts; routed tokens for an MoE entry), correlation and
    relative difference of the importances."""
    rows = []
    for name in sorted(ours.entries.keys() & theirs.entries.keys()):
        a, b = importances(ours.entries[name]), importances(theirs.entries[name])
        rel = np.abs(a - b) / np.maximum(np.abs(b), 1e-12)
        rows.append({"entry": name, "count_ours": int(ours.entries[name].counts().sum()),
                     "count_llama": int(theirs.entries[name].counts().sum()),
                     "corr": float(np.corrcoef(a, b)[0, 1]), "rel_median": float(np.median(rel)),
                     "rel_max": float(rel.max()), "norm_rel": float(np.linalg.norm(a - b) / np.linalg.norm(b))})
    return rows


# -- the check -------------------------------------------------------------------------------------------
def check_importance(ours_file: Path, theirs_file: Path, min_corr: float) -> bool:
    ours, theirs = read_imatrix(ours_file), read_imatrix(theirs_file)
    print(f"\n(b) importance: ours {len(ours.entries)} entries, {ours.chunk_count}x{ours.chunk_size} tokens; "
          f"llama-imatrix {len(theirs.entries)} entries, {theirs.chunk_count}x{theirs.chunk_size} tokens "
          f"(datasets {theirs.datasets})")
    only = sorted(ours.entries.keys() ^ theirs.entries.keys())
    for name in only:
        print(f"  entry only in {'ours' if name in ours.entries else 'llama-imatrix'}: {name}")
    rows = importance_rows(ours, theirs)
    print(f"  {'entry':28s} {'tokens ours':>11s} {'llama':>7s} {'1-corr':>9s} {'rel med':>9s} {'rel max':>9s} {'|d|/|b|':>9s}")
    for r in rows:
        print(f"  {r['entry']:28s} {r['count_ours']:11d} {r['count_llama']:7d} {1 - r['corr']:9.2e} "
              f"{r['rel_median']:9.2e} {r['rel_max']:9.2e} {r['norm_rel']:9.2e}")
    worst = min(rows, key=lambda r: r["corr"])
    print(f"  lowest correlation 1 - {1 - worst['corr']:.2e} ({worst['entry']}); "
          f"largest |d|/|b| {max(r['norm_rel'] for r in rows):.2e}")
    return not only and worst["corr"] >= min_corr


def check_bytes(model: Path, f16: Path, work: Path, kinds: list[str], imatrices: dict[str, Path], threads: int) -> bool:
    print("\n(a) llama-quantize --pure --imatrix vs compress export --method imatrix, same imatrix file")
    print(f"  {'type':6s} {'imatrix from':14s} {'same tensors':>12s}  llama-quantize skipped / differing tensors")
    ok = True
    for kind in kinds:
        for source, imatrix in imatrices.items():
            theirs, ours, log = (work / f"{kind}-{source}-{who}" for who in ("llama.gguf", "ours.gguf", "quantize.log"))
            llama_quantize(f16, theirs, FILE_TYPE[Target(kind)], imatrix, threads, log)
            ours_export(model, ours, kind, "imatrix", "--imatrix", imatrix)
            differing = differing_tensors(theirs, ours)
            skipped = [n for n in skipped_entries(log) if n.startswith("blk.")]
            total = len(tensor_bytes(theirs))
            print(f"  {kind:6s} {source:14s} {total - len(differing):5d}/{total:<6d}  "
                  f"{', '.join(skipped) or '-'} / {', '.join(differing) or '-'}")
            ok &= not differing and not skipped
    differences = metadata_differences(theirs, ours)
    print(f"  metadata of the last pair ({len(metadata(ours))} keys, tokenizer.ggml.* left out): "
          f"{'identical' if not differences else 'differing:'}")
    for line in differences:
        print(f"    {line}")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ASSETS / "reference-llama")
    ap.add_argument("--calib", type=Path, default=ASSETS / "shakespeare-calib-slice.txt")
    ap.add_argument("--types", nargs="+", default=TYPES, choices=[t.value for t in Target])
    ap.add_argument("--samples", type=int, help="calibration windows (default: all whole windows of the text)")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per window (llama-imatrix -c)")
    ap.add_argument("--min-corr", type=float, default=0.99, help="lowest acceptable importance correlation")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, help="keep the files here (default: a temporary folder)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        samples = args.samples or calibration_windows(args.model, args.calib, args.seq_len)
        print(f"model {args.model}, calibration {args.calib.name}: {samples} windows x {args.seq_len} tokens")
        model = f16_rounded_copy(args.model, work / "model-f16-rounded")
        f16 = export_f16(model, work / "model-f16.gguf")
        imatrices = {
            "compress": ours_imatrix(model, args.calib, work / "imatrix-compress.gguf", samples, args.seq_len),
            "llama-imatrix": work / "imatrix-llama.gguf",
        }
        llama_imatrix(f16, args.calib, imatrices["llama-imatrix"], args.seq_len, samples, args.threads, work / "imatrix.log")
        ok = check_importance(imatrices["compress"], imatrices["llama-imatrix"], args.min_corr)
        ok &= check_bytes(model, f16, work, args.types, imatrices, args.threads)
    print("\nOK" if ok else "\nMISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
