"""Engine methods behind the calibrated GGUF export (`compress.export.calibrated`).

They are not in the method registry: a GGUF type plan (which GGML type each layer gets) is their
configuration, and their product is GGUF bytes or scaled dense weights for the GGUF writer, not a
checkpoint of their own.

- `GGUFGPTQ`: GPTQ in each layer's GGML block grid (`compress.quantizers.gguf_gptq`); keeps every
  layer's bytes in ``encoded`` for the writer, and sets the layer to their decode so later layers are
  calibrated on the quantized model's activations, as GPTQ does.
- `GGUFAWQ`: AWQ's scale search with the GGML type's own round trip as the quantizer (encode, decode);
  the scales are folded into the preceding norms and linears and the weights stay dense, for the GGUF
  writer (or `GGUFGPTQ`) to round. AWQ's clipping search is for min-max integer grids and is off: the
  k-quant fits search their own ranges.
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field

from compress.formats.gguf.codecs import round_trip as ggml_round_trip
from compress.formats.gguf.sizes import GGMLType
from compress.engine.methods.rtn import GroupSize
from compress.engine.methods.awq import AWQ, AWQMethodConfig
from compress.engine.methods.base import HessianMethod, LayerOutcome, SolverConfig
from compress.quantizers.gguf_gptq import GGUFGPTQConfig, gguf_gptq


class GGUFGPTQMethodConfig(SolverConfig):  # block_size is rounded up to whole GGML blocks
    weighted_fit: bool = Field(True, description="fit each block's grid with the Hessian diagonal as importance")
    output_layer: bool = Field(True, description="also solve the output layer (lm_head) on the quantized model's final hidden states")
    tied_output: bool = Field(True, description="with tied embeddings, solve their one GGUF tensor as the output layer "
                                                "(the lookup then reads GPTQ's rows)")
    refit_scales: bool = Field(True, description="after the column loop, solve each block's float16 scale (and min) on the "
                                                "whole Hessian with the codes kept (a few % of the solve)")
    compare_rtn: bool = Field(False, description="also measure ggml's own rounding of each layer, for the summary's comparison "
                                                 "(one more encode and product by H per layer: +25-45% of the solve's time on "
                                                 "k-quants, 2048 x 2048; about 5% of SmolLM2's q4_k_m export)")


class GGUFGPTQ(HessianMethod):
    """GPTQ with each layer's GGML type as the grid; ``types``: layer name -> type."""

    name = "gptq"
    label = "GPTQ (GGUF)"
    Config = GGUFGPTQMethodConfig
    learned_state = ("encoded",)  # each layer's bytes: solved on one process, shared with the others

    def __init__(self, config: GGUFGPTQMethodConfig, types: dict[str, GGMLType]):
        super().__init__(config)
        self.types = types
        self.encoded: dict[str, tuple[GGMLType, np.ndarray]] = {}  # layer name -> (type, [out, row_bytes])

    @property
    def row_parallel(self) -> bool:
        return False  # each layer's GGML bytes are encoded whole (``encoded``), on one process

    def transform_layer(self, name, weight, stats) -> LayerOutcome:
        return self._stack([name], [weight], stats)[0]

    def transform_shared(self, names, weights, stats) -> list[LayerOutcome]:
        """Layers fed one input and planned in one GGML type are solved stacked by rows, as `HessianMethod` stacks
        integer GPTQ's: the rows are independent given ``H``, and so are a GGUF tensor's rows of blocks, so each
        layer's bytes are its rows of the stack's (one factorization and one column loop: SmolLM2's q/k/v in Q8_0
        2.1x faster, Llama-sized gate/up in Q4_K 1.1x). Layers of different types go one type at a time."""
        outcomes: dict[str, LayerOutcome] = {}
        for kind in dict.fromkeys(self.types[name] for name in names):
            same = [i for i, name in enumerate(names) if self.types[name] == kind]
            for run in self.stacks([weights[i] for i in same]):
                members = same[run]
                solved = self._stack([names[i] for i in members], [weights[i] for i in members], stats)
                outcomes.update(zip((names[i] for i in members), solved))
        return [outcomes[name] for name in names]

    def _stack(self, names: list[str], weights: list[torch.Tensor], stats) -> list[LayerOutcome]:
        """Layers ``names`` (one GGML type) solved as one weight stacked by rows; each one's bytes kept in
        ``encoded``, its figures the sums of its rows'."""
        cfg, kind = self.config, self.types[names[0]]
        config = GGUFGPTQConfig(kind, cfg.block_size, cfg.damp, weighted_fit=cfg.weighted_fit, compare_rtn=cfg.compare_rtn,
                                refit_scales=cfg.refit_scales)
        solved = {}

        def solver(w, h, c):
            result = gguf_gptq(w, h, c)
            solved.update(data=result.data, rtn_rows=result.stats.get("rtn_error_rows"))
            return result

        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        whole = self.solve(", ".join(names), solver, weight, stats, config, ("rel_error", "rtn_rel_error", "damp_retries", "dead_columns"))
        rows = [w.shape[0] for w in weights]
        parts = self.split_rows(whole, rows) if len(weights) > 1 else [whole]
        bounds = np.cumsum(rows)[:-1]
        rtn_rows = solved["rtn_rows"].split(rows) if solved["rtn_rows"] is not None else [None] * len(rows)
        for name, part, data, rtn in zip(names, parts, np.split(solved["data"], bounds), rtn_rows):
            self.encoded[name] = (kind, data)
            energy = float(part.energy_rows.sum())
            part.info["rel_error"] = float(part.error_rows.sum()) / energy if energy > 0 else 0.0
            if rtn is not None:
                part.info["rtn_rel_error"] = float(rtn.sum()) / energy if energy > 0 else 0.0
            part.info["type"] = kind.name
        return parts


def gguf_round_trip(kind: GGMLType):
    """``w [out, in] -> decode(encode(w))`` in GGML type ``kind`` (ggml's reference encoder)."""

    def round_trip(w: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(ggml_round_trip(w.detach().float().cpu().numpy(), kind)).to(w.device)

    return round_trip


class GGUFAWQMethodConfig(AWQMethodConfig):
    clip: bool = Field(False, description="AWQ's min-max clipping search (off: GGML's fits pick their own ranges)")
    # AWQ's integer grid, which each tensor's GGML round trip replaces (`GGUFAWQ.round_trip`): no layer to choose it from
    group_size: GroupSize = Field(128, description="unused in GGML grids: each type fixes its own blocks")


class GGUFAWQ(AWQ):
    """AWQ scales searched against each layer's GGML round trip; weights left dense (scaled)."""

    name = "awq"
    Config = GGUFAWQMethodConfig

    def __init__(self, config: GGUFAWQMethodConfig, types: dict[str, GGMLType]):
        super().__init__(config)
        self.types = types

    def check_layer(self, name: str, out_features: int, in_features: int) -> None:
        """Any width: the GGML type plan has already chosen a type whose blocks fit (or F16)."""

    def round_trip(self, name: str):
        kind = self.types.get(name)
        return gguf_round_trip(kind) if kind is not None else (lambda w: w)  # F16 layers: no rounding to speak of

    def finish_layer(self, name: str, weight: torch.Tensor, shrink) -> tuple[torch.Tensor, None]:
        return weight, None  # the GGUF writer (or GGUFGPTQ) rounds it

    def record(self) -> dict:
        return {"method": "awq", "n_grid": self.config.n_grid, "duo_scaling": self.config.duo_scaling}
