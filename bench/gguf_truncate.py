"""A GGUF file cut to its first N decoder blocks, every kept tensor's bytes copied as they are.

    python bench/gguf_truncate.py IN.gguf OUT.gguf --blocks 8

The metadata is copied with ``{arch}.block_count`` set to N; tensors named ``blk.{i}.*`` with ``i >= N`` are
dropped, the others (embeddings, output norm, the kept blocks) keep their type and bytes. What it is for: taking
the first blocks of a real model where the whole file cannot go (the GPU machine's 64 MiB transfer:
SmolLM2-135M's first 8 blocks are 48 MB, 45 MB under ``xz -9``), then ``compress convert`` there.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np


def truncate_gguf(src: Path, dst: Path, blocks: int) -> int:
    """Write ``dst``; returns how many tensors it holds."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the header's own fields, and the one GGUFWriter writes itself
        value = blocks if name == f"{arch}.block_count" else field.contents()
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    kept = 0
    for tensor in reader.tensors:
        block = re.match(r"blk\.(\d+)\.", tensor.name)
        if block and int(block.group(1)) >= blocks:
            continue
        # a quantized tensor's data is its bytes, [rows, bytes per row]: GGUFWriter derives the shape from them
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
        kept += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--blocks", type=int, required=True)
    args = ap.parse_args()
    print(f"{args.dst}: {truncate_gguf(args.src, args.dst, args.blocks)} tensors")


if __name__ == "__main__":
    main()
