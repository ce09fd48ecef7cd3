"""GGUF export orchestration: the plain writer with ggml's rounding (`gguf`), the calibrated methods that
run the engine first (`calibrated`: GPTQ and AWQ in the GGML grids), importance-matrix collection
(`imatrix`), and a recipe's ``export:`` section with its dispatch (`spec`), the only module that sees both
the plain and the calibrated path (so neither imports the other).

May import `compress.engine`, `compress.checkpoints`, the algorithm packages and `compress.errors`.
"""
