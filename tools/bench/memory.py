"""The executor's resident memory per weight format, each measured in a fresh process.

    python -m tools.bench.memory [--formats none,int8,gguf,int4] [--model PATH]

Each format runs in its own subprocess (a process's RSS does not shrink back when one model
is dropped for the next): it builds the engine exactly as the executor does
(``services.executor.service.build_engine``, the default 16,384-token KV pool), generates a
few tokens, and reports its VmRSS next to the bytes of its weights and KV pool. What is left
over is the Python/torch runtime (~220 MB before any model is loaded), the tokenizer and the
allocator's slack.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Memory:
    fmt: str
    rss_mb: float  # MiB, after load and a short generation
    runtime_mb: float  # MiB resident before the model was loaded (imports)
    weights_mb: float  # MiB of the model's parameters and buffers (each weight once)
    kv_mb: float  # MiB of the KV pool

    @property
    def excess_mb(self) -> float:
        return self.rss_mb - self.weights_mb - self.kv_mb


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure_here(fmt: str, model: str | None) -> Memory:
    """Build the executor's engine in this process and measure it."""
    from common.config import MeshConfig
    from gpu.sampling_params import SamplingParams
    from services.executor.config import ExecutorConfig
    from services.executor.service import build_engine

    runtime = rss_mb()
    engine = build_engine(ExecutorConfig(MeshConfig(), model, quantization=fmt))
    net = engine.runner.model
    gc.collect()
    tensors = [*net.parameters(), *net.buffers()]
    weights = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    kv = sum(t.numel() * t.element_size() for t in engine.runner.kv.layers) / 2**20
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.generate([list(range(10, 110))], params)
    return Memory(fmt, rss_mb(), runtime, weights, kv)


def measure(fmt: str, model: str | None = None) -> Memory:
    """:func:`measure_here` in a fresh interpreter."""
    cmd = [sys.executable, "-m", "tools.bench.memory", "--child", "--formats", fmt]
    if model:
        cmd += ["--model", model]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    fields = json.loads(out.strip().splitlines()[-1])
    return Memory(**fields)


def table(rows: list[Memory]) -> list[str]:
    lines = [
        "| format | executor RSS (MB) | weights (MB) | KV pool (MB) | RSS - weights - KV (MB) |"
        " runtime before load (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for m in rows:
        name = "fp32" if m.fmt == "none" else m.fmt
        lines.append(
            f"| {name} | {m.rss_mb:.0f} | {m.weights_mb:.0f} | {m.kv_mb:.0f} | "
            f"{m.excess_mb:.0f} | {m.runtime_mb:.0f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.memory")
    parser.add_argument("--formats", default="none,int8,gguf,int4")
    parser.add_argument("--model", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    if args.child:
        sys.stdout.write(json.dumps(asdict(measure_here(formats[0], args.model))) + "\n")
        return
    for line in table([measure(f, args.model) for f in formats]):
        sys.stdout.write(line + "\n")


if __name__ == "__main__":
    main()
