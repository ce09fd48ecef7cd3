"""Pruning algorithms (magnitude, SparseGPT, Wanda), unstructured and N:M masks."""
