"""Dequant (and dequant-GEMM) kernels with a torch reference for each."""
