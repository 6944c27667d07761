"""GGUF -> Hugging Face folder conversion, and the cache that holds converted models.

The runtime loads only Hugging Face folders (``config.json`` + ``model.safetensors`` +
``tokenizer.json``). A GGUF file is converted once into such a folder: every tensor is
dequantized to float32 with the ``gguf`` package and renamed to the Hugging Face names,
the q/k rows that llama.cpp permuted for its RoPE layout are put back in Hugging Face's
``rotate_half`` order, and the tokenizer is rebuilt from the GGUF vocabulary and merges.

Public entry points:

- :func:`convert_gguf` writes one folder (atomically: temp dir + rename).
- :func:`default_model_folder` converts the bundled SmolLM2-135M-Instruct once into the cache.
- :func:`resolve_model_path` turns a ``--model`` value (``None``/"default", a ``.gguf`` file or
  a folder) into a Hugging Face folder.

Modules: :mod:`~gpu.gguf.reader` (GGUF header and tensor parsing), :mod:`~gpu.gguf.weights`
(tensor names, dequantization, q/k un-permutation), :mod:`~gpu.gguf.hf_config` (``config.json``),
:mod:`~gpu.gguf.tokenizer` (``tokenizer.json``), :mod:`~gpu.gguf.convert` (writing the folder)
and :mod:`~gpu.gguf.cache` (the conversion cache and model specs).
"""

from __future__ import annotations

from gpu.cache_dir import cache_root
from gpu.gguf.cache import (
    DEFAULT_FOLDER_NAME,
    DEFAULT_GGUF_NAME,
    DEFAULT_INSTALL_HINT,
    DEFAULT_PACKAGE,
    DEFAULT_SPECS,
    default_gguf_path,
    default_model_folder,
    resolve_model_path,
)
from gpu.gguf.convert import CONVERTER_VERSION, MARKER_NAME, convert_gguf
from gpu.gguf.reader import GGUF_MAGIC
from gpu.gguf.weights import unpermute_rope_rows

__all__ = [
    "CONVERTER_VERSION",
    "DEFAULT_FOLDER_NAME",
    "DEFAULT_GGUF_NAME",
    "DEFAULT_INSTALL_HINT",
    "DEFAULT_PACKAGE",
    "DEFAULT_SPECS",
    "GGUF_MAGIC",
    "MARKER_NAME",
    "cache_root",
    "convert_gguf",
    "default_gguf_path",
    "default_model_folder",
    "resolve_model_path",
    "unpermute_rope_rows",
]
