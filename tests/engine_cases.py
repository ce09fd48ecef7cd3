"""Engine runs shared by the engine's tests: one stage over every block's linear layers, and RTN variants that
make the engine calibrate and propagate."""

from __future__ import annotations

from compress.checkpoints.model_io import open_model, quantizable_layers
from compress.checkpoints.shards import ShardedWriter
from compress.engine.block_engine import Engine, Stage
from compress.engine.methods.rtn import RTN
from compress.engine.statistics import Stat


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
