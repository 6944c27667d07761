"""``meshserve up``: a local nats-server plus every service as its own process.

The model (default: the bundled SmolLM2) is resolved and converted once here, so every service
loads the same folder. Ctrl-C (or SIGTERM) stops every process this started. A process that
dies is restarted with backoff (``supervisor``) while the rest keeps serving; one that keeps
crashing takes the whole local mesh down with a message and a non-zero exit.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.reasoning import PARSERS as REASONING_PARSERS
from gpu.cache_dir import cache_root
from services.launcher.console import LEVELS, ReadyReport, ServiceLogs
from services.launcher.flags import add_model_format_args, add_tensor_parallel_arg
from services.launcher.mesh import LocalMesh, resolve_model
from services.launcher.supervisor import DeferredInterrupt, RestartPolicy
from services.scheduler.router import POLICIES

if TYPE_CHECKING:
    from services.launcher.nats_cluster import NatsCluster


def parse_up_args(argv: list[str]) -> argparse.Namespace:
    """``meshserve up ARGV``'s flags, defaults included (what ``LocalMesh`` takes)."""
    parser = argparse.ArgumentParser()
    add_up(parser.add_subparsers())
    return parser.parse_args(["up", *argv])


def add_up(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("up", help="start nats-server and every service locally")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) served beside the model: a request naming NAME as "
        "its model runs with it (vLLM's flag)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=("none", *REASONING_PARSERS),
        default="none",
        help="the gateway's: a chat answer's <think> block as 'reasoning' (vLLM's flag)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--executors",
        type=int,
        default=None,
        help="mixed executors (prefill and decode; default 1, or 0 with a disaggregated pool)",
    )
    p.add_argument(
        "--prefill-executors",
        type=int,
        default=0,
        help="disaggregated: executors that only compute prompts (KV to decode ones by NIXL)",
    )
    p.add_argument(
        "--decode-executors",
        type=int,
        default=0,
        help="disaggregated: executors that decode prompts computed by the prefill ones",
    )
    p.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=30.0,
        help="decode executors: seconds to wait for a prompt's KV before computing it locally",
    )
    p.add_argument("--detok-shards", type=int, default=1)
    p.add_argument("--nats-url", default=None, help="use this NATS server instead of starting one")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--router",
        choices=POLICIES,
        default=None,
        help="kv (cache-aware; the default with several executors), least-load, round-robin",
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument(
        "--draft-model",
        default=None,
        help="speculative decoding: a draft model (same tokenizer) served by the speculator",
    )
    p.add_argument(
        "--speculator",
        choices=("off", "ngram", "remote"),
        default=None,
        help="remote: the draft model (the default with --draft-model); ngram: prompt lookup",
    )
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="draft tokens, k")
    add_model_format_args(p)  # --quantization, --kv-cache-dtype (passed on to each executor)
    add_tensor_parallel_arg(p)
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="where each service writes its output, as <name>.log "
        "(default: <cache>/logs/up-<port>, the cache being $MESHSERVE_CACHE or ~/.cache/meshserve)",
    )
    p.add_argument(
        "--log-level",
        choices=LEVELS,
        default="warning",
        help="the services' log records shown here as well as in their files (debug: every "
        "line they write, and they log at debug level)",
    )
    p.add_argument(
        "--otlp-endpoint",
        default=None,
        help="send every service's traces to this OTLP/HTTP base URL (e.g. http://localhost:4318)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve each non-gateway service's /metrics on consecutive ports from this one",
    )
    p.add_argument(
        "--nats-cluster-size",
        type=int,
        default=1,
        help="start a NATS cluster of this many servers (3: one may die; JetStream at R3)",
    )
    p.add_argument(
        "--regions",
        default=None,
        help="comma-separated region names: one NATS cluster and one whole mesh per region, "
        "joined into a supercluster (gateway of region i on --port + i)",
    )
    p.add_argument(
        "--spill-queue-ms",
        type=float,
        default=None,
        help="with --regions: past this estimated queue time a request goes to another region",
    )
    p.set_defaults(func=run_up)


def check_counts(args: argparse.Namespace) -> None:
    """Counts that would start a mesh that can never serve (it would wait out
    --ready-timeout) or quietly mean something else."""
    counts = {
        "--executors": args.executors or 0,
        "--prefill-executors": args.prefill_executors,
        "--decode-executors": args.decode_executors,
    }
    for flag, value in counts.items():
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    disaggregated = args.prefill_executors + args.decode_executors
    mixed = args.executors if args.executors is not None else (0 if disaggregated else 1)
    if mixed + args.decode_executors == 0:
        raise ValueError("no executor would decode: give --executors N or --decode-executors N")
    if disaggregated and getattr(args, "tensor_parallel_size", 1) > 1:
        # (each prefill or decode executor refuses it at start, and would be restarted until
        # its supervisor gave up)
        raise ValueError(
            "--tensor-parallel-size > 1 is for mixed executors only, not with "
            "--prefill-executors/--decode-executors"
        )
    if args.nats_cluster_size < 1:
        raise ValueError(f"--nats-cluster-size must be >= 1, got {args.nats_cluster_size}")


def kill_on_signal(meshes: list[LocalMesh]) -> Callable[[int, Any], None]:
    """A signal handler that kills every service of ``meshes`` (their stop() then returns)."""

    def kill(signum: int, frame: Any) -> None:
        print("killing the services...", file=sys.stderr)
        for mesh in meshes:
            mesh.kill()

    return kill


def run_up(args: argparse.Namespace) -> int:
    check_counts(args)
    if args.regions:
        from services.launcher.regions import run_regions

        return run_regions(args)
    folder = resolve_model(args.model)
    log_dir = args.log_dir or cache_root() / "logs" / f"up-{args.port}"
    logs = ServiceLogs(log_dir, logging.getLevelNamesMapping()[args.log_level.upper()])
    print(f"meshserve up: model {folder}", flush=True)
    print(f"meshserve up: each service writes to {log_dir}/<name>.log", flush=True)
    # Ctrl-C reaches the children too (same process group); they drain and exit. SIGINT is
    # handled explicitly: a shell starts background jobs with SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler, while the services handle it themselves (they
    # would exit and this process would restart them).
    interrupts = DeferredInterrupt()
    signal.signal(signal.SIGTERM, interrupts.handler)
    signal.signal(signal.SIGINT, interrupts.handler)
    cluster: NatsCluster | None = None
    mesh: LocalMesh | None = None
    try:
        # Every process started is in cluster or mesh, for the stop below to end.
        with interrupts.deferred():
            if args.nats_cluster_size > 1 and not args.nats_url:
                from services.launcher.regions import RegionMesh, start_cluster

                cluster = start_cluster(args.nats_cluster_size)
                args.nats_url = cluster.url
                print(f"  nats cluster ready: {cluster.url}", flush=True)
                mesh = RegionMesh(
                    args, folder, logs=logs, kv_replicas=min(3, args.nats_cluster_size)
                )
            else:
                mesh = LocalMesh(args, folder, logs=logs)
            mesh.start()
        if mesh.nats is not None:
            print(f"  nats-server ready: {mesh.nats_url}", flush=True)
        supervisor = mesh.supervisor(RestartPolicy(), interrupts)
        if cluster is not None:
            cluster.supervise(supervisor)

        def watch() -> None:
            supervisor.poll()
            logs.echo()

        ready = ReadyReport([name for name, _ in mesh.procs])
        mesh.wait_ready(args.ready_timeout, watch, ready)
        print(f"meshserve is up: {mesh.base_url}/v1  (Ctrl-C stops it)", flush=True)
        for name, url in mesh.metrics_urls.items():
            print(f"  metrics of {name}: {url}", flush=True)
        while True:
            watch()
            time.sleep(0.2)
    except KeyboardInterrupt:
        print("stopping (requests in flight finish; Ctrl-C again kills)...", file=sys.stderr)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        logs.echo()  # what the services said before it came to this
        print(f"meshserve up: {exc}", file=sys.stderr)
        return 1
    finally:
        # stop() drains the services in order and kills whatever outlives its deadline; a
        # second Ctrl-C kills them all at once (never leaving one behind).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (first: nothing interrupts stopping)
        signal.signal(signal.SIGINT, kill_on_signal([mesh] if mesh is not None else []))
        if mesh is not None:
            mesh.stop()
        if cluster is not None:
            cluster.stop()
        logs.echo()  # errors while draining
