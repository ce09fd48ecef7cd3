"""Engine runs shared by the engine's tests: one stage over every block's linear layers, and RTN variants that
make the engine calibrate and propagate."""

from __future__ import annotations

import torch

from compress.checkpoints.model_io import open_model, quantizable_layers
from compress.checkpoints.shards import ShardedWriter
from compress.engine.block_engine import Engine, Stage
from compress.engine.methods.rtn import RTN
from compress.engine.methods.base import LayerOutcome, Method
from compress.engine.statistics import Stat

ALL_STATS = frozenset(Stat)


class CalibratedRTN(RTN):
    """RTN that asks for statistics, so the engine must propagate quantized outputs block to block."""

    @property
    def needs(self):
        return frozenset({Stat.HESSIAN})


def run_engine(model_dir, out_dir, method, calibration=None, shard_bytes=1 << 30, batch_size=3, **engine):
    """``method`` on every block's linear layers of ``model_dir``, written to ``out_dir``; ``engine``: more `Engine` arguments."""
    handle = open_model(model_dir)
    names = [handle.block_name(i) for i in range(len(handle.blocks))]
    stages = [Stage(method, quantizable_layers(handle.model, names))]
    out_dir.mkdir(exist_ok=True)
    writer = ShardedWriter(out_dir, shard_bytes)
    result = Engine(handle, stages, batch_size=batch_size, **engine).run(writer, calibration)
    writer.close()
    return handle, result


class SequentialRTN(CalibratedRTN):
    @property
    def sequential(self):
        return True


class Observe(Method):
    """Needs every statistic, changes nothing."""

    @property
    def needs(self):
        return ALL_STATS

    def transform_layer(self, name, weight, stats):
        return LayerOutcome(weight)


def reference_hessians(model, layer_names, calibration):
    """2/n Σ x xᵀ per layer, in float64, from hooks on a whole model run on the calibration tokens."""
    sums, counts, handles = {}, {}, []
    modules = dict(model.named_modules())
    for name in layer_names:
        def hook(_m, args, name=name):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.t() @ x
            counts[name] = counts.get(name, 0) + x.shape[0]
        handles.append(modules[name].register_forward_pre_hook(hook))
    with torch.no_grad():
        model(input_ids=calibration, use_cache=False)
    for h in handles:
        h.remove()
    return {n: 2 * sums[n] / counts[n] for n in layer_names}


class StatsSpy(Observe):
    def __init__(self):
        super().__init__(Observe.Config())
        self.seen = {}

    def transform_layer(self, name, weight, stats):
        self.seen[name] = {k: v.clone() for k, v in stats.items()}
        return LayerOutcome(weight)
