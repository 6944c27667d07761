"""Load a Hugging Face model folder (config.json + one or many *.safetensors) into ``CausalLM``.

GGUF files are first converted to such a folder (``gpu.gguf``), so there is one load path;
with ``--quantization gguf`` (or ``auto`` on CPU) the linear weights come from the folder's
source GGUF file in their own blocks instead (``gpu.gguf.blocks``). An AWQ or GPTQ folder's
linears are read into the same blocks (``gpu.prequantized``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from gpu.config import ModelConfig, ModelError
from gpu.cpu_kernels import load as load_cpu_kernels
from gpu.formats import check_quantization
from gpu.gguf.blocks import gguf_source, in_source, read_block_weights
from gpu.linear import blocks_run_on
from gpu.model import CausalLM, Weight, expected_shapes
from gpu.parallel.group import TensorParallel
from gpu.prequantized import PARTS, Prequantized
from gpu.quant import BlockWeight


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [folder / n for n in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelError(f"{folder}: weight files listed in the index are missing: {absent}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder} holds no *.safetensors weight files")
    return files


def load_weights(
    folder: Path,
    config: ModelConfig,
    progress: bool = True,
    skip: frozenset[str] = frozenset(),
    prequantized: Prequantized | None = None,
) -> dict[str, Weight]:
    """Read only the tensors the model uses (less ``skip``); a progress bar shows on a
    terminal. ``prequantized``: the folder's AWQ or GPTQ linears, read from their parts into
    blocks (``gpu.prequantized``)."""
    shapes = expected_shapes(config)
    wanted = set(shapes) - skip
    quantized = {n.removesuffix(".weight") for n in wanted if n.endswith(".weight")}
    weights: dict[str, Weight] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}  # a quantized linear's name -> its parts
    files = weight_files(folder)
    show = progress and sys.stderr.isatty()
    for path in tqdm(files, desc=f"loading {folder.name}", unit="file", disable=not show):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    linear, _, part = name.rpartition(".")
                    if name in wanted:
                        weights[name] = f.get_tensor(name)
                    elif prequantized is not None and part in PARTS and linear in quantized:
                        parts.setdefault(linear, {})[part] = f.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types
            raise ModelError(f"cannot read weight file {path}: {exc}") from exc
        # each linear converted once its parts are in (its packed tensors then let go: the
        # peak is a file's parts more than the blocks, not the whole checkpoint's)
        convert_parts(parts, weights, shapes, prequantized, complete_only=True)
    convert_parts(parts, weights, shapes, prequantized, complete_only=False)
    for name, tensor in weights.items():
        if isinstance(tensor, torch.Tensor) and tensor.dtype not in (
            torch.float32, torch.float16, torch.bfloat16,
        ):  # fmt: skip
            # quantized codes (fp8, int8) whose scales live in other tensors: read as values,
            # they gave logits of nothing
            raise ModelError(
                f"{name} is stored as {tensor.dtype}: a pre-quantized checkpoint, not supported "
                "(load the unquantized weights; --quantization quantizes them at load time)"
            )
    return weights


def convert_parts(
    parts: dict[str, dict[str, torch.Tensor]],
    weights: dict[str, Weight],
    shapes: dict[str, tuple[int, ...]],
    prequantized: Prequantized | None,
    complete_only: bool,
) -> None:
    """The AWQ / GPTQ linears whose parts are read (all of them, unless ``complete_only``),
    converted into ``weights`` and dropped from ``parts``."""
    if prequantized is None:
        return
    needed = {"qweight", "qzeros", "scales"} | ({"g_idx"} if prequantized.desc_act else set())
    for linear in list(parts):
        if complete_only and not needed <= set(parts[linear]):
            continue
        its_parts = parts.pop(linear)
        name = f"{linear}.weight"
        if name not in weights:
            out_features, in_features = shapes[name]
            weights[name] = prequantized.weight(linear, its_parts, (out_features, in_features))


def load_model(
    folder: Path | str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    progress: bool = True,
    quantization: str = "none",
    cpu_kernels: bool = True,
    tp: TensorParallel | None = None,
) -> CausalLM:
    """fp32 on CPU (bf16 matmul is ~500x slower on these CPUs), bf16 on CUDA unless given.

    ``quantization`` (``none`` | ``int8`` | ``int4`` | ``fp8``) quantizes every linear layer
    at load time, from whatever the checkpoint holds; ``gguf`` keeps a GGUF model's own blocks
    (Q4_0 / Q4_1 / Q8_0; other types dequantized); ``auto`` is ``gguf`` for a GGUF model on
    CPU where the kernels run, else ``none`` (the flags' default; this function's is ``none``,
    the reference the tests compare with). ``cpu_kernels`` uses the fused kernels of
    ``gpu.cpu_kernels`` on CPU where they build (False: plain torch ops, the reference).
    ``tp``: build this rank's share of a tensor-parallel replica (``gpu.parallel``).
    """
    check_quantization(quantization)
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelError(f"model folder {folder} does not exist")
    config = ModelConfig.from_folder(folder)
    prequantized = Prequantized.from_folder(folder)
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    kernels = None
    if cpu_kernels and torch.device(device).type == "cpu":
        kernels = load_cpu_kernels()
    source = gguf_source(folder)
    if quantization == "gguf" and source is None and prequantized is None:
        raise ModelError(
            f"--quantization gguf needs a model converted from a GGUF file that is still there, "
            f"or an AWQ or GPTQ checkpoint; {folder} is neither (use auto, none, int8 or int4)"
        )
    if quantization == "auto" and prequantized is not None:
        # a 4-bit checkpoint stays 4-bit wherever blocks run (its bf16 form may not fit)
        quantization = "gguf" if blocks_run_on(torch.device(device), dtype) else "none"
    if quantization == "auto":
        quantization = "gguf" if source is not None and kernels is not None else "none"
    kept = in_source(folder)  # a mixture of experts' experts, left in the GGUF file
    if kept and source is None:
        raise ModelError(
            f"{folder} reads its experts from the GGUF file it was converted from, which is "
            "gone or has changed: load the .gguf file again (it is converted anew)"
        )
    blocks: dict[str, BlockWeight] = {}
    if source is not None and (quantization == "gguf" or kept):
        wanted = set(expected_shapes(config))
        blocks = read_block_weights(source, wanted if quantization == "gguf" else set(kept))
    weights: dict[str, Weight] = load_weights(
        folder, config, progress, frozenset(blocks), prequantized
    )
    weights.update(blocks)
    model = CausalLM(config, weights, device, dtype, quantization, kernels, tp)
    del weights, blocks
    release_freed_memory()
    return model


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``).

    Why: loading makes each weight two or three times (read, fused q/k/v or gate/up, packed
    for the kernels) and frees all but the last; those tensors (mostly under glibc's 32 MB
    mmap threshold once it has grown) come from the heap, and glibc keeps freed heap memory
    mapped. On the default model that was ~0.6 GB of the executor's resident memory beyond
    its weights and KV pool. Elsewhere (no glibc) this does nothing."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):
        pass
