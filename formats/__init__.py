"""On-disk codecs: packed safetensors layouts, GGUF, bit packing."""
