"""Render a `Report`: accuracy-vs-size plot (PNG, Pareto front marked), report.md, self-contained report.html,
report.json. Pure functions return bytes/strings; `write_report` writes all four files atomically.

Pareto front: an output is on it when no other output is at most as large (x) and at most as bad (y),
and strictly better in one of the two; both axes are minimized (size in MB or bits per weight; mean KLD
or perplexity).
"""

from __future__ import annotations

import base64
import enum
import html
import io
import json
import os
from pathlib import Path
from typing import Any, Sequence

from compress.errors import CompressError


class XAxis(str, enum.Enum):
    SIZE = "size"  # MB on disk
    BPW = "bpw"  # bits per weight of the block linear layers


class YAxis(str, enum.Enum):
    KLD = "kld"
    PPL = "ppl"


X_LABEL = {XAxis.SIZE: "size on disk (MB)", XAxis.BPW: "bits per weight (block linear layers)"}
Y_LABEL = {YAxis.KLD: "mean KLD vs baseline (nats/token)", YAxis.PPL: "perplexity"}


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (both coordinates minimized)."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (ox <= x and oy <= y) and (ox < x or oy < y) for j, (ox, oy) in enumerate(points) if j != i
        )
        if not dominated:
            front.append(i)
    return front


def _value(row: dict, axis) -> float | None:
    if axis == XAxis.SIZE:
        return row["size_bytes"] / 1e6
    if axis == XAxis.BPW:
        return row["bits_per_weight"]
    return row["kld"] if axis == YAxis.KLD else row["perplexity"]


def plot_points(report: dict, x: XAxis, y: YAxis) -> tuple[list[dict], list[tuple[float, float]]]:
    """The outputs with both coordinates defined (the baseline too when y is perplexity), and their points."""
    rows = [report["baseline"]] if y == YAxis.PPL else []
    rows += report["outputs"]
    rows = [r for r in rows if _value(r, x) is not None and _value(r, y) is not None]
    return rows, [(_value(r, x), _value(r, y)) for r in rows]


def plot_png(report: dict, x: XAxis = XAxis.SIZE, y: YAxis = YAxis.KLD) -> bytes:
    """Accuracy against size, one labelled point per output, the Pareto front joined, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to memory
    import matplotlib.pyplot as plt

    rows, points = plot_points(report, x, y)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    try:
        front = sorted(pareto_front(points), key=lambda i: points[i])
        others = [i for i in range(len(points)) if i not in front]
        ax.scatter([points[i][0] for i in others], [points[i][1] for i in others], color="tab:gray", label="dominated")
        ax.plot([points[i][0] for i in front], [points[i][1] for i in front], "o-", color="tab:red", label="Pareto front")
        for (px, py), r in zip(points, rows):
            ax.annotate(r["name"], (px, py), textcoords="offset points", xytext=(4, 4), fontsize=7)
        if y == YAxis.KLD and points and all(p[1] > 0 for p in points):
            ax.set_yscale("log")
        if y == YAxis.PPL and report["baseline"]["perplexity"] is not None:  # None: a backend that could not run it
            ax.axhline(report["baseline"]["perplexity"], color="tab:blue", ls="--", lw=1, label="baseline perplexity")
        ax.set_xlabel(X_LABEL[x])
        ax.set_ylabel(Y_LABEL[y])
        ax.set_title(f"{Y_LABEL[y]} against {X_LABEL[x]}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)


def _fmt(v: Any, digits: int) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


COLUMNS = ("output", "what", "evaluated by", "ppl", "mean KLD", "KLD p99", "size (MB)", "bits/weight", "sparsity",
           "draft α greedy / T=1", "tokens/call k=4")
DRAFT_K = 4  # drafted tokens per target call in the report's tokens/call column


def _draft_cells(alpha: float | None, alpha_t1: float | None) -> list[str]:
    """Each output as a speculative-decoding draft of the baseline: its acceptance rates and the mean tokens one
    baseline call yields with `DRAFT_K` greedy drafted tokens (`compress.eval.speculative`)."""
    from compress.eval.speculative import expected_tokens_per_call

    if alpha is None:
        return ["n/a", "n/a"]
    return [f"{alpha:.3f} / {_fmt(alpha_t1, 3)}", f"{expected_tokens_per_call(alpha, DRAFT_K):.2f}"]


def table_rows(report: dict) -> list[list[str]]:
    """The rows every rendering shows (terminal, markdown, HTML), baseline first; ``*``: nominal bits."""
    out = []
    for r in [report["baseline"], *report["outputs"]]:
        bits = _fmt(r["bits_per_weight"], 3) + ("*" if r["bits_source"] == "nominal" else "")
        extra = [f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in (r.get("extra") or {}).items()]
        out.append([
            r["name"], r["description"] + (f" [{', '.join(extra)}]" if extra else ""), r["evaluator"],
            _fmt(r["perplexity"], 4), _fmt(r["kld"], 6), _fmt(r["kld_p99"], 5), f"{r['size_bytes'] / 1e6:.3f}", bits,
            "n/a" if r["sparsity"] is None else f"{r['sparsity']:.1%}",
            *_draft_cells(r.get("acceptance"), r.get("acceptance_t1")),
        ])
    return out


def _protocol_line(report: dict) -> str:
    p = report["protocol"]
    return (
        f"Baseline `{p['baseline']}`; text `{p['text']}`: {p['tokens']} tokens (baseline tokenizer, no BOS), "
        f"windows of {p['ctx']} tokens, stride {p['stride']}, every token after the first scored once; "
        f"KLD = KL(P_baseline ‖ P_output) per scored token. Bits per weight over the decoder-block linear layers; "
        f"* = nominal (fake-quantized dense checkpoint: code bits + fp16 scale per group)."
        + (f" Perplexities scored by {p['backend']}, which gives no KLD." if p.get("backend") else "")
    )


def render_markdown(report: dict, x: XAxis, y: YAxis, plot_name: str = "report.png") -> str:
    rows, points = plot_points(report, x, y)
    front = [rows[i]["name"] for i in pareto_front(points)]
    lines = ["# Compression report", "", _protocol_line(report), "", "| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in table_rows(report)]
    lines += ["", f"Pareto front ({Y_LABEL[y]} against {X_LABEL[x]}): {', '.join(front) or 'none'}.", "", f"![accuracy against size]({plot_name})", ""]
    return "\n".join(lines)


def render_html(report: dict, png: bytes, x: XAxis, y: YAxis) -> str:
    """One self-contained page: the table, the protocol, and the plot embedded as a base64 PNG."""
    rows, points = plot_points(report, x, y)
    front = {rows[i]["name"] for i in pareto_front(points)}
    esc = html.escape
    head = "".join(f"<th>{esc(c)}</th>" for c in COLUMNS)
    marked = ' class="front"'
    body = "".join(
        f"<tr{marked if row[0] in front else ''}>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>"
        for row in table_rows(report)
    )
    image = base64.b64encode(png).decode("ascii")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Compression report</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:nth-child(-n+3),th:nth-child(-n+3){text-align:left}"
        "tr.front{background:#fde8e8}</style></head><body>\n"
        f"<h1>Compression report</h1>\n<p>{esc(_protocol_line(report))}</p>\n"
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>\n"
        f"<p>Highlighted: the Pareto front ({esc(Y_LABEL[y])} against {esc(X_LABEL[x])}).</p>\n"
        f"<img alt=\"accuracy against size\" src=\"data:image/png;base64,{image}\">\n</body></html>\n"
    )


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_report(report: dict, out_dir: Path, x: XAxis = XAxis.SIZE, y: YAxis = YAxis.KLD) -> dict[str, Path]:
    """report.json, report.png, report.md and report.html in ``out_dir``; each file replaced atomically."""
    if out_dir.exists() and not out_dir.is_dir():
        raise CompressError(f"report output {out_dir} is a file: give a directory with -o")
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot_png(report, x, y)
    files = {
        "json": (out_dir / "report.json", (json.dumps(report, indent=2) + "\n").encode()),
        "png": (out_dir / "report.png", png),
        "md": (out_dir / "report.md", render_markdown(report, x, y).encode()),
        "html": (out_dir / "report.html", render_html(report, png, x, y).encode()),
    }
    for path, data in files.values():
        _write_atomic(path, data)
    return {k: p for k, (p, _) in files.items()}
