"""Quality and speed of each weight format against the unquantized model (fp32; bf16 on CUDA).

    python -m tools.bench.quant [--model PATH] [--formats int8,int4,gguf,fp8] [--repeats 3]
                              [--speed-formats none,int8,gguf,int4] [--concurrency 32]
                              [--output-tokens 64] [--linear] [--memory]

Quality (teacher-forced): the fp32 model first continues every prompt of a fixed set greedily
(``--quality-tokens`` tokens each); then each format reads prompt + that continuation in one
pass, and at every continuation position its next-token distribution is compared with fp32's:
mean KL(fp32 || format) in nats, and top-1 agreement. Teacher forcing keeps one early flip from
derailing the rest, so every position measures the format itself.

``gguf`` is the file's own blocks (a GGUF model only: the default one is Q4_1 with a Q8_0
embedding), and fp32 is that file dequantized, so its row is native execution against the
dequantized file; the last quality row holds the native kernels against the same math in
torch (dequantized blocks times the block-quantized activations): float rounding.

Speed (engine, as ``tools.bench.engine`` measures it): single-stream decode tokens/s (first
output token to last, one request alone), throughput with ``--concurrency`` requests at
once, and prefill tokens/s of one 512-token prompt; each ``--repeats`` times (best and
median), the formats interleaved within each repeat. On CPU, fp8 runs through
``torch._scaled_mm``'s slow CPU path and is left out of the speed table unless asked for with
``--speed-formats``. ``--memory``: the executor's resident memory per speed format
(``tools.bench.memory``).

``--formats`` also takes CUDA's two int8 paths, ``int8-cuda`` (weight-only, the default there)
and ``int8-cuda-w8a8`` (activations quantized per token, ``torch._int_mm``): on CPU the same
math in torch, for their quality (not their speed).

``--linear`` adds a micro-benchmark of the CPU matmul options for the model's layer shapes.
``--device cuda`` runs the same report on a GPU (reference: the bf16 model), fp8 included.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from common.tokenizer import Tokenizer
from gpu import cpu_kernels
from gpu.attention.metadata import SeqChunk
from gpu.cpu_kernels.prepared import LIN_INT8, LIN_Q4_1, LIN_Q8_0
from gpu.engine import Engine, EngineConfig
from gpu.gguf import resolve_model_path
from gpu.linear import BlockLinear, Int8Linear, Linear
from gpu.loader import load_model
from gpu.model import CausalLM
from gpu.quant import (
    fake_quantize_blocks,
    pad_int8_blocks,
    quantize_int8,
    quantize_q4_1,
    quantize_q8_0,
)
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams
from tools.bench.engine import QUESTIONS, chat_prompts, run_decode_only, run_engine
from tools.bench.memory import measure as measure_memory
from tools.bench.memory import table as memory_table

# CUDA's int8 paths, emulated on CPU (``load_format``).
CUDA_INT8 = ("int8-cuda", "int8-cuda-w8a8")

# A fixed prompt set: chat questions (the model is an instruct model) and plain text.
QUALITY_QUESTIONS = [
    *QUESTIONS,
    "Write a Python function that reverses a string.",
    "What is the difference between weather and climate?",
]
QUALITY_TEXTS = [
    "The history of the Roman Empire begins",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the mountains,",
    "The three laws of thermodynamics are",
    "To make a good cup of tea, first",
    "In machine learning, overfitting means",
]


def emit(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def quality_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    prompts = []
    for q in QUALITY_QUESTIONS:
        prompts.append(tokenizer.encode_user_turn(q))
    prompts.extend(tokenizer.encode(t) for t in QUALITY_TEXTS)
    return prompts


@dataclass(frozen=True)
class Quality:
    name: str
    mean_kl: float  # nats, KL(reference || candidate) averaged over positions
    top1_agreement: float
    positions: int


def greedy_continuations(model: CausalLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The reference's own greedy continuation of each prompt (EOS ignored)."""
    pages = sum(-(-(len(p) + n) // 16) for p in prompts) + 8
    engine = Engine(ModelRunner(model, pages, 16), EngineConfig(4096, len(prompts)))
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return engine.generate(prompts, params)


def next_token_logprobs(
    model: CausalLM, prompts: list[list[int]], continuations: list[list[int]]
) -> list[torch.Tensor]:
    """Per prompt: log-softmax of the logits that predict each continuation token ``[n, V]``
    (teacher-forced: prompt + continuation read in one pass)."""
    out = []
    for prompt, cont in zip(prompts, continuations, strict=True):
        tokens = prompt + cont
        runner = ModelRunner(model, -(-len(tokens) // 16), 16)
        logits = runner.execute(
            [SeqChunk(tuple(range(runner.kv.spec.num_pages)), 0, len(tokens))],
            [tokens],
            all_logits=True,
        )
        rows = logits[len(prompt) - 1 : len(tokens) - 1]
        out.append(torch.log_softmax(rows.float(), dim=-1))
    return out


def compare(name: str, ref: list[torch.Tensor], cand: list[torch.Tensor]) -> Quality:
    kls, agree, total = [], 0, 0
    for r, c in zip(ref, cand, strict=True):
        kls.append((r.exp() * (r - c)).sum(dim=-1))
        agree += int((r.argmax(-1) == c.argmax(-1)).sum())
        total += r.shape[0]
    return Quality(name, float(torch.cat(kls).mean()), agree / total, total)


def quality_report(
    load: Callable[[str], CausalLM], formats: Sequence[str], prompts: list[list[int]], n: int
) -> list[Quality]:
    """Teacher-forced quality of each format against ``load("none")`` (fp32 on CPU)."""
    ref_model = load("none")
    continuations = greedy_continuations(ref_model, prompts, n)
    ref = next_token_logprobs(ref_model, prompts, continuations)
    del ref_model
    results = []
    for fmt in formats:
        model = load(fmt)
        results.append(compare(fmt, ref, next_token_logprobs(model, prompts, continuations)))
        del model
        gc.collect()
    return results


def native_vs_torch_math(folder: Path) -> tuple[float, int]:
    """Every block linear of the ``gguf`` model on the kernels against the same math in torch
    (the file's blocks dequantized by ``gpu.quant``, which the tests hold equal to the ``gguf``
    package's, times the block-quantized activations), on 4 random rows each: the largest
    difference relative to the layer's largest output, and the number of layers. (Whole-model
    logits are not compared so: one activation rounded to the other side of a step somewhere in
    30 layers moves every later result by far more than float rounding.)"""
    model = load_model(folder, progress=False, quantization="gguf")
    worst, count = 0.0, 0
    g = torch.Generator().manual_seed(0)
    for layer in model.modules():
        if isinstance(layer, BlockLinear):
            x = torch.randn(4, layer.in_features, generator=g)
            want = F.linear(fake_quantize_blocks(x).double(), layer.dequantized_weight().double())
            got = layer(x).double()
            worst = max(worst, float((got - want).abs().max() / want.abs().max()))
            count += 1
    return worst, count


@dataclass
class Speed:
    name: str
    weight_mb: float
    single: list[float] = field(default_factory=list)  # tokens/s of each repeat
    concurrent: list[float] = field(default_factory=list)
    prefill: list[float] = field(default_factory=list)  # prompt tokens/s, one long prompt


def make_engine(model: CausalLM, tokenizer: Tokenizer, concurrency: int) -> Engine:
    # 512 pages of 16: room for the concurrent requests and the long prompt, and small
    # enough that every format's engine fits in memory at once (the runs are interleaved).
    runner = ModelRunner(model, num_pages=512, page_size=16)
    return Engine(
        runner,
        EngineConfig(max_num_batched_tokens=1024, max_num_seqs=max(64, concurrency)),
        tokenizer.eos_token_ids,
    )


def run_prefill(engine: Engine, prompt: list[int]) -> float:
    """Prompt tokens/s of one prompt read in one step (to its first output token)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    engine.generate([prompt], params)
    seconds = time.perf_counter() - start
    engine.pages.reset_prefix_cache()
    return len(prompt) / seconds


def speed_report(
    models: dict[str, CausalLM],
    tokenizer: Tokenizer,
    concurrency: int,
    output_tokens: int,
    repeats: int,
    prefill_tokens: int = 512,
) -> list[Speed]:
    """Each format's speeds, the formats interleaved within every repeat so that a change in
    the machine's load hits them all alike."""
    engines = {fmt: make_engine(m, tokenizer, concurrency) for fmt, m in models.items()}
    speeds = {fmt: Speed(fmt, weight_mb(m)) for fmt, m in models.items()}
    prompts = chat_prompts(tokenizer, concurrency)
    long_prompt = [t for _ in range(2) for p in prompts for t in p][:prefill_tokens]
    for engine in engines.values():
        run_engine(engine, prompts[:2], 4, "warm-up")
    for _ in range(repeats):
        for fmt, engine in engines.items():
            speeds[fmt].single.append(
                run_decode_only(engine, prompts[0], output_tokens).tokens_per_s
            )
            speeds[fmt].concurrent.append(
                run_engine(engine, prompts, output_tokens, "batch").tokens_per_s
            )
            speeds[fmt].prefill.append(run_prefill(engine, long_prompt))
    return list(speeds.values())


def weight_mb(model: CausalLM) -> float:
    """MB of weights a decode step reads: every linear layer (the LM head included)."""
    total = sum(m.weight_bytes() for m in model.modules() if isinstance(m, Linear))
    return total / 1e6


# --------------------------------------------------------------------------- linear options


def linear_options() -> dict[
    str, tuple[Callable[[torch.Tensor], object], Callable[..., torch.Tensor]]
]:
    """CPU ways to multiply by a weight ``[N, K]``: (prepare once, call per step)."""
    opts: dict[str, tuple[Callable[[torch.Tensor], object], Callable[..., torch.Tensor]]] = {
        "fp32 F.linear [N,K]": (lambda w: w, lambda x, w: F.linear(x, w)),
        "fp32 x @ W_t [K,N]": (lambda w: w.t().contiguous(), lambda x, w: x @ w),
    }
    kernels = cpu_kernels.load()
    if kernels is not None:

        def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q, s = quantize_int8(w)
            return pad_int8_blocks(q), s

        opts["int8 W8A8 meshserve kernel"] = (
            int8_rows,
            lambda x, p: kernels.block_linear(LIN_INT8, x, p[0], p[0].shape[0], p[1]),
        )
        opts["Q4_1 (int4) meshserve kernel"] = (
            quantize_q4_1,
            lambda x, p: kernels.block_linear(LIN_Q4_1, x, p, p.shape[0]),
        )
        opts["Q8_0 meshserve kernel"] = (
            quantize_q8_0,
            lambda x, p: kernels.block_linear(LIN_Q8_0, x, p, p.shape[0]),
        )
    opts["int8 torch._weight_int8pack_mm"] = (
        quantize_int8,
        lambda x, p: torch._weight_int8pack_mm(x, p[0], p[1]),
    )

    def fbgemm_prepack(w: torch.Tensor) -> object:
        q, s = quantize_int8(w)
        zero = torch.zeros(w.shape[0], dtype=torch.int64)
        qw = torch._make_per_channel_quantized_tensor(q, s.double(), zero, 0)
        return torch.ops.quantized.linear_prepack(qw, None)

    opts["int8 fbgemm dynamic (W8A8, per-tensor act)"] = (
        fbgemm_prepack,
        lambda x, p: torch.ops.quantized.linear_dynamic(x, p, True),
    )
    opts["fp16 fbgemm dynamic"] = (
        lambda w: torch.ops.quantized.linear_prepack_fp16(w, None),
        lambda x, p: torch.ops.quantized.linear_dynamic_fp16(x, p),
    )
    return opts


def linear_report(shapes: list[tuple[str, int, int]], batches: Sequence[int]) -> None:
    """Time each option per shape: the median of single calls over weights kept in several
    copies, so they come from DRAM as in a real decode step (one layer's weights fit in L3,
    thirty do not). The median of single calls shrugs off a busy machine's stalls better than
    the mean of a loop does."""
    copies_for = {name: 2 if n * k > 8_000_000 else 30 for name, n, k in shapes}
    emit("| option | " + " | ".join(f"{n} M={m}" for n, _, _ in shapes for m in batches) + " |")
    emit("|---" * (1 + len(shapes) * len(batches)) + "|")
    torch.backends.quantized.engine = "fbgemm"
    for option, (prepare, call) in linear_options().items():
        cells: list[str] = []
        for name, n, k in shapes:
            ws = [torch.randn(n, k) * 0.05 for _ in range(copies_for[name])]
            try:
                prepared = [prepare(w) for w in ws]
            except (RuntimeError, NotImplementedError):
                cells.extend("n/a" for _ in batches)
                continue
            for m in batches:
                x = torch.randn(m, k)
                try:
                    call(x, prepared[0])
                    times = _call_times(call, x, prepared, rounds=5 if n * k > 8_000_000 else 3)
                    cells.append(f"{statistics.median(times) * 1e6:.0f} us")
                except (RuntimeError, NotImplementedError):
                    cells.append("n/a")
        emit(f"| {option} | " + " | ".join(cells) + " |")


def _call_times(
    call: Callable[..., torch.Tensor], x: torch.Tensor, prepared: list[object], rounds: int
) -> list[float]:
    times = []
    for _ in range(rounds):
        for p in prepared:
            start = time.perf_counter()
            call(x, p)
            times.append(time.perf_counter() - start)
    return times


# --------------------------------------------------------------------------- main


def _fmt_runs(values: list[float]) -> str:
    return f"{max(values):.1f} / {statistics.median(values):.1f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.quant", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2)")
    parser.add_argument(
        "--formats", default="int8,int4,gguf,fp8", help="formats compared with fp32"
    )
    parser.add_argument("--speed-formats", default=None, help="default: none,int8,gguf,int4 on CPU")
    parser.add_argument("--quality-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-quality", action="store_true")
    parser.add_argument("--no-speed", action="store_true")
    parser.add_argument("--linear", action="store_true", help="CPU matmul micro-benchmark")
    parser.add_argument("--memory", action="store_true", help="executor RSS per speed format")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve_model_path(args.model)
    tokenizer = Tokenizer.from_folder(folder)
    device = torch.device(args.device)
    formats = [f for f in args.formats.split(",") if f]
    speed_formats = (
        args.speed_formats or ("none,int8,gguf,int4" if device.type == "cpu" else args.formats)
    ).split(",")

    def load(fmt: str) -> CausalLM:
        return load_format(Path(folder), device, fmt)

    load_avg = _load_average()
    emit(
        f"\nmodel {folder.name}, {device.type}, {torch.get_num_threads()} threads, "
        f"load average at start {load_avg}\n"
    )
    if not args.no_quality:
        prompts = quality_prompts(tokenizer)
        emit(
            f"quality: {len(prompts)} prompts, teacher-forced on {args.quality_tokens} greedy "
            "reference tokens each\n"
        )
        ref = "fp32" if device.type == "cpu" else "bf16"
        emit(f"| format | mean KL vs {ref} (nats) | top-1 agreement vs {ref} | positions |")
        emit("|---|---|---|---|")
        for q in quality_report(load, formats, prompts, args.quality_tokens):
            emit(f"| {q.name} | {q.mean_kl:.4f} | {q.top1_agreement:.2%} | {q.positions} |")
        emit()
        if "gguf" in formats and device.type == "cpu":
            worst, count = native_vs_torch_math(folder)
            emit(
                f"gguf kernels vs the dequantized file's blocks times the block-quantized "
                f"activations in float64, each of the {count} block layers: largest difference "
                f"{worst:.1e} of the layer's largest output (fp32 rounding)\n"
            )
    if not args.no_speed:
        emit(
            f"speed: engine, {args.output_tokens} output tokens per request, best / median of "
            f"{args.repeats} runs, formats interleaved in each\n"
        )
        emit(
            f"| format | weights read per token (MB) | 1 stream decode tokens/s | "
            f"{args.concurrency} concurrent tokens/s | prefill tokens/s (512-token prompt) |"
        )
        emit("|---|---|---|---|---|")
        models = {fmt: load(fmt) for fmt in speed_formats}
        for sp in speed_report(
            models, tokenizer, args.concurrency, args.output_tokens, args.repeats
        ):
            name = ("fp32" if device.type == "cpu" else "bf16") if sp.name == "none" else sp.name
            emit(
                f"| {name} | {sp.weight_mb:.0f} | {_fmt_runs(sp.single)} | "
                f"{_fmt_runs(sp.concurrent)} | {_fmt_runs(sp.prefill)} |"
            )
        del models
        gc.collect()
        emit(f"\nload average at end {_load_average()}")
    if args.memory and device.type == "cpu":
        emit("\nexecutor resident memory (each format in a fresh process, 16,384-token KV pool)\n")
        for line in memory_table([measure_memory(f, args.model) for f in speed_formats]):
            emit(line)
    if args.linear:
        emit("\nCPU matmul options, median time per call, SmolLM2-135M layer shapes:\n")
        linear_report(
            [
                ("qkv 576x960", 960, 576),
                ("o 576x576", 576, 576),
                ("gate_up 576x3072", 3072, 576),
                ("down 1536x576", 576, 1536),
                ("lm_head 576x49152", 49152, 576),
            ],
            (1, 32),
        )


def load_format(folder: Path, device: torch.device, fmt: str) -> CausalLM:
    """The model in ``fmt``: a ``--quantization`` name, or one of CUDA's two int8 paths
    (``int8-cuda``: weight-only, ``int8-cuda-w8a8``: activations per token through
    ``torch._int_mm``), run as they are on CUDA and as the same math in torch on CPU."""
    if fmt not in CUDA_INT8:
        return load_model(folder, device=device, progress=False, quantization=fmt)
    model = load_model(
        folder, device=device, progress=False, quantization="int8", cpu_kernels=False
    )
    for module in model.modules():
        if isinstance(module, Int8Linear):
            module.w8a8 = False  # the CPU reference: the codes times unquantized activations
            if fmt == "int8-cuda-w8a8" and not module.use_int_mm() and device.type == "cpu":
                module.cuda_kernel = "w8a8"  # torch._int_mm also runs on CPU
    return model


def _load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


if __name__ == "__main__":
    main()
