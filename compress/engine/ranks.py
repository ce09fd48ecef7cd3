"""Many processes on one engine (``torchrun`` / ``accelerate launch`` + torch.distributed), and one.

With N ranks the engine splits the calibration windows across them (data-parallel calibration and
propagation), reduces every layer's statistics so each rank holds the global ones, and splits the
layer-by-layer solves among them (weight-parallel solving): each layer's rows for the second-order solvers,
whole layers balanced by cost otherwise, sharing the results.
`Ranks()` is the single process: every collective is the identity, so the engine has one code path.

Reductions run in float64 and every rank receives the same reduced bits (all-reduce), so ranks that
repeat a computation on reduced statistics (AWQ, SmoothQuant) stay in step without a broadcast.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from compress.checkpoints.model_io import get_weight, set_weight
from compress.engine.methods.base import LayerReport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    @classmethod
    def from_environment(cls, device: torch.device | str = "cpu") -> "Ranks":
        """The process group a launcher describes (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``...), joined on
        first use: NCCL on CUDA, gloo on CPUs. Without a launcher: one process."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        import torch.distributed as dist

        device = torch.device(device)
        if not dist.is_initialized():
            if device.type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            # a solve on another rank can take long: wait for it (gloo's default is 30 minutes)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=6))
        return cls(dist.get_rank(), dist.get_world_size())

    @property
    def main(self) -> bool:
        """The rank that writes the output and reports progress."""
        return self.rank == 0

    def local_share(self, windows: torch.Tensor) -> torch.Tensor:
        """This rank's calibration windows ``[samples/N, seq_len]``: a contiguous share, so the ranks' tokens
        in rank order are the single process's tokens in order."""
        if self.world == 1:
            return windows
        return windows.tensor_split(self.world)[self.rank]

    # -- collectives (identities for one process) -----------------------------------------------------
    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks, in place."""
        return self._collective(tensor, lambda dist, t: dist.all_reduce(t, dist.ReduceOp.SUM))

    def max_(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s elementwise maximum over the ranks, in place."""
        return self._collective(tensor, lambda dist, t: dist.all_reduce(t, dist.ReduceOp.MAX))

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s, in place."""
        return self._collective(tensor, lambda dist, t: dist.broadcast(t, src))

    def _collective(self, tensor: torch.Tensor, op) -> torch.Tensor:
        if self.world == 1:
            return tensor
        import torch.distributed as dist

        device = self._device()
        if tensor.device == device and tensor.is_contiguous():
            op(dist, tensor)
        else:  # NCCL moves CUDA tensors only; a collective needs contiguous memory
            moved = tensor.to(device).contiguous()
            op(dist, moved)
            tensor.copy_(moved)
        return tensor

    def sum_floats(self, *values: float) -> list[float]:
        if self.world == 1:
            return list(values)
        return self.sum_(torch.tensor(values, dtype=torch.float64, device=self._device())).tolist()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (pickled; tensors keep their device)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (pickled)."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank has got here."""
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def strided_rows(self, rows: torch.Tensor, count: int) -> torch.Tensor:
        """``count`` evenly strided rows of the ranks' ``rows`` concatenated in rank order, the same rows one
        process would pick from all of them (``x[::max(1, n // count)][:count]``); only the picked rows travel."""
        counts = [int(c) for c in self.gather(rows.shape[0])]
        total, offset = sum(counts), sum(counts[: self.rank])
        stride = max(1, total // count)
        first = (-offset) % stride  # the first local row on the global stride
        picked = torch.arange(first, rows.shape[0], stride)
        picked = picked[(offset + picked) // stride < count]
        return torch.cat([part.to(rows.device) for part in self.gather(rows[picked])])

    def assign(self, costs: dict[str, float]) -> dict[str, int]:
        """Each job's rank: the most costly first, each to the least loaded rank (ties: the lower rank)."""
        load = [0.0] * self.world
        owner = {}
        for name in sorted(costs, key=lambda n: -costs[n]):  # stable: equal costs keep their order
            rank = min(range(self.world), key=lambda r: (load[r], r))
            owner[name] = rank
            load[rank] += costs[name]
        return owner

    def _device(self) -> torch.device:
        import torch.distributed as dist

        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Leave the process group (every rank, once the collectives are over)."""
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


@dataclass
class Replay:
    """``replay()`` runs the block on this rank's calibration inputs again (see `Method.transform_block`);
    ``ranks`` lets a method that measures those outputs combine its figures over all ranks."""

    run: Callable[[], list[torch.Tensor]]
    ranks: Ranks

    def __call__(self) -> list[torch.Tensor]:
        return self.run()


def solve_on_owners(ranks: Ranks, method, block: nn.Module, layers: dict[str, nn.Module], stats, replay) -> list:
    """Weight-parallel `Method.transform_block` for a layer-by-layer method, so every rank ends holding what one
    process would. A `row_parallel` method splits every layer's rows among the ranks (`solve_row_slices`); any
    other gives each layer to one rank, balanced by rows x columns² (the cost of a second-order solve), whose
    owner broadcasts the new weight and shares its codes, report and learned state."""
    if method.row_parallel and all(get_weight(m).shape[0] >= ranks.world for m in layers.values()):
        return solve_row_slices(ranks, method, layers, stats)
    costs = {}
    for name, module in layers.items():
        out_features, in_features = get_weight(module).shape
        costs[name] = float(out_features) * in_features * in_features
    owner = ranks.assign(costs)
    mine = {n: m for n, m in layers.items() if owner[n] == ranks.rank}
    reports = {r.name: r for r in (method.transform_block(block, mine, {n: stats[n] for n in mine}, replay=replay) if mine else [])}
    learned = {attr: {n: v for n, v in method.__dict__.get(attr, {}).items() if n in mine} for attr in method.learned_state}
    shares = ranks.gather({"reports": reports, "kept": method.take_outcomes(), "learned": learned})
    ordered = []
    for name, module in layers.items():
        share = shares[owner[name]]
        ranks.broadcast_(module.weight.data, owner[name])
        if name in share["kept"]:
            method.keep_outcome(name, share["kept"][name])
        for attr, values in share["learned"].items():
            state = method.__dict__.setdefault(attr, {})
            state.pop(name, None)  # re-inserted in layer order, as one process would have
            if name in values:
                state[name] = values[name]
        ordered.append(share["reports"][name])
    return ordered


def solve_row_slices(ranks: Ranks, method, layers: dict[str, nn.Module], stats) -> list:
    """Each rank transforms its contiguous share of every layer's rows (with the layer's whole statistics), the
    shares are gathered and merged (`Method.merge_rows`) on every rank: the solve divides evenly, where whole
    layers leave the rank holding the largest one (a block's ``down_proj``) the last to finish. Every rank
    repeats the per-layer work that does not depend on the rows (GPTQ's factorization of H)."""
    mine = {}
    for name, module in layers.items():
        start = time.perf_counter()
        weight = get_weight(module).detach().float()
        rows = torch.arange(weight.shape[0]).tensor_split(ranks.world)[ranks.rank]
        outcome = method.transform_layer(name, weight[int(rows[0]) : int(rows[-1]) + 1], stats[name])
        mine[name] = (outcome, time.perf_counter() - start)
    shares = ranks.gather(mine)
    reports = []
    for name, module in layers.items():
        outcome = method.merge_rows([share[name][0] for share in shares])
        set_weight(module, outcome.weight)
        method.keep_outcome(name, outcome)
        seconds = max(share[name][1] for share in shares)  # the slices ran side by side
        reports.append(LayerReport(name, tuple(outcome.weight.shape), seconds, outcome.info))
    return reports
