"""Checkpoints on disk and the models they hold: lazy safetensors reading and streaming shard writing
(`shards`), model skeletons, decoder-block and linear-layer discovery (`model_io`), on-disk names and per-expert
MoE layers by transformers' own conversion mappings (`conversion`, `experts`), architecture data such
as the norm-to-linear maps (`architecture`), the attention modules that write the KV cache and a tap on
them (`attention`), loading a whole model for inference, packed ones included
(`loading`, `packed`), inspection, calibration text and windows (`calibration`), GGUF files as inputs
(`gguf_file`, `gguf_source`), atomic and locked output directories with their config, side files and model
cards (`output`), and their SHA-256 manifests, input digests and verification (`integrity`).

The bottom layer of the orchestration: may import `compress.errors` and the algorithm packages
(`quantizers`, `pruners`, `formats`, `kernels`), nothing else of `compress`.
"""
