"""AWQ and GPTQ checkpoints (``gpu/prequantized.py``): a tiny model's linears quantized and
packed as AutoAWQ and AutoGPTQ write them (the packers below follow their layouts, written
here from the formats, not from the loader), loaded, and held to the same weights
dequantized into an ordinary folder: exactly where they are dequantized, within fp16's
rounding of the zero point where they stay Q4_1 blocks; transformers on that folder is the
oracle. Groups that do not follow the input order (GPTQ's desc_act) are dequantized."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu.attention.metadata import SeqChunk
from gpu.config import ModelError
from gpu.cpu_kernels import load as load_cpu_kernels
from gpu.linear import BlockLinear, DenseLinear
from gpu.loader import load_model
from gpu.prequantized import Prequantized
from gpu.quant import BlockWeight
from gpu.runner import ModelRunner
from tests.models import hf_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantize(w: torch.Tensor, g_idx: torch.Tensor, sym: bool = False) -> tuple[Any, Any, Any]:
    """4-bit per group of input features, asymmetric or (``sym``, zero point 8) symmetric:
    codes ``[in, out]``, zero points and fp16 scales ``[groups, out]``."""
    out_f = w.shape[0]
    groups = int(g_idx.max()) + 1
    wt = w.t().float()  # [in, out]
    scales = torch.empty(groups, out_f)
    zeros = torch.empty(groups, out_f, dtype=torch.int64)
    for g in range(groups):
        rows = wt[g_idx == g]
        if sym:
            s = (rows.abs().amax(0) / 7.5).clamp(min=1e-6).half().float()
            scales[g], zeros[g] = s, 8
            continue
        lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-6).half().float()
        scales[g], zeros[g] = s, torch.round(-lo / s).clamp(1, 15).long()
    codes = torch.round(wt / scales[g_idx] + zeros[g_idx]).clamp(0, 15).long()
    return codes, zeros, scales.half()


def pack_columns(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``[r, 8c]`` nibbles -> int32 ``[r, c]``: packed position i takes column ``order[i]``."""
    r, c = values.shape
    out = torch.zeros(r, c // 8, dtype=torch.int64)
    for col in range(c // 8):
        for i in range(8):
            out[:, col] |= values[:, col * 8 + order[i]] << (4 * i)
    return out.to(torch.int32)  # (wraps as C's int32 does)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """``[8r, c]`` nibbles -> int32 ``[r, c]``, eight consecutive rows per int32."""
    r8, c = values.shape
    out = torch.zeros(r8 // 8, c, dtype=torch.int64)
    for i in range(8):
        out |= values[i::8] << (4 * i)
    return out.to(torch.int32)


def write_quantized(
    base: Path,
    folder: Path,
    method: str,
    group: int,
    desc_act: bool = False,
    v2: bool = False,
    sym: bool = False,
) -> Path:
    """``base`` with its decoder linears as ``method`` writes them; the weights they stand
    for, dequantized, in ``folder``/reference (an ordinary folder)."""
    reference = folder / "reference"
    for target in (folder, reference):
        shutil.copytree(base, target, dirs_exist_ok=True)
    tensors = load_file(str(base / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(7)
    for name, w in tensors.items():
        if not any(f".{p}.weight" in name for p in LINEARS):
            packed[name], plain[name] = w, w
            continue
        prefix = name.removesuffix(".weight")
        in_f = w.shape[1]
        size = in_f if group == -1 else group
        g_idx = torch.arange(in_f) // size
        if desc_act:
            g_idx = g_idx[torch.randperm(in_f, generator=gen)]
        codes, zeros, scales = quantize(w, g_idx, sym)
        plain[name] = ((codes - zeros[g_idx]).float() * scales[g_idx].float()).t().contiguous()
        if method == "awq":
            packed[f"{prefix}.qweight"] = pack_columns(codes, AWQ_ORDER)
            packed[f"{prefix}.qzeros"] = pack_columns(zeros, AWQ_ORDER)
        else:
            packed[f"{prefix}.qweight"] = pack_rows(codes)
            stored = zeros if v2 else (zeros - 1) & 15  # (the original format: z - 1)
            packed[f"{prefix}.qzeros"] = pack_columns(stored, list(range(8)))
            packed[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
        packed[f"{prefix}.scales"] = scales
    save_file(packed, str(folder / "model.safetensors"))
    save_file(plain, str(reference / "model.safetensors"))
    config = json.loads((base / "config.json").read_text())
    q: dict[str, Any] = {"quant_method": method, "bits": 4, "group_size": group}
    if method == "awq":
        q |= {"version": "gemm", "zero_point": True}
    else:
        q |= {"desc_act": desc_act, "sym": sym}
        q |= {"checkpoint_format": "gptq_v2"} if v2 else {}
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": q}))
    return folder


CASES = {  # method, group size, desc_act, gptq_v2, sym
    "awq g32": ("awq", 32, False, False, False),
    "awq g64": ("awq", 64, False, False, False),
    "gptq g64": ("gptq", 64, False, False, False),
    "gptq v2 whole rows": ("gptq", -1, False, True, False),
    "gptq desc_act": ("gptq", 32, True, False, False),
    "gptq sym": ("gptq", 128, False, False, True),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request: Any, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("prequantized") / request.param.replace(" ", "-")
    return request.param, write_quantized(tiny_llama, folder, *CASES[request.param])


def logits(model: Any, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, 16, 4)
    return runner.execute([SeqChunk(tuple(range(16)), 0, len(ids))], [ids], all_logits=True)


def test_the_weights_are_the_checkpoints_and_blocks_where_groups_allow(checkpoint) -> None:
    """Aligned groups are blocks: Q4_0 (exact) for a symmetric checkpoint, else Q4_1, whose
    values are the reference's up to fp16's rounding of s * z (2^-11 of it); groups across
    blocks (desc_act) are dequantized, exactly. Dequantized (--quantization none), the model
    is transformers' on the reference folder to that rounding."""
    case, folder = checkpoint
    ids = [1, 17, 200, 45, 3, 99, 311, 8]
    ours = load_model(folder, quantization="none", cpu_kernels=False, progress=False)
    with torch.no_grad():
        want = hf_model(folder / "reference")(torch.tensor([ids])).logits[0].float()
    exact = "desc_act" in case or "sym" in case
    tol = 2e-4 if exact else 5e-3
    torch.testing.assert_close(logits(ours, ids), want, atol=tol, rtol=1e-4)
    pre = Prequantized.from_folder(folder)
    assert pre is not None
    tensors = load_file(str(folder / "model.safetensors"))
    linear = "model.layers.0.mlp.down_proj"
    parts = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.startswith(linear + ".")}
    weight = pre.weight(linear, parts, (64, 128))
    want_w = load_file(str(folder / "reference" / "model.safetensors"))[linear + ".weight"]
    if "desc_act" in case:
        assert isinstance(weight, torch.Tensor)  # (groups across blocks: dequantized)
        torch.testing.assert_close(weight, want_w, atol=0, rtol=0)
        return
    assert isinstance(weight, BlockWeight)
    assert weight.qtype == ("Q4_0" if "sym" in case else "Q4_1")
    torch.testing.assert_close(weight.dequantize(), want_w, atol=0 if exact else 2.5e-4, rtol=0)


def test_int4_keeps_the_checkpoints_blocks(checkpoint) -> None:
    """--quantization int4 on a 4-bit checkpoint runs its blocks as they are (quantizing
    them again would round each block of 32 onto a new grid)."""
    case, folder = checkpoint
    if "desc_act" in case:
        return
    model = load_model(folder, quantization="int4", progress=False)
    linear = model.layers[0].down_proj
    assert isinstance(linear, BlockLinear) and linear.format == "int4"
    want = load_file(str(folder / "reference" / "model.safetensors"))
    got = linear.dequantized_weight()
    reference = want["model.layers.0.mlp.down_proj.weight"]
    torch.testing.assert_close(got, reference, atol=0 if "sym" in case else 2.5e-4, rtol=0)


def test_a_group_size_the_tensors_contradict_and_an_older_config_file(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """A config whose group_size disagrees with the scales is an error (every weight would
    take another group's scale); AutoGPTQ's quantize_config.json is read where config.json
    has no quantization_config."""
    folder = write_quantized(tiny_llama, tmp_path / "g64", "gptq", 64, v2=True)
    raw = json.loads((folder / "config.json").read_text())
    wrong = {**raw, "quantization_config": {**raw["quantization_config"], "group_size": 32}}
    (folder / "config.json").write_text(json.dumps(wrong))
    with pytest.raises(ModelError, match="groups of scales"):
        load_model(folder, progress=False)
    q = raw.pop("quantization_config")
    q.pop("quant_method")
    (folder / "config.json").write_text(json.dumps(raw))
    (folder / "quantize_config.json").write_text(json.dumps(q))
    model = load_model(folder, quantization="auto", progress=False)
    assert isinstance(model.layers[0].down_proj, BlockLinear)


@pytest.mark.skipif(load_cpu_kernels() is None, reason="the CPU kernels did not build")
def test_auto_runs_the_blocks_on_the_cpu_kernels(checkpoint) -> None:
    """auto keeps aligned groups as Q4_1 blocks run by the C kernels (int8 activations):
    each linear the same math in torch to float rounding, the model close to the reference
    folder's fp32."""
    case, folder = checkpoint
    ids = [1, 17, 200, 45, 3, 99, 311, 8, 64, 65, 66, 7, 300, 12, 5, 140]
    auto = load_model(folder, quantization="auto", progress=False)
    formats = {m.format for m in auto.modules() if isinstance(m, (BlockLinear, DenseLinear))}
    kind = "gguf-q4_0" if "sym" in case else "gguf-q4_1"
    assert (kind in formats) == ("desc_act" not in case), formats
    # each linear against the same math in torch, on the same input (whole models drift
    # apart: an input 1e-7 away can round its int8 activations to the next code)
    torch_math = load_model(folder, quantization="gguf", cpu_kernels=False, progress=False)
    plain = dict(torch_math.named_modules())
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(3))
    for name, linear in auto.named_modules():
        if isinstance(linear, BlockLinear):
            got, want = linear(x[:, : linear.in_features]), plain[name](x[:, : linear.in_features])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    native = logits(auto, ids)
    ref = logits(load_model(folder / "reference", quantization="none", progress=False), ids)
    assert float((native - ref).abs().max() / ref.abs().max()) < 5e-2
    assert (native.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize(
    ("config", "text"),
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8 bits"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "marlin"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero points"),
        ({"quant_method": "fp8"}, "'fp8' are not supported"),
    ],
)
def test_checkpoints_not_read_are_refused(tiny_llama: Path, tmp_path: Path, config, text) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "quantization_config": config}))
    with pytest.raises(ModelError, match=text):
        load_model(folder, progress=False)


def test_a_linears_parts_in_two_shard_files(tiny_llama: Path, tmp_path: Path) -> None:
    """Each linear is converted once all its parts are read, whichever files hold them."""
    folder = write_quantized(tiny_llama, tmp_path / "awq", "awq", 32)
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    first = {k: v for k, v in tensors.items() if not k.endswith((".scales", ".qzeros"))}
    second = {k: v for k, v in tensors.items() if k not in first}
    save_file(first, str(folder / "model-00001-of-00002.safetensors"))
    save_file(second, str(folder / "model-00002-of-00002.safetensors"))
    index = {k: "model-00001-of-00002.safetensors" for k in first}
    index |= {k: "model-00002-of-00002.safetensors" for k in second}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    ids = [1, 17, 200, 45, 3, 99, 311, 8]
    split = logits(load_model(folder, quantization="none", progress=False), ids)
    ref = logits(load_model(folder / "reference", quantization="none", progress=False), ids)
    torch.testing.assert_close(split, ref, atol=5e-3, rtol=1e-4)
