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

import dataclasses
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

    @staticmethod
    def launched_main() -> bool:
        """Whether this process will be the main rank (`main`), read from the launcher's environment before the
        process group is joined: no launcher, or ``RANK`` 0."""
        return int(os.environ.get("WORLD_SIZE", "1")) <= 1 or int(os.environ.get("RANK", "0")) == 0

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

    def strided_picks(self, local: int, count: int) -> torch.Tensor:
        """Of ``local`` items here (the ranks' items concatenated in rank order), the indices of those on the
        global stride one process would pick from all of them (``items[::max(1, n // count)][:count]``)."""
        counts = [int(c) for c in self.gather(local)]
        total, offset = sum(counts), sum(counts[: self.rank])
        stride = max(1, total // count)
        first = (-offset) % stride  # the first local item on the global stride
        picked = torch.arange(first, local, stride)
        return picked[(offset + picked) // stride < count]

    def strided_rows(self, rows: torch.Tensor, count: int) -> torch.Tensor:
        """``count`` evenly strided rows of the ranks' ``rows`` concatenated in rank order, the same rows one
        process would pick from all of them; only the picked rows travel."""
        picked = self.strided_picks(rows.shape[0], count)
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
    ``ranks`` lets a method that measures those outputs combine its figures over all ranks. ``inputs``: those
    calls, ``(hidden, args, kwargs)`` batches; ``reference``: the uncompressed model's stream (`compress.engine.
    reference.ReferenceStream`) where the engine carries one (a method's `Method.block_inputs`)."""

    run: Callable[[], list[torch.Tensor]]
    ranks: Ranks
    inputs: Any = None
    reference: Any = None

    def __call__(self) -> list[torch.Tensor]:
        return self.run()


def solve_cost(module: nn.Module) -> float:
    """A layer's second-order solve cost, rows x columns² (GPTQ's and SparseGPT's column loop)."""
    out_features, in_features = get_weight(module).shape
    return float(out_features) * in_features * in_features


def solve_on_owners(ranks: Ranks, method, block: nn.Module, layers: dict[str, nn.Module], stats, replay) -> list:
    """Weight-parallel `Method.transform_block` for a layer-by-layer method, so every rank ends holding what one
    process would. A `row_parallel` method may split layers by rows (`solve_shares`); any other gives each layer
    to one rank, balanced by cost, whose owner broadcasts the new weight and shares its codes, report and
    learned state."""
    if method.row_parallel:
        return solve_shares(ranks, method, layers, stats)
    owner = ranks.assign({name: solve_cost(module) for name, module in layers.items()})
    mine = {n: m for n, m in layers.items() if owner[n] == ranks.rank}
    reports = {r.name: r for r in (method.transform_block(block, mine, {n: stats[n] for n in mine}, replay=replay) if mine else [])}
    learned = _learned(method, mine)
    shares = ranks.gather({"reports": reports, "kept": method.take_outcomes(), "learned": learned})
    ordered = []
    for name, module in layers.items():
        share = shares[owner[name]]
        ranks.broadcast_(module.weight.data, owner[name])
        if name in share["kept"]:
            method.keep_outcome(name, share["kept"][name])
        _adopt_learned(method, name, share["learned"])
        ordered.append(share["reports"][name])
    return ordered


def _byte_codes(outcome):
    """``outcome`` with its codes as bytes when they fit (8 bits or fewer: every grid here) for the trip to the
    other ranks: the codes are a third of what a layer's outcome sends; `_int32_codes` restores them."""
    codes = None if outcome.quant is None else outcome.quant.codes
    if codes is None or codes.dtype != torch.int32 or codes.numel() == 0 or int(codes.min()) < 0 or int(codes.max()) > 255:
        return outcome
    return dataclasses.replace(outcome, quant=dataclasses.replace(outcome.quant, codes=codes.to(torch.uint8)))


def _int32_codes(outcome):
    if outcome.quant is None or outcome.quant.codes.dtype != torch.uint8:
        return outcome
    return dataclasses.replace(outcome, quant=dataclasses.replace(outcome.quant, codes=outcome.quant.codes.to(torch.int32)))


def _learned(method, names) -> dict[str, dict]:
    """What ``method`` learned about the layers ``names`` (its ``learned_state`` attributes, by layer)."""
    return {attr: {n: v for n, v in method.__dict__.get(attr, {}).items() if n in names} for attr in method.learned_state}


def _adopt_learned(method, name: str, learned: dict[str, dict]) -> None:
    """Take layer ``name``'s learned state from another rank's `_learned`, in layer order as one process has it."""
    for attr, values in learned.items():
        state = method.__dict__.setdefault(attr, {})
        state.pop(name, None)  # re-inserted in layer order, as one process would have
        if name in values:
            state[name] = values[name]


def plan_shares(ranks: Ranks, layers: dict[str, nn.Module]) -> dict[str, int | None]:
    """Each layer's rank, or None for a layer whose rows every rank shares: a layer costing more than an even
    share of the group (a block's lone ``down_proj``, or ``q_proj`` beside the smaller ``k_proj``/``v_proj``) is
    split, so no rank waits on it; the others go whole, the costliest first to the least loaded rank (a split
    costs every rank the work that does not shrink with the rows, e.g. GPTQ's factorization of H)."""
    costs = {name: solve_cost(module) for name, module in layers.items()}
    even = sum(costs.values()) / ranks.world
    split = {n for n, c in costs.items() if c > even and get_weight(layers[n]).shape[0] >= ranks.world}
    owner = ranks.assign({n: c for n, c in costs.items() if n not in split}) if len(split) < len(costs) else {}
    return {name: None if name in split else owner[name] for name in layers}


def solve_shares(ranks: Ranks, method, layers: dict[str, nn.Module], stats) -> list:
    """`solve_on_owners` for a `row_parallel` method: each rank transforms its whole layers and its contiguous
    share of the split layers' rows (each with the layer's whole statistics); the outcomes and learned state
    are gathered, the slices merged (`Method.merge_rows`), and every rank applies them (every slice of a layer
    records the same learned state: rank 0's is taken)."""
    plan = plan_shares(ranks, layers)
    mine = {}
    for name, module in layers.items():
        if plan[name] not in (None, ranks.rank):
            continue
        start = time.perf_counter()
        weight = method.layer_weight(module)
        if plan[name] is None:
            rows = torch.arange(weight.shape[0]).tensor_split(ranks.world)[ranks.rank]
            weight = weight[int(rows[0]) : int(rows[-1]) + 1]
        mine[name] = (method.transform_layer(name, weight, stats[name]), time.perf_counter() - start)
    compact = {name: (_byte_codes(outcome), seconds) for name, (outcome, seconds) in mine.items()}
    shares = ranks.gather({"outcomes": compact, "learned": _learned(method, mine)})
    reports = []
    for name, module in layers.items():
        if plan[name] is None:
            outcome = method.merge_rows([_int32_codes(share["outcomes"][name][0]) for share in shares])
            seconds = max(share["outcomes"][name][1] for share in shares)  # the slices ran side by side
        else:
            outcome, seconds = shares[plan[name]]["outcomes"][name]
            outcome = _int32_codes(outcome)
        _adopt_learned(method, name, shares[plan[name] or 0]["learned"])
        set_weight(module, outcome.weight)
        method.keep_outcome(name, outcome)
        reports.append(LayerReport(name, tuple(outcome.weight.shape), seconds, outcome.info))
    return reports
