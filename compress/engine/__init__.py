"""The layer-by-layer engine (`block_engine`): capture block-0 inputs, collect per block the statistics
each method declares (`statistics`, the one statistics module), let the methods transform the block,
propagate the compressed outputs, and stream each finished block to the writer. Also the method base
classes, the one method registry (`registry`) and the built-in methods (`methods`), which adapt the pure
algorithms to the engine; the KV-cache scale calibration that watches the compressed blocks run
(`kv_calibration`); the progress record a killed run resumes from (`journal`); the forward passes a block
runs through (`passes`).

May import `compress.checkpoints`, the algorithm packages and `compress.errors`; never `export`, `run`
or `cli`. The engine never tests a method's name.
"""
