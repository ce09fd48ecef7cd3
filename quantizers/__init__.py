"""Quantization algorithms: pure functions on one layer's weight and statistics."""
