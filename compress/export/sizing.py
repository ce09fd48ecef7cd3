"""The bytes of a GGUF file that a per-tensor plan does not choose: metadata, tokenizer, tensor index, the
tensors left out of the plan (norms, ...), and alignment; so ``--target-size`` can mean the whole file.

The header, metadata and tensor index are written for real into a scratch file by the export's own
functions (their size does not depend on the tensor types); tensor data is added from the row sizes.
Left out: the provenance record (its length varies by a few hundred bytes; `PROVENANCE_ALLOWANCE`) and
the alignment padding after each planned tensor (at most ``alignment − 1`` bytes; half counted).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from compress.export.gguf import ExportConfig, file_type
from compress.export.gguf_tensors import tensor_plan
from compress.export.gguf_arch import ARCHITECTURES, add_metadata, read_config
from compress.checkpoints.shards import CheckpointReader
from compress.formats.gguf.sizes import row_bytes
from compress.formats.gguf.vocab import add_vocab

PROVENANCE_ALLOWANCE = 1024


def fixed_gguf_bytes(config: ExportConfig, planned: set[str]) -> int:
    """File bytes of ``config``'s export outside the tensors named in ``planned`` (GGUF names)."""
    import gguf

    hf = read_config(config.model)
    arch = ARCHITECTURES[hf["model_type"]]
    entries = tensor_plan(CheckpointReader(config.model), hf, config.target, config.has_imatrix, config.types)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "header.gguf"
        writer = gguf.GGUFWriter(path, arch)
        try:
            add_metadata(writer, arch, hf, file_type(config, entries))
            add_vocab(writer, config.model, hf["vocab_size"])
            for _, gname, kind, shape in entries:
                rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
                nbytes = rows * row_bytes(kind, shape[-1])
                byte_shape = [*shape[:-1], row_bytes(kind, shape[-1])]
                writer.add_tensor_info(gname, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=gguf.GGMLQuantizationType(int(kind)))
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            alignment = writer.data_alignment
        finally:
            writer.close()
        header = path.stat().st_size
    rest = 0
    for _, gname, kind, shape in entries:
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        nbytes = rows * row_bytes(kind, shape[-1])
        padding = -nbytes % alignment
        rest += padding if gname not in planned else alignment // 2
        if gname not in planned:
            rest += nbytes
    return header + rest + PROVENANCE_ALLOWANCE
