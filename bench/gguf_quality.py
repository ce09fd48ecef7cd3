"""Quality of our GGUF export methods next to llama.cpp's quantizer, per type, on one model.

    python bench/gguf_quality.py [--model eval/assets/reference-llama] [--types q4_k q3_k q2_k iq4_xs ...]
        [--methods llama.cpp llama.cpp+imatrix rtn imatrix gptq gptq-asymmetric gptq-rotated awq awq-gptq
                   gptq+plan gptq+plan@gptq gptq-rotated+plan@gptq] [--samples 64]
        [--seq-len 512]
        [--calib eval/assets/shakespeare-calib-slice.txt] [--text eval/assets/shakespeare-test-slice.txt]
        [--ctx 512] [--max-tokens N] [--rounded-input] [--workdir DIR] [--json PATH] [--plan sensitivity.json] [--report DIR]
        [--measure-samples N]

Protocol. The model is exported once as an F16 GGUF (our exporter). Per type, every method writes one
file in which every matrix has that type (token_embd and output included), or for llama.cpp's mixes
(q4_k_m, q3_k_m, ...) the mix's types, which ours and llama.cpp's quantizer choose by the same rule:
- ``llama.cpp``: ``llama_model_quantize`` (llama-cpp-python) of the F16 file, ``pure`` set except for mixes;
- ``llama.cpp+imatrix``: the built ``llama-quantize [--pure] --imatrix`` of the F16 file, the imatrix from
  the built ``llama-imatrix`` on the F16 file over the first ``samples`` windows of ``seq-len`` tokens of
  the calibration text (no BOS: the file's ``add_bos_token`` is false);
- ``rtn``, ``imatrix``, ``gptq``, ``awq``, ``awq-gptq``: ``compress export --method M`` (``gptq-asymmetric``: ``--method
  gptq -O asymmetric=true``; ``gptq-rotated``: ``--method gptq --rotate random-hadamard``, R1 + R2 fused before the
  grids are fitted; the calibrated ones with ``--calib TEXT --samples N --seq-len L``: ``samples`` random windows
  of the same text, seed 0, so the same number of calibration tokens as llama-imatrix, not the same windows).
  Methods our CLI rejects (exit status 2, e.g. not implemented yet) are skipped with a note.
llama.cpp quantizes the F16 file, our exporter the checkpoint's own (float32) weights: with
``--rounded-input`` ours read a copy whose matrices are rounded to float16 instead, so every method starts from the same
values (the baseline stays the original model).
With ``--plan`` (a GGUF sensitivity file from ``compress measure --candidates q2_k,...,q8_0``), the method
``gptq+plan`` writes ``compress export --method gptq --plan FILE --target-size S`` where S is the size of the
llama.cpp + imatrix file of the same type (or llama.cpp's, whichever this run wrote): the issue-21 row, one
allocation per layer at exactly the anchor's size, beside ``gptq`` with llama.cpp's type rules.
The rotation at equal size: ``gptq-rotated+plan@gptq`` writes ``compress export --method gptq --rotate random-hadamard
--plan S_ROT --target-size B``, where B is the size of our unrotated ``gptq`` file of the same type written earlier in
the run (``gptq`` must come before it in ``--methods``), and S_ROT is ``compress measure --candidates PLAN_CANDIDATES``
of the rotated checkpoint (``compress run`` of a recipe with the one stage ``method: rotate``, ``kind:
random-hadamard``: the checkpoint ``--rotate`` writes) on ``--measure-samples`` windows (default ``--samples``) of the
calibration text; ``gptq+plan@gptq`` is the same
without the rotation (the sensitivity of the model itself), so allocation's own gain is in both rows. The rotated
checkpoint and the sensitivity files stay in the work folder (``model-rotated``, ``sensitivity-rotated.json``,
``sensitivity.json``); an existing sensitivity file is extended, not remeasured. The rotated model's output layer is untied (the final norm's scale is folded into it alone), so its
plan spends more of the same bytes on the embeddings and output layer; a size below the smallest the candidates
allow (every layer at its smallest candidate) is our CLI's refusal, noted under the table for that type.
Every file, and the F16 one as a reference, is scored by `evaluate_outputs` with llama.cpp on the held-out
text: windows of ``ctx`` 512 tokens (HF tokenizer, no BOS), perplexity and mean KL(HF model || GGUF).
Bits per weight are those of the ``blk.*`` matrices as stored (``gguf_figures``); the size is the file's.
Under the table, per type, each of our methods' KLD as a ratio to llama.cpp + imatrix's (the issue-22 target:
ours GPTQ ≤ 0.8×), each GPTQ variant's KLD and size as ratios to the unrotated ``gptq`` file's, and the rotated
allocated row's as ratios to the unrotated allocated one's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gguf_encode import llama_cpp_quantize
from gguf_imatrix_check import ASSETS, TYPES, Rejected, calibration_windows, compress_cli, export_f16, f16_rounded_copy, ours_export
from llama_cpp_tools import llama_imatrix, llama_quantize

from compress.eval.report import GGUFBackend, Protocol, evaluate_outputs
from compress.eval.report_render import write_report
from compress.formats.gguf.plan import FILE_TYPE, PRESETS, Target

OURS = ["rtn", "imatrix", "gptq", "gptq-asymmetric", "gptq-rotated", "awq", "awq-gptq", "gptq+plan", "gptq+plan@gptq",
        "gptq-rotated+plan@gptq"]
SIZED_TO_GPTQ = ("gptq+plan@gptq", "gptq-rotated+plan@gptq")
ROTATION = "random-hadamard"
VARIANTS = {"gptq-asymmetric": ("gptq", ["-O", "asymmetric=true"]),  # a method of our CLI with settings
            "gptq-rotated": ("gptq", ["--rotate", ROTATION])}
METHODS = ["llama.cpp", "llama.cpp+imatrix", *OURS]
LABELS = {"llama.cpp": "llama.cpp", "llama.cpp+imatrix": "llama.cpp + imatrix", **{m: f"ours {m}" for m in OURS},
          "gptq+plan": "ours gptq, allocated", "gptq+plan@gptq": "ours gptq, allocated at gptq's size",
          "gptq-rotated+plan@gptq": "ours gptq-rotated, allocated at gptq's size"}
# The GGML types the @gptq allocations choose from, one list for every target type: measure extends one file per
# model, so per-type lists would make a type's plan depend on which types the run measured before it, and at a given
# size the allocator only takes what fits. q2_k and q3_k are the 2-3-bit steps (iq2_xs, q3_k_m targets; the IQ2
# types are llama.cpp file types, mixes, not single-type candidates), iq4_xs adds IQ4_NL (4.5 bits, as Q4_0) where
# a row does not split into 256-blocks, q4_k and q6_k the steps above, up to what a preset gives its output layer.
# On SmolLM2 (576 wide) every matrix but ffn_down falls back (q2_k, q3_k -> Q4_0; iq4_xs -> IQ4_NL; q4_k -> Q5_0;
# q6_k -> Q8_0): a fallback already measured for a layer costs nothing, and measuring time grows with the distinct
# types, so the list keeps one type per step.
PLAN_CANDIDATES = "q2_k,q3_k,iq4_xs,q4_k,q6_k"


@dataclass
class Setup:
    model: Path
    calib: Path
    samples: int
    seq_len: int
    work: Path
    threads: int
    f16: Path | None = None
    llama_imatrix_file: Path | None = None
    plan: Path | None = None
    measure_samples: int | None = None  # compress measure's windows for the @gptq plans (None: samples)

    def llama_imatrix(self) -> Path:
        """llama-imatrix's file for the F16 model, collected on first use."""
        if self.llama_imatrix_file is None:
            self.llama_imatrix_file = self.work / "imatrix-llama.gguf"
            llama_imatrix(self.f16, self.calib, self.llama_imatrix_file, self.seq_len, self.samples, self.threads,
                          self.work / "imatrix-llama.log")
        return self.llama_imatrix_file

    def calib_options(self) -> list[object]:
        return ["--calib", self.calib, "--samples", self.samples, "--seq-len", self.seq_len]


# -- one file per (type, method) --------------------------------------------------------------------------
def with_llama_cpp(setup: Setup, kind: str, dst: Path) -> None:
    llama_cpp_quantize(setup.f16, dst, Target(kind), setup.threads)


def with_llama_cpp_imatrix(setup: Setup, kind: str, dst: Path) -> None:
    llama_quantize(setup.f16, dst, FILE_TYPE[Target(kind)], setup.llama_imatrix(), setup.threads,
                   dst.with_suffix(".log"), pure=Target(kind) not in PRESETS)


def with_ours(method: str) -> Callable[[Setup, str, Path], None]:
    def write(setup: Setup, kind: str, dst: Path) -> None:
        cli_method, settings = VARIANTS.get(method, (method, []))
        ours_export(setup.model, dst, kind, cli_method, *(setup.calib_options() if method != "rtn" else []), *settings)

    return write


def with_plan(setup: Setup, kind: str, dst: Path) -> dict:
    """GPTQ with one measured type per tensor, sized to the llama.cpp file of the same type; returns the
    plan's predicted KLD (calibration windows) for the row."""
    anchors = [setup.work / f"{kind}-{m}.gguf" for m in ("llama.cpp+imatrix", "llama.cpp")]
    anchor = next((a for a in anchors if a.is_file()), None)
    if setup.plan is None or anchor is None:
        raise SystemExit("gptq+plan needs --plan sensitivity.json and llama.cpp or llama.cpp+imatrix listed before it in --methods")
    return allocated_gptq(setup, kind, dst, setup.plan, anchor)


def allocated_gptq(setup: Setup, kind: str, dst: Path, plan: Path, anchor: Path, *settings: object) -> dict:
    """``compress export --method gptq SETTINGS --plan PLAN`` at ``anchor``'s size; the plan's predicted KLD for the row."""
    result = ours_export(setup.model, dst, kind, "gptq", *setup.calib_options(), *settings, "--plan", plan,
                         "--target-size", anchor.stat().st_size)
    return {"predicted_kld": result["plan"]["predicted_kld"]}


def rotated_checkpoint(setup: Setup) -> Path:
    """The model with R1 + R2 fused, as ``compress export --rotate`` writes it (the one-stage recipe it runs)."""
    out = setup.work / "model-rotated"
    if not (out / "config.json").is_file():
        recipe = setup.work / "rotate.yaml"
        recipe.write_text(json.dumps({"model": str(setup.model), "stages": [{"method": "rotate", "kind": ROTATION}],
                                      "output": {"path": str(out)}}))  # JSON is YAML
        compress_cli("run", recipe)
    return out


def sensitivity(setup: Setup, model: Path, name: str) -> Path:
    """``compress measure`` of ``model`` over PLAN_CANDIDATES with the run's calibration (kept and extended)."""
    out = setup.work / name
    compress_cli("measure", model, "--calib", setup.calib, "--samples", setup.measure_samples or setup.samples,
                 "--seq-len", setup.seq_len, "--candidates", PLAN_CANDIDATES, "-o", out)
    return out


def with_plan_at_gptq(rotated: bool) -> Callable[[Setup, str, Path], dict]:
    def write(setup: Setup, kind: str, dst: Path) -> dict:
        """GPTQ (rotated or not) with one measured type per tensor at the size of our gptq file of this type."""
        anchor = setup.work / f"{kind}-gptq.gguf"
        if not anchor.is_file():
            raise SystemExit(f"the @gptq methods need gptq listed before them in --methods ({anchor.name} is missing)")
        plan = (sensitivity(setup, rotated_checkpoint(setup), "sensitivity-rotated.json") if rotated
                else sensitivity(setup, setup.model, "sensitivity.json"))
        return allocated_gptq(setup, kind, dst, plan, anchor, *(["--rotate", ROTATION] if rotated else []))

    return write


PRODUCERS = {"llama.cpp": with_llama_cpp, "llama.cpp+imatrix": with_llama_cpp_imatrix,
             **{m: with_ours(m) for m in OURS}, "gptq+plan": with_plan,
             "gptq+plan@gptq": with_plan_at_gptq(False), "gptq-rotated+plan@gptq": with_plan_at_gptq(True)}
# methods whose refusal is about one type only: the plan's budget is that type's llama.cpp file (q2_k's is below
# every plan of q2_k..q8_0), or our gptq file (the rotated model's untied output layer may not fit in it), so the
# other types still get their rows
REFUSED_PER_TYPE = {"gptq+plan", *SIZED_TO_GPTQ}


def write_files(setup: Setup, kinds: list[str], methods: list[str]) -> tuple[list[dict], list[str]]:
    """Every (type, method) file; returns their rows (no scores yet) and notes on skipped methods."""
    rows, notes, rejected = [], [], set()
    for kind in kinds:
        for method in methods:
            if method in rejected:
                continue
            dst = setup.work / f"{kind}-{method}.gguf"
            start = time.perf_counter()
            try:
                extra = PRODUCERS[method](setup, kind, dst) or {}
            except Rejected as exc:
                if method not in REFUSED_PER_TYPE:
                    rejected.add(method)
                notes.append(f"skipped {LABELS[method]}{f' at {kind}' if method in REFUSED_PER_TYPE else ''}: our CLI rejects it ({exc})")
                print(notes[-1])
                continue
            seconds = time.perf_counter() - start
            print(f"wrote {dst.name} in {seconds:.1f} s")
            rows.append({"type": kind, "method": LABELS[method], "path": str(dst), "seconds": round(seconds, 2), **extra})
    return rows, notes


# -- scores and the table --------------------------------------------------------------------------------
def score(rows: list[dict], model: Path, text: Path, ctx: int, report_dir: Path | None = None,
          max_tokens: int | None = None) -> dict:
    """Fill each row's size, bits per weight, perplexity and KLD; returns the report's baseline and protocol.
    With ``report_dir``, also `compress report`'s files there (KLD against size, Pareto front marked)."""
    report = evaluate_outputs([Path(r["path"]) for r in rows], model, Protocol(text, ctx=ctx, max_tokens=max_tokens),
                              GGUFBackend.LLAMA_CPP)
    for row, scored in zip(rows, report.rows):
        row.update(size_bytes=scored.size_bytes, bits_per_weight=scored.bits_per_weight,
                   perplexity=scored.perplexity, kld=scored.kld, evaluator=scored.evaluator)
    if report_dir is not None:
        write_report(report.to_dict(), report_dir)
    return {"baseline": report.baseline.to_dict(), "protocol": report.protocol}


def markdown(rows: list[dict], baseline: dict) -> str:
    lines = [f"baseline (HF, float32): perplexity {baseline['perplexity']:.4f} over {baseline['tokens_scored']} tokens",
             "",
             "| type | method | size (bytes) | size (MB) | bits/weight | perplexity | mean KLD | predicted KLD |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        predicted = f"{r['predicted_kld']:.5f}" if r.get("predicted_kld") is not None else ""
        lines.append(f"| {r['type']} | {r['method']} | {r['size_bytes']} | {r['size_bytes'] / 1e6:.3f} | "
                     f"{r['bits_per_weight']:.4f} | {r['perplexity']:.4f} | {r['kld']:.5f} | {predicted} |")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> list[str]:
    """Per type: each of our methods' mean KLD over llama.cpp + imatrix's, the anchor of the same run."""
    lines = []
    for kind in dict.fromkeys(r["type"] for r in rows):
        anchor = next((r["kld"] for r in rows if r["type"] == kind and r["method"] == LABELS["llama.cpp+imatrix"]), None)
        if not anchor:
            continue
        parts = [f"{r['method']} {r['kld'] / anchor:.2f}x" for r in rows if r["type"] == kind and r["method"].startswith("ours")]
        lines.append(f"{kind}: KLD vs llama.cpp + imatrix: " + ", ".join(parts))
    for kind in dict.fromkeys(r["type"] for r in rows):
        row = {m: next((r for r in rows if r["type"] == kind and r["method"] == LABELS[m]), None) for m in METHODS}
        pairs = [(m, "gptq") for m in ("gptq-rotated", *SIZED_TO_GPTQ)] + [SIZED_TO_GPTQ[::-1]]
        for method, base in pairs:
            if row[method] and row[base]:
                lines.append(f"{kind}: ours {method} / ours {base}: KLD {row[method]['kld'] / row[base]['kld']:.2f}x, "
                             f"size {row[method]['size_bytes'] / row[base]['size_bytes']:.4f}x")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ASSETS / "reference-llama")
    ap.add_argument("--calib", type=Path, default=ASSETS / "shakespeare-calib-slice.txt")
    ap.add_argument("--text", type=Path, default=ASSETS / "shakespeare-test-slice.txt", help="held-out text")
    ap.add_argument("--types", nargs="+", default=TYPES, choices=[t.value for t in Target])
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--samples", type=int, default=64, help="calibration windows (capped at what the text has)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=512, help="evaluation window")
    ap.add_argument("--max-tokens", type=int, help="score only the first N tokens of the held-out text")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp quantize/imatrix threads")
    ap.add_argument("--rounded-input", action="store_true", help="our exports read float16-rounded weights, as llama.cpp")
    ap.add_argument("--workdir", type=Path, help="keep the files here (default: a temporary folder)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--plan", type=Path, help="GGUF sensitivity file for the gptq+plan method")
    ap.add_argument("--report", type=Path, help="also write compress report's files (plot of KLD against size) here")
    ap.add_argument("--measure-samples", type=int, help="calibration windows of the @gptq methods' compress measure (default: --samples)")
    args = ap.parse_args()
    for method in SIZED_TO_GPTQ:
        if method in args.methods and ("gptq" not in args.methods or args.methods.index("gptq") > args.methods.index(method)):
            ap.error(f"{method} is sized to our gptq file of the same type: list gptq before it in --methods")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        available = calibration_windows(args.model, args.calib, args.seq_len)
        samples = min(args.samples, available)
        print(f"calibration {args.calib.name}: {available} windows of {args.seq_len} tokens, using {samples}")
        ours_input = f16_rounded_copy(args.model, work / "model-f16-rounded") if args.rounded_input else args.model
        setup = Setup(ours_input, args.calib, samples, args.seq_len, work, args.threads, plan=args.plan,
                      measure_samples=args.measure_samples and min(args.measure_samples, available))
        setup.f16 = export_f16(args.model, work / "model-f16.gguf")
        rows, notes = write_files(setup, args.types, args.methods)
        rows.insert(0, {"type": "f16", "method": "ours (reference)", "path": str(setup.f16), "seconds": None})
        summary = score(rows, args.model, args.text, args.ctx, args.report, args.max_tokens)
    print(f"\nllama.cpp quantized the F16 GGUF; ours read {'a float16-rounded copy' if args.rounded_input else 'the checkpoint weights'}")
    print(markdown(rows, summary["baseline"]))
    for line in ratios(rows):
        print(line)
    for note in notes:
        print(f"\nnote: {note}")
    if args.json:
        calibration = {"text": str(args.calib), "samples": samples, "seq_len": args.seq_len, "windows_available": available}
        inputs = {"llama.cpp": "F16 GGUF", "ours": "float16-rounded copy" if args.rounded_input else "checkpoint weights"}
        args.json.write_text(json.dumps({**summary, "calibration": calibration, "inputs": inputs, "rows": rows, "notes": notes}, indent=2))


if __name__ == "__main__":
    main()
