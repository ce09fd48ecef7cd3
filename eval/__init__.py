"""Evaluation: perplexity and KL divergence against a reference (with a simulated quantized KV cache,
`kv_cache`), the reference model, reports."""
