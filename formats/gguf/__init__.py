"""GGUF: llama.cpp's single-file format. One codec per GGML type (``f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1
q2_k q3_k q4_k q5_k q6_k iq3_xxs iq3_s iq4_nl iq4_xs``) sharing the size table in `sizes`, dispatched by `codecs`; the per-tensor
type plan (`plan`), tokenizer metadata (`vocab`) and imatrix files (`imatrix`). The model-level writer
is `compress.export.gguf`."""
