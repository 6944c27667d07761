"""The processes of a local mesh: a nats-server (unless given a URL) and one process per
service, all started from one model folder, restartable one by one, stopped together. With
``logs``, each service writes to its own file there; without, to this process's stderr."""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.nats_server import LocalNatsServer
from common.parent_death import ends_with_this_process
from services.launcher.console import ServiceLogs
from services.launcher.supervisor import DeferredInterrupt, RestartPolicy, Supervisor


def resolve_model(spec: str | None) -> Path:
    """``--model`` as a Hugging Face folder (``python -m gpu.gguf``), in a process of its own:
    converting a GGUF needs numpy and about a gigabyte for a while, and this process, which
    only starts others, stays small for as long as the mesh runs."""
    out = subprocess.run(
        [sys.executable, "-m", "gpu.gguf", *([spec] if spec is not None else [])],
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )  # stderr is the user's: a conversion shows its progress there
    lines = out.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    if "folder" in answer:
        return Path(answer["folder"])
    raise ValueError(answer.get("error") or f"resolving model {spec!r} failed ({out.returncode})")


@dataclass
class LocalMesh:
    args: argparse.Namespace
    model_folder: Path
    nats: LocalNatsServer | None = None
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    commands: dict[str, list[str]] = field(default_factory=dict)  # to start one again
    metrics_urls: dict[str, str] = field(default_factory=dict)  # service -> its /metrics
    metrics_ports: int = 0  # ports taken from --metrics-port on (the gateway uses its own)
    logs: ServiceLogs | None = None
    # Executors sharing this host's cores (0: this mesh's own); ``meshserve up --regions`` runs
    # every region's on one host. ``first_executor``: how many of them come before this mesh's
    # (each executor takes the next GPUs).
    executors_on_host: int = 0
    first_executor: int = 0

    @property
    def nats_url(self) -> str:
        if self.args.nats_url:
            return str(self.args.nats_url)
        assert self.nats is not None
        return self.nats.url

    @property
    def router(self) -> str:
        """Cache-aware routing pays off only when there is a choice of executor."""
        if self.args.router:
            return str(self.args.router)
        return "kv" if len(self.executor_roles) > 1 else "least-load"

    @property
    def executor_roles(self) -> list[tuple[str, str]]:
        """(instance id, role) of every executor: the mixed pool, then the disaggregated."""
        a = self.args
        disaggregated = a.prefill_executors + a.decode_executors
        mixed = a.executors if a.executors is not None else (0 if disaggregated else 1)
        return [
            *((f"executor-{i}", "mixed") for i in range(mixed)),
            *((f"prefill-{i}", "prefill") for i in range(a.prefill_executors)),
            *((f"decode-{i}", "decode") for i in range(a.decode_executors)),
        ]

    @property
    def cpu_threads(self) -> int:
        """Each CPU executor's share of the cores (0: torch's default, for one executor or
        CUDA devices); a tensor-parallel replica splits its share among its ranks."""
        executors = self.executors_on_host or len(self.executor_roles)
        if self.args.device != "cpu" or executors <= 1:
            return 0
        return max(1, (os.cpu_count() or 1) // executors)

    @property
    def base_url(self) -> str:
        return f"http://{self.args.host}:{self.args.port}"

    def spawn(self, name: str, module: str, *flags: str) -> None:
        telemetry = self.telemetry_flags(name, module)
        cmd = [sys.executable, "-m", module, "--nats-url", self.nats_url, *telemetry, *flags]
        if self.args.log_level == "debug":
            cmd += ["--log-level", "DEBUG"]
        self.commands[name] = cmd
        self.procs.append((name, self.popen(name)))

    def respawn(self, name: str) -> subprocess.Popen[bytes]:
        """Start service ``name`` again with the same command (ports included)."""
        proc = self.popen(name)
        self.procs = [(n, proc if n == name else p) for n, p in self.procs]
        return proc

    def popen(self, name: str) -> subprocess.Popen[bytes]:
        # SIGTERM (a drain) if this process dies without stopping it: killed, it would leave
        # the service holding its ports and devices.
        # A session of its own: Ctrl-C reaches this process only, which stops the services
        # in order (``stop``), rather than every one of them at once.
        ends = ends_with_this_process()
        if self.logs is None:
            return subprocess.Popen(self.commands[name], preexec_fn=ends, start_new_session=True)
        with self.logs.open(name) as log:  # the child keeps its own descriptor
            return subprocess.Popen(
                self.commands[name], stdout=log, stderr=subprocess.STDOUT, preexec_fn=ends,
                start_new_session=True,
            )  # fmt: skip

    def restart_nats(self) -> subprocess.Popen[bytes]:
        """A new local nats-server on the same port: the services reconnect by themselves
        (JetStream state is not kept; the executors recreate their stream)."""
        assert self.nats is not None
        port = self.nats.port
        self.nats.stop()  # it is dead already; this removes its store folder
        self.nats = LocalNatsServer.start(port=port, end_with_starter=True)
        return self.nats.process

    def supervisor(self, policy: RestartPolicy, interrupts: DeferredInterrupt) -> Supervisor:
        """A supervisor of every process ``start()`` started."""
        sup = Supervisor(policy, guard=interrupts.deferred)
        if self.nats is not None:
            sup.watch("nats-server", self.nats.process, self.restart_nats)
        for name, proc in self.procs:
            sup.watch(name, proc, functools.partial(self.respawn, name))
        return sup

    def telemetry_flags(self, name: str, module: str) -> list[str]:
        """Traces to --otlp-endpoint (children also inherit OTEL_* variables); /metrics on
        consecutive ports from --metrics-port (the gateway serves it on its HTTP port)."""
        a = self.args
        flags = ["--otlp-endpoint", a.otlp_endpoint] if a.otlp_endpoint else []
        if module == "services.gateway":
            self.metrics_urls[name] = f"{self.base_url}/metrics"
        elif a.metrics_port is not None:
            port = a.metrics_port + self.metrics_ports
            self.metrics_ports += 1
            self.metrics_urls[name] = f"http://127.0.0.1:{port}/metrics"
            flags += ["--metrics-port", str(port), "--metrics-host", "127.0.0.1"]
        return flags

    def start(self) -> None:
        a = self.args
        speculator, k = self.speculation  # a bad combination fails before anything starts
        if not a.nats_url:
            self.nats = LocalNatsServer.start(end_with_starter=True)
        model = ["--model", str(self.model_folder)]
        pages = ["--page-size", str(a.page_size)]
        shards = ["--detok-shards", str(a.detok_shards)]  # the tokenizer picks each request's
        self.spawn("tokenizer", "services.tokenizer", *model, *pages, *shards)
        self.spawn("prefix-index", "services.prefix_index")
        self.spawn("scheduler", "services.scheduler", "--router", self.router)
        for shard in range(a.detok_shards):
            self.spawn(
                f"detokenizer-{shard}", "services.detokenizer", *model, "--shard", str(shard)
            )
        if speculator == "remote":
            self.spawn(
                "speculator",
                "services.speculator",
                "--draft-model", str(self.draft_folder),
                "--device", a.device,
                "--page-size", str(a.page_size),
            )  # fmt: skip
        tp = a.tensor_parallel_size
        if any("," in spec for spec in a.lora_modules):  # (the services split on commas)
            raise ValueError("--lora-modules: a path may not hold a comma")
        loras = [flag for spec in a.lora_modules for flag in ("--lora-modules", spec)]
        for i, (name, role) in enumerate(self.executor_roles):
            self.spawn(
                name,
                "services.executor",
                *model,
                *pages,
                *loras,
                "--instance-id", name,
                "--role", role,
                "--kv-transfer-timeout", str(a.kv_transfer_timeout),
                "--device", executor_device(a.device, self.first_executor + i, tp),
                "--tensor-parallel-size", str(tp),
                "--kv-cache-tokens", str(a.kv_cache_tokens),
                "--max-num-seqs", str(a.max_num_seqs),
                "--max-num-batched-tokens", str(a.max_num_batched_tokens),
                "--speculator", speculator,
                "--num-speculative-tokens", str(k),
                "--quantization", a.quantization,
                "--kv-cache-dtype", a.kv_cache_dtype,
                "--cpu-threads", str(self.cpu_threads),
            )  # fmt: skip
        config = json.loads((self.model_folder / "config.json").read_text())
        self.spawn(
            "gateway",
            "services.gateway",
            "--host", a.host,
            "--port", str(a.port),
            "--served-model-name", a.served_model_name or self.model_folder.name,
            "--reasoning-parser", a.reasoning_parser,
            *loras,
            "--max-model-len", str(config.get("max_position_embeddings", 2048)),
        )  # fmt: skip

    @property
    def speculation(self) -> tuple[str, int]:
        """(speculator, k): a draft model implies the speculator service; off means k = 0."""
        a = self.args
        mode = a.speculator or ("remote" if a.draft_model else "off")
        if mode == "remote" and not a.draft_model:
            raise ValueError("--speculator remote needs --draft-model PATH")
        return mode, (a.num_speculative_tokens if mode != "off" else 0)

    @property
    def draft_folder(self) -> Path:
        return resolve_model(self.args.draft_model)

    def health(self) -> tuple[int, dict[str, Any]] | None:
        """The gateway's ``/health`` status and body; None while nothing answers."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=1) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as exc:  # 503 while a stage is missing: a body all the same
            with exc:
                try:
                    return exc.code, json.load(exc)
                except ValueError:
                    return exc.code, {}
        except (OSError, ValueError):
            return None

    def wait_ready(
        self,
        timeout: float,
        watch: Callable[[], None] | None = None,
        until: Callable[[tuple[int, dict[str, Any]] | None], bool] | None = None,
    ) -> None:
        """Until ``until(health)`` (by default: the gateway's /health is 200); ``watch`` (by
        default: fail if any process exited) runs on every try."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            (watch or self.check_alive)()
            health = self.health()
            if until(health) if until is not None else (health is not None and health[0] == 200):
                return
            time.sleep(0.25)
        raise TimeoutError(f"the mesh was not healthy within {timeout:.0f} s")

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"service {name} exited with code {proc.returncode}")

    def kill(self) -> None:
        """SIGKILL every service still running (a second Ctrl-C while they drain)."""
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def stop(self) -> None:
        """Stop the services in stages, each a SIGTERM and a wait: the gateway first (its
        in-flight streams finish, and need every other stage for that), then the executors
        and the speculator (they drain), then the rest, then NATS. Stopped all at once, the
        detokenizer left while the executors drained, and the streams they finished never
        reached their clients; the gateway, waiting for them, was then killed mid-stream."""
        for modules, seconds in STOP_STAGES:
            stage = [
                proc
                for name, proc in self.procs
                if modules is None or self.commands.get(name, ["", "", ""])[2] in modules
            ]
            for proc in stage:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + seconds
            for proc in stage:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.nats is not None:
            self.nats.stop()


# (modules, seconds to wait for them) in order; None: every process left. The gateway's and the
# executors' own limits are 30 s (--shutdown-timeout-s, the drain).
STOP_STAGES: tuple[tuple[frozenset[str] | None, float], ...] = (
    (frozenset({"services.gateway"}), 35.0),
    (frozenset({"services.executor", "services.speculator"}), 35.0),
    (None, 15.0),
)


def executor_device(
    device: str, index: int, tensor_parallel_size: int, gpus: int | None = None
) -> str:
    """Executor ``index``'s first device: on CUDA each executor (its ranks, with tensor
    parallelism) takes the next ``tensor_parallel_size`` GPUs from ``device``'s (executor 1 of
    TP=2 starts at cuda:2). Executors past the last group that fits on the host's ``gpus``
    wrap round to groups from cuda:0 and share them; every group lies within the host."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":")[1]) if ":" in device else 0
    tp = tensor_parallel_size
    if gpus is None:
        gpus = cuda_device_count()
    fit_from_base = max(0, (gpus - base) // tp)
    if index < fit_from_base or gpus < tp:  # (too few GPUs: the executor says so)
        return f"cuda:{base + index * tp}"
    return f"cuda:{(index - fit_from_base) % (gpus // tp) * tp}"


def cuda_device_count() -> int:
    """The host's GPUs (0 where torch sees none: the executor then says what is wrong)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
