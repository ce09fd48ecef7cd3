"""Checkpoints on disk and the models they hold: lazy safetensors reading and streaming shard writing
(`shards`), model skeletons, decoder-block and linear-layer discovery (`model_io`), architecture data such
as the norm-to-linear maps (`architecture`), loading a whole model for inference, packed ones included
(`loading`, `packed`), inspection, calibration text and windows (`calibration`), and atomic output
directories with their config, side files and model cards (`output`).

The bottom layer of the orchestration: may import `compress.errors` and the algorithm packages
(`quantizers`, `pruners`, `formats`, `kernels`), nothing else of `compress`.
"""
