"""Check the FlashInfer attention backend on a CUDA host, and time decode steps.

Nine sections, each independent (one failing does not stop the others):

- kernels: FlashInferPagedAttention (bf16) against TorchPagedAttention (fp32, same device) on
  random paged batches that mix prompt chunks and decodes, pure-decode batches (tensor-core and
  CUDA-core decode) and pure-prefill batches; page_size 16; GQA head configs such as 9/3
  (SmolLM2) and 32/8. Also checks that the appended KV pages match bit for bit
  (``kernel_cases.py``).
- model: a whole model on CUDA in bf16 with FlashInfer against the same model on the CPU in fp32
  with the torch backend: every generated position's logits (teacher-forced on the CPU's greedy
  tokens, so one early flip does not derail the rest) and greedy agreement. The same CUDA model
  with the torch backend in bf16 runs alongside as the bf16 baseline, and FlashInfer's fast paths
  (``FAST_PATH_RUNNERS``: CUDA graphs, the fused rotary + KV append, both) must meet the same
  bound. Batches are staggered and chunked, so steps mix prefill chunks and decodes before ending
  in pure decode (``model_agreement.py``).
- qwen3: the model section on a random model of Qwen3-0.6B's shape (4 layers): its q/k head
  norms through FlashInfer, the CUDA graphs and the fused rotary + KV append.
- qwen3_moe: the same on a random model of Qwen3-30B-A3B's shape (2 layers, 32 experts, 8 per
  token): the routing and the grouped Triton matmuls of `gpu/triton_moe.py` in bf16 (eager:
  no CUDA graphs); then a decode step at each batch size with the grouped experts and with
  one expert at a time (``moe_timing.py``).
- timing: one decode step (every sequence at ~512 tokens of context) at batch 1/8/64 for each
  attention backend, timed with CUDA events around whole ``ModelRunner.forward`` calls
  (plan + all layers + lm_head, host overhead included) (``decode_timing.py``).
- graphs: the same decode timing on a Llama-3-8B-shaped model with random bf16 weights, eager
  and replayed from CUDA graphs (also with the fused rotary + KV append, the other decode
  wrapper, cuBLASLt), as a fraction of the measured HBM bandwidth, and batch 1's kernels by
  kind (``decode_graphs.py``, ``kernel_profile.py``).
- overlap: whole engine steps one after another against overlapped (``gpu/overlap.py``) on the
  same requests: tokens/s and whether both produced the same tokens (``engine_overlap.py``);
  the graphs section runs it on the 8B shape too.
- quant: activation rows quantized to fp8 / int8 by one Triton kernel against the torch kernels
  it replaces: the same bytes, and the time of each (``row_quant.py``).
- sampling: a mixed batch sampled with no host wait inside the sampler (``sampler_waits.py``).
- formats, last (its Triton kernels tune for minutes the first time): the section model in
  int8 (weight-only and W8A8) and int4 against the CPU reference, and the Llama-3-8B shapes'
  matmuls in bf16, int8 (both paths) and Q4_1 blocks (``quant_formats.py``).

The default model is SmolLM2-135M (``gpu.gguf.resolve_model_path(None)``); where it is not
installed (an offline GPU host) a random model of SmolLM2's exact shape stands in, which checks
the same code paths and times the same work, and the JSON says so (``check_model.py``).
FlashInfer's JIT modules are compiled up front, in parallel (``prebuild.py``); ``common.py``
holds what the sections share (``Report`` writes the JSON).

Usage (see tools/gpu_check/README.md for the offline GPU host):
    python -m tools.gpu_check.check_flashinfer --out out/flashinfer_check.json [--model PATH]
Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tools.gpu_check.check_model import (
    QWEN3_CONFIG,
    QWEN3_MOE_CONFIG,
    resolve_model,
    write_synthetic_model,
)
from tools.gpu_check.common import Report, parse_ints
from tools.gpu_check.decode_timing import run_timing_section
from tools.gpu_check.kernel_cases import (
    KERNEL_TOL,
    flashinfer_factory,
    kernel_cases,
    kernels_section,
)
from tools.gpu_check.model_agreement import LOGITS_TOL, run_model_section
from tools.gpu_check.moe_timing import run_moe_timing
from tools.gpu_check.prebuild import export_aot, prebuild_kernels

SECTIONS = (
    "kernels",
    "model",
    "qwen3",
    "qwen3_moe",
    "timing",
    "overlap",
    "quant",
    "sampling",
    "graphs",
    "formats",
)


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["capability"] = list(torch.cuda.get_device_capability(0))
    for name in ("flashinfer", "tvm_ffi"):
        try:
            module = __import__(name)
            env[name] = getattr(module, "__version__", "?")
        except Exception as exc:
            env[name] = f"unavailable: {exc!r}"
    nvcc = shutil.which("nvcc")
    env["nvcc"] = nvcc
    env["flashinfer_cuda_arch_list"] = os.environ.get("FLASHINFER_CUDA_ARCH_LIST")
    return env


def parse_pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        hq, hkv = item.split("/")
        pairs.append((int(hq), int(hkv)))
    return pairs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("out/flashinfer_check.json"))
    p.add_argument(
        "--model", default="default", help='"default" (SmolLM2), "synthetic", a folder or .gguf'
    )
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--head-configs", default="9/3,32/8", help="q/kv head pairs")
    p.add_argument("--head-dims", default="64")
    p.add_argument("--kernel-tol", type=float, default=KERNEL_TOL)
    p.add_argument("--logits-tol", type=float, default=LOGITS_TOL)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-prebuild", action="store_true")
    p.add_argument(
        "--prebuild-only", action="store_true", help="only compile the JIT kernels (staging)"
    )
    p.add_argument(
        "--export-aot",
        type=Path,
        metavar="DIR",
        help="compile the kernels without a GPU into DIR/flashinfer/data/aot (make_carry.sh)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.export_aot is not None:
        for path in export_aot(args.export_aot, parse_ints(args.head_dims), torch.bfloat16):
            print(f"[export-aot] {path} ({path.stat().st_size} bytes)")
        return 0
    sections = set(args.sections.split(","))
    report = Report(args.out)
    report.set("env", environment())
    report.set("args", vars(args))
    print(json.dumps(report.data["env"], indent=1), flush=True)
    if not torch.cuda.is_available():
        print("this check needs a CUDA GPU", file=sys.stderr)
        report.set("ok", False)
        return 1
    device = torch.device("cuda", 0)
    torch.manual_seed(args.seed)
    head_configs = parse_pairs(args.head_configs)
    head_dims = parse_ints(args.head_dims)
    # The kernels the sections run: the model's head size 64 (SmolLM2), 128 for the graphs
    # section's 8B shape.
    build_dims = [*head_dims, 64, *([128] if sections & {"graphs", "qwen3", "qwen3_moe"} else [])]
    if args.prebuild_only:
        prebuilt = prebuild_kernels(build_dims, torch.bfloat16)
        report.set("prebuild", prebuilt)
        report.set("ok", prebuilt["ok"])
        print(f"[prebuild] {prebuilt}", flush=True)
        return 0 if prebuilt["ok"] else 1
    workdir = Path(tempfile.mkdtemp(prefix="flashinfer-check-"))

    prebuild: dict[str, Any] = {"skipped": True}
    builder = None
    if not args.no_prebuild:

        def run_prebuild() -> None:
            prebuild.clear()
            prebuild.update(prebuild_kernels(build_dims, torch.bfloat16))

        builder = threading.Thread(target=run_prebuild, daemon=True)
        builder.start()

    folder: Path | None = None
    if sections & {"model", "timing", "formats"}:
        try:  # converting a GGUF overlaps with the kernel build
            folder, description = resolve_model(args.model, workdir)
        except Exception as exc:  # recorded (the run fails), then go on with the stand-in
            report.error("model-resolve", exc)
            folder, description = resolve_model("synthetic", workdir)
        report.set("model", description)
    if builder is not None:
        builder.join()
    report.set("prebuild", prebuild)
    print(f"[prebuild] {prebuild}", flush=True)

    if "kernels" in sections:
        try:
            cases = kernel_cases(head_configs, head_dims, args.seed)
            report.section(
                "kernels",
                kernels_section(
                    device, flashinfer_factory(device), cases, args.seed, args.kernel_tol
                ),
            )
        except Exception as exc:
            report.error("kernels", exc)

    gpu_model = None
    if folder is not None and sections & {"model", "timing"}:
        from gpu.loader import load_model

        try:
            gpu_model = load_model(folder, device=device, dtype=torch.bfloat16, progress=False)
        except Exception as exc:
            report.error("model-load", exc)

    if gpu_model is not None and folder is not None and "model" in sections:
        try:
            run_model_section(args, gpu_model, folder, report)
        except Exception as exc:
            report.error("model", exc)

    for name, shape in (("qwen3", QWEN3_CONFIG), ("qwen3_moe", QWEN3_MOE_CONFIG)):
        if name not in sections:
            continue
        try:
            from gpu.loader import load_model

            synthetic = write_synthetic_model(workdir / f"{name}-shape-random", shape)
            model = load_model(synthetic, device=device, dtype=torch.bfloat16, progress=False)
            run_model_section(args, model, synthetic, report, section=name)
            if name == "qwen3_moe":  # the grouped experts against one at a time
                run_moe_timing(args, model, report)
            del model
        except Exception as exc:
            report.error(name, exc)

    if gpu_model is not None and "timing" in sections:
        try:
            run_timing_section(args, gpu_model, device, report)
        except Exception as exc:
            report.error("timing", exc)

    if gpu_model is not None and "overlap" in sections:
        try:
            from tools.gpu_check.engine_overlap import overlap_section

            report.section("overlap", overlap_section(gpu_model, 32, 64, 64))
        except Exception as exc:
            report.error("overlap", exc)

    if "quant" in sections:
        try:
            from tools.gpu_check.row_quant import quant_section

            report.section("quant", quant_section(device))
        except Exception as exc:
            report.error("quant", exc)

    if "sampling" in sections:
        try:
            from tools.gpu_check.sampler_waits import sampling_section

            vocab = 49152  # SmolLM2's
            report.section("sampling", sampling_section(device, [1, 8, 64], vocab, args.iters))
        except Exception as exc:
            report.error("sampling", exc)

    if "graphs" in sections:
        del gpu_model  # the 8B-class model needs the memory
        torch.cuda.empty_cache()
        try:
            from tools.gpu_check.decode_graphs import run_graphs_section

            run_graphs_section(args, device, sections, report)
        except Exception as exc:
            report.error("graphs", exc)

    if "formats" in sections:  # last: its kernels tune for minutes the first time
        torch.cuda.empty_cache()
        try:
            from tools.gpu_check.quant_formats import run_formats_section

            run_formats_section(args, folder, device, report)
        except Exception as exc:
            report.error("formats", exc)

    shutil.rmtree(workdir, ignore_errors=True)
    wanted = set(SECTIONS) & sections
    results = report.data["sections"]
    ok = not report.data["errors"] and all(results.get(s, {}).get("ok") for s in wanted)
    report.set("ok", ok)
    print("\n## Summary\n", flush=True)
    for name in SECTIONS:
        if name in results:
            body = results[name].get("table") or f"error: {results[name].get('error')}"
            print(f"### {name}\n\n{body}\n", flush=True)
    for line in report.data["errors"]:
        print(f"error in {line}", flush=True)
    print(f"flashinfer check: {'PASSED' if ok else 'FAILED'} (details: {args.out})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
