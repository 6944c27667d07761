"""Where a request's time to first token goes in the mesh, hop by hop, from its trace.

Starts the mesh as ``meshserve up`` would, with every service exporting spans to an OTLP
receiver in this process, sends seeded Poisson arrivals (streaming chat, greedy, fixed output
length), then prints, for each span of a request's trace, when it started and ended relative to
the gateway's ``gateway.request`` span (p50/p90 over the requests)::

    python -m tools.bench.hops --rate 1.2 --requests 40   # under load (the mesh benchmark's rate)
    python -m tools.bench.hops --rate 0.3 --requests 10   # one request at a time

The gaps between one service's span and the next are the hops: a NATS publish, the server's
forwarding, and the next service's wake-up and decode. A raw nats-py request/reply round trip
between two processes is measured alongside for scale.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import nats
import numpy as np

from gpu.gguf import resolve_model_path
from services.launcher.mesh import LocalMesh
from services.launcher.up import add_up
from tools.bench.mesh import WARMUP_TOKENS, poisson_arrivals, questions, run_mesh, warmup_questions
from tools.bench.otlp_receiver import OtlpReceiver, ReceivedSpan

ECHO = """
import asyncio, sys, nats
async def main():
    nc = await nats.connect(sys.argv[1])
    async def echo(msg):
        await nc.publish(msg.reply, msg.data)
    await nc.subscribe("meshserve.hops.echo", cb=echo)
    await asyncio.Event().wait()
asyncio.run(main())
"""


async def nats_round_trips(url: str, n: int = 200) -> list[float]:
    """Request/reply round trips (microseconds) to an echo in another process."""
    echo = subprocess.Popen([sys.executable, "-c", ECHO, url])
    try:
        nc = await nats.connect(url)
        await asyncio.sleep(1.0)  # the echo's subscription is in place
        times = []
        for _ in range(n):
            t = time.perf_counter()
            await nc.request("meshserve.hops.echo", b"x" * 256, timeout=5)
            times.append((time.perf_counter() - t) * 1e6)
            await asyncio.sleep(0.005)
        await nc.close()
        return times
    finally:
        echo.kill()


def offsets(spans: list[ReceivedSpan]) -> dict[str, list[float]]:
    """Per span edge ("name start" / "name end"): ms after each trace's gateway.request start."""
    traces: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for span in spans:
        traces[span.trace_id].append(span)
    out: dict[str, list[float]] = defaultdict(list)
    for trace in traces.values():
        roots = [s for s in trace if s.name == "gateway.request"]
        if not roots:
            continue
        t0 = roots[0].start_ns
        for s in trace:
            out[f"{s.name} start"].append((s.start_ns - t0) / 1e6)
            out[f"{s.name} end"].append((s.end_ns - t0) / 1e6)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.hops", description=__doc__)
    parser.add_argument("--rate", type=float, default=1.2, help="arrivals per second")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8124)
    args = parser.parse_args(argv)
    sub = argparse.ArgumentParser().add_subparsers()
    add_up(sub)
    up = sub.choices["up"].parse_args([])
    receiver = OtlpReceiver().start()
    up.port, up.served_model_name, up.otlp_endpoint = args.port, "bench", receiver.endpoint
    folder = resolve_model_path(up.model)
    up.model = str(folder)
    mesh = LocalMesh(up, folder)
    try:
        mesh.start()
        mesh.wait_ready(600)
        warm = warmup_questions(16)
        asyncio.run(run_mesh(mesh.base_url, "bench", warm, WARMUP_TOKENS, concurrency=16))
        time.sleep(8)  # the services export warm-up spans (batch delay 5 s)
        before = {s.trace_id for s in receiver.snapshot()}
        at = poisson_arrivals(args.requests, args.rate, args.seed)
        texts = questions(args.requests, 0, "hops")
        side = asyncio.run(run_mesh(mesh.base_url, "bench", texts, args.output_tokens, None, at))
        time.sleep(12)
        rtts = asyncio.run(nats_round_trips(mesh.nats_url))
    finally:
        mesh.stop()
    spans = [s for s in receiver.snapshot() if s.trace_id not in before]
    receiver.stop()
    edges = offsets(spans)
    print(
        f"\n{args.requests} requests, Poisson {args.rate} req/s, {args.output_tokens} output "
        f"tokens; client TTFT p50 {side.ttft(50):.1f} ms, p90 {side.ttft(90):.1f} ms; raw "
        f"nats-py round trip between two processes p50 {statistics.median(rtts):.0f} us\n"
    )
    print("| span edge | ms after gateway.request start, p50 | p90 |")
    print("|---|---|---|")
    for name, values in sorted(edges.items(), key=lambda kv: statistics.median(kv[1])):
        if len(values) >= 2:
            p90 = float(np.percentile(values, 90))
            print(f"| {name} | {statistics.median(values):.1f} | {p90:.1f} |")


if __name__ == "__main__":
    main()
