"""A GGUF file as an input model: converted, tensor by tensor, into an ordinary safetensors checkpoint.

transformers can load a GGUF file as a float model (``from_pretrained(dir, gguf_file=...)``), but it
dequantizes every tensor into one dict first. Here the same conversion runs as a stream, with
transformers' own pieces so the result is what transformers would build: the config and tokenizer from
``AutoConfig`` / ``AutoTokenizer`` with ``gguf_file``; the GGUF -> HF tensor names from
``get_gguf_hf_weights_map`` on a meta-device skeleton; each tensor dequantized by gguf-py
(``gguf.dequantize``), passed through the architecture's ``TensorProcessor`` (undoing llama.cpp's Q/K
RoPE permutation, Gemma's norm offset, stacked experts, ...), cast to ``dtype`` and streamed to the
`ShardedWriter`. At most one dequantized tensor is in memory at a time.

`convert_gguf` writes a checkpoint directory atomically (`OutputDir`); `checkpoint_source` gives any
MODEL argument as a directory, converting a ``.gguf`` file into a scratch directory that is removed when
the work is done.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from compress.checkpoints.gguf_file import dequantized, is_gguf_file, read_gguf  # noqa: F401  (is_gguf_file: used by callers)
from compress.checkpoints.output import OutputDir, dir_size
from compress.checkpoints.shards import ShardedWriter
from compress.errors import CompressError

log = logging.getLogger(__name__)
ProgressFn = Callable[[str, int, int], None]


class ConvertDtype(str, enum.Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"

    @property
    def torch(self) -> torch.dtype:
        return getattr(torch, self.value)


@dataclass
class ConvertResult:
    source: Path
    output: Path
    architecture: str
    tensors: int
    parameters: int
    source_types: dict[str, int]  # GGML type name -> tensors of that type in the file
    output_bytes: int
    seconds: float

    def to_dict(self) -> dict:
        return {**self.__dict__, "source": str(self.source), "output": str(self.output)}


def _open(path: Path):
    """gguf-py's reader and the file's architecture, or a one-line error."""
    reader = read_gguf(path)
    field = reader.fields.get("general.architecture")
    if field is None:
        raise CompressError(f"{path} has no general.architecture key: it is not a model GGUF file")
    try:
        return reader, bytes(field.parts[field.data[0]]).decode()
    except (IndexError, UnicodeDecodeError, TypeError):
        raise CompressError(f"{path}: its general.architecture key is not a UTF-8 string: the file is damaged") from None


def _check_architecture(path: Path, arch: str) -> None:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    supported = sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
    known = {a.replace("_", "") for a in supported} | set(supported)
    if arch.replace("-", "_") not in supported and arch.replace("-", "").replace("_", "") not in known:
        raise CompressError(
            f"{path.name} holds a {arch!r} model, which transformers cannot convert from GGUF: "
            f"it converts {', '.join(supported)}; start from the original safetensors checkpoint instead"
        )


def _skeleton(config):
    """The model on the meta device: names and shapes only."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config)


def convert_gguf(
    source: Path, output: Path, dtype: ConvertDtype = ConvertDtype.float32, overwrite: bool = False, progress: ProgressFn | None = None
) -> ConvertResult:
    """Write ``source`` (a GGUF file) as a safetensors checkpoint with config and tokenizer at ``output``."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map, load_gguf_checkpoint

    start = time.perf_counter()
    source = Path(source)
    reader, arch = _open(source)
    _check_architecture(source, arch)
    folder, name = str(source.parent), source.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        parsed = load_gguf_checkpoint(str(source), return_tensors=False)
    except Exception as exc:  # noqa: BLE001 — transformers and tokenizers raise many types on a bad file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CompressError(f"transformers cannot read the model in {source.name} ({first}): start from a safetensors checkpoint") from None
    skeleton = _skeleton(config)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
    names = get_gguf_hf_weights_map(skeleton, processor)
    shapes = {name: tuple(p.shape) for name, p in skeleton.state_dict().items()}  # once: meta tensors, no data
    expected = set(shapes)
    if getattr(config, "tie_word_embeddings", False):
        expected.discard("lm_head.weight")
    written, types, parameters = set(), {}, 0
    with OutputDir(output, overwrite, protect=source) as tmp:
        writer = ShardedWriter(tmp)
        for i, tensor in enumerate(reader.tensors):
            types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
            result = processor.process(
                weights=dequantized(source, tensor), name=tensor.name,
                tensor_key_mapping=names, parsed_parameters=parsed,
            )
            if result.name not in names:
                log.info("%s: %s has no counterpart in %s, skipped", source.name, tensor.name, type(skeleton).__name__)
                continue
            hf_name = names[result.name]
            value = torch.from_numpy(np.require(result.weights, requirements=["C", "W"])).to(dtype.torch)
            shape = shapes.get(hf_name)
            if shape is not None and tuple(value.shape) != shape:
                raise CompressError(f"{source.name}: {tensor.name} has shape {tuple(value.shape)} but the config gives {hf_name} {shape}: the file is inconsistent")
            writer.add(hf_name, value)
            written.add(hf_name)
            parameters += value.numel()
            if progress:
                progress("converting tensors", i + 1, len(reader.tensors))
        missing = sorted(expected - written)
        if missing:
            raise CompressError(f"{source.name} lacks {len(missing)} tensors the model needs (e.g. {missing[0]}): the file is incomplete")
        writer.close()
        config.dtype = dtype.value
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return ConvertResult(source, output, arch, len(written), parameters, types, dir_size(output), time.perf_counter() - start)


@contextlib.contextmanager
def checkpoint_source(model: Path, progress: ProgressFn | None = None) -> Iterator[Path]:
    """``model`` as a checkpoint directory: itself, or (a ``.gguf`` file) its float32 conversion in a scratch
    directory next to the system's temporary files, removed on exit."""
    model = Path(model)
    if not is_gguf_file(model):
        yield model
        return
    scratch = Path(tempfile.mkdtemp(prefix=f"compress-{model.stem}-"))
    try:
        yield convert_gguf(model, scratch / "model", progress=progress).output
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
