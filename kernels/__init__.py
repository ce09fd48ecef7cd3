"""Dequant (and dequant-GEMM) kernels with a torch reference for each, and the CPU's compiled bfloat16 attention."""
