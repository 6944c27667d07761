"""An in-process mesh for tests: a real nats-server, every service on one background loop.

Services are the same classes the processes run; only the process boundary is skipped, so a
test starts in a second instead of five interpreters importing torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

from common.config import MeshConfig, NatsAuth
from common.metrics import counter_total
from common.nats_server import LocalNatsServer, free_port
from common.runtime import Service
from services.detokenizer.service import DetokenizerConfig, DetokenizerService
from services.executor.config import ExecutorConfig
from services.executor.service import ExecutorService, build_engine
from services.launcher.nats_cluster import ClusterPlan, Supercluster
from services.prefix_index.service import PrefixIndexConfig, PrefixIndexService
from services.scheduler.regions import RegionConfig
from services.scheduler.service import SchedulerService, SchedulerServiceConfig
from services.tokenizer.service import TokenizerConfig, TokenizerService
from tools.bench.paced import slow_step
from tools.bench.scrape import metric_sums


def metric_value(metrics_url: str, name: str) -> float:
    """The sum over every series of metric ``name`` on a service's /metrics (text format)."""
    sums = metric_sums(metrics_url)
    if name not in sums:
        raise AssertionError(f"{metrics_url} has no {name}")
    return sums[name]


def resumed(mesh: MeshHarness) -> float:
    """Choices the mesh's gateway resumed after finding them lost (0 before the first: the
    counter is labelled, so it has no series until then)."""
    return metric_sums(f"http://127.0.0.1:{mesh.port}/metrics").get(
        "meshserve:requests_resumed_total", 0.0
    )


def openai_client(base_url: str, api_key: str = "unused") -> openai.AsyncOpenAI:
    """An OpenAI client for one test: use it as ``async with``, so it closes in the test's loop.

    An unclosed ``AsyncOpenAI`` is dangerous in a long test run: the garbage collector closes
    its sockets first, then its ``__del__`` schedules ``aclose()``, which aborts the dead
    transports and so unregisters their file descriptors from the event loop. A socket that
    reused such a descriptor meanwhile (another client's request) is silently dropped from the
    loop and never sees its response. ``timeout`` bounds any other hang to two minutes.
    """
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)


# The instance names ``_start_services`` gives (up to the first "-") -> the service's role.
HARNESS_ROLES = {
    "tok": "tokenizer",
    "sched": "scheduler",
    "detok": "detokenizer",
    "index": "prefix-index",
    "executor": "executor",
    "prefill": "executor",
    "decode": "executor",
    "speculator": "speculator",
    "gw": "gateway",
}


def runtime_of(service: Any) -> Service:
    """The ``Service`` runtime inside a harness service (the gateway keeps its in its mesh
    client)."""
    runtime: Service = service.mesh.service if hasattr(service, "mesh") else service.svc
    return runtime


@dataclass
class MeshHarness:
    model: Path
    executors: int = 1
    # Disaggregated: one role per executor (``--role``), e.g. ("prefill", "decode"); their ids
    # are then prefill-0, decode-0, ... as under ``meshserve up``.
    roles: tuple[str, ...] = ()
    # Tensor-parallel size of each executor (``--tensor-parallel-size``); () is 1 for all.
    tensor_parallel: tuple[int, ...] = ()
    kv_cache_tokens: int = 4096
    page_size: int = 16
    max_num_seqs: int = 64
    router: str = "least-load"
    with_gateway: bool = True
    scheduler_options: dict[str, Any] = field(default_factory=dict)
    index: PrefixIndexService | None = None
    max_queue: int = 1024
    request_timeout_s: float = 120.0
    nats_args: tuple[str, ...] = ()
    nats_config: str | None = None  # a nats-server config file's text (LocalNatsServer -c)
    auth: NatsAuth = field(default_factory=NatsAuth)
    # One NATS user per service: role (common/nats_permissions.py) -> credentials; a role not
    # listed uses ``auth``.
    users: dict[str, NatsAuth] = field(default_factory=dict)
    otlp_endpoint: str = ""  # export every service's spans here (OTLP/HTTP base URL)
    serve_metrics: bool = False  # /metrics on a free loopback port for non-gateway services
    # Speculative decoding: executors' --speculator/--num-speculative-tokens; a draft model
    # folder starts a speculator service too.
    speculator: str = "off"
    num_speculative_tokens: int = 0
    draft_model: Path | None = None
    nats: LocalNatsServer | None = None
    # A NATS cluster started elsewhere (comma-separated URLs): no server of its own then.
    nats_url: str = ""
    region: str = ""  # every service's --region
    kv_replicas: int = 1
    required_stages: tuple[str, ...] | None = None  # the gateway's; None: its default
    gateway_options: dict[str, Any] = field(default_factory=dict)  # more GatewayConfig fields
    executor_options: dict[str, Any] = field(default_factory=dict)  # more ExecutorConfig fields
    # executor index -> ExecutorConfig fields for that one alone
    executor_overrides: dict[int, dict[str, Any]] = field(default_factory=dict)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    thread: threading.Thread | None = None
    services: list[Any] = field(default_factory=list)
    executor_services: list[ExecutorService] = field(default_factory=list)
    port: int = 0

    def mesh_config(self, name: str) -> MeshConfig:
        assert self.nats is not None or self.nats_url
        return MeshConfig(
            nats_url=self.nats_url or self.nats.url,  # type: ignore[union-attr]
            region=self.region,
            kv_replicas=self.kv_replicas,
            instance_id=name,
            auth=self.users.get(HARNESS_ROLES.get(name.split("-")[0], ""), self.auth),
            otlp_endpoint=self.otlp_endpoint,
            metrics_port=0 if self.serve_metrics else None,
            metrics_host="127.0.0.1",
        )

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def start(self) -> MeshHarness:
        if not self.nats_url:
            self.nats = LocalNatsServer.start(extra_args=self.nats_args, config=self.nats_config)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self._start_services(), timeout=300)
        return self

    async def _start_services(self) -> None:
        model = str(self.model)
        tok = TokenizerService(TokenizerConfig(self.mesh_config("tok"), model, self.page_size))
        sched = SchedulerService(
            SchedulerServiceConfig(
                self.mesh_config("sched"), self.router, self.max_queue, **self.scheduler_options
            )
        )
        detok = DetokenizerService(DetokenizerConfig(self.mesh_config("detok"), model))
        self.index = PrefixIndexService(PrefixIndexConfig(self.mesh_config("index-0")))
        self.services = [tok, self.index, sched, detok]
        roles = self.roles or ("mixed",) * self.executors
        for i, role in enumerate(roles):
            name = f"executor-{i}" if role == "mixed" else f"{role}-{roles[:i].count(role)}"
            config = ExecutorConfig(
                self.mesh_config(name),
                model,
                role=role,
                page_size=self.page_size,
                kv_cache_tokens=self.kv_cache_tokens,
                max_num_seqs=self.max_num_seqs,
                speculator=self.speculator,
                num_speculative_tokens=self.num_speculative_tokens,
                tensor_parallel_size=self.tensor_parallel[i] if self.tensor_parallel else 1,
                **(self.executor_options | self.executor_overrides.get(i, {})),
            )
            ex = ExecutorService(config, build_engine(config))
            self.executor_services.append(ex)
            self.services.append(ex)
        if self.draft_model is not None:
            from services.speculator.service import (
                SpeculatorConfig,
                SpeculatorService,
                build_proposer,
            )

            spec_config = SpeculatorConfig(
                self.mesh_config("speculator-0"), str(self.draft_model), page_size=self.page_size
            )
            self.services.append(SpeculatorService(spec_config, build_proposer(spec_config)))
        if self.with_gateway:
            from services.gateway.app import GatewayServer
            from services.gateway.config import GatewayConfig

            self.port = free_port()
            gateway_options: dict[str, Any] = dict(self.gateway_options)
            if self.required_stages is not None:
                gateway_options["required_stages"] = self.required_stages
            gw = GatewayServer(
                GatewayConfig(
                    mesh=self.mesh_config("gw"),
                    host="127.0.0.1",
                    port=self.port,
                    served_model_name="tiny",
                    max_model_len=256,
                    request_timeout_s=self.request_timeout_s,
                    **gateway_options,
                )
            )
            self.services.append(gw)
        for svc in self.services:
            await svc.start()
            runtime_of(svc).ready.set()  # as serve_until_shutdown does: presence may begin
        await asyncio.sleep(0.6)  # first heartbeats reach the scheduler and gateway

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def slow_steps(self, step_s: float, prefill_s_per_token: float = 0.0) -> None:
        """Every executor's engine step takes ``step_s`` longer (and ``prefill_s_per_token``
        per prompt token it computes, ``paced.py``): streams last long enough to be cut, and
        an executor's capacity is known whatever the machine's speed."""
        for executor in self.executor_services:
            slow_step(executor, step_s, prefill_s_per_token)

    def stop(self) -> None:
        async def close_all() -> None:
            for svc in reversed(self.services):
                closer = getattr(svc, "stop", None) or svc.svc.close
                await closer()

        try:
            self.call(close_all(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            if self.thread:
                self.thread.join(5)
            if self.nats:
                self.nats.stop()


def tiny_executor(nats_url: str, model: Path, instance_id: str, **config: Any) -> ExecutorService:
    """One executor on its own (no mesh around it) for the executor's tests: 4-token pages,
    a 256-token KV cache and a normal-priority engine thread unless ``config`` says else."""
    options: dict[str, Any] = {"page_size": 4, "kv_cache_tokens": 256, "engine_nice": 0}
    executor_config = ExecutorConfig(
        MeshConfig(nats_url, instance_id=instance_id), str(model), **(options | config)
    )
    return ExecutorService(executor_config, build_engine(executor_config))


async def stream_greedy(base_url: str, prompt: str, max_tokens: int) -> tuple[str, str | None]:
    """The text and finish reason of one streamed greedy completion (ignore_eos; the client
    raises on any status but 200)."""
    async with openai_client(base_url) as client:
        text, finish = "", None
        stream = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish


async def wait_for(check: Callable[[], Any], timeout: float, what: str) -> None:
    """Poll ``check`` every 0.1 s until it is true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def start_region_mesh(
    model: Path,
    region: str,
    regions: tuple[str, ...],
    nats_url: str,
    step_s: float,
    max_num_seqs: int = 2,
    executors: int = 1,
    spill_queue_ms: float = 100.0,
    spill_reserve_executors: int = 0,
    users: dict[str, NatsAuth] | None = None,
    prefill_s_per_token: float = 0.0,
) -> MeshHarness:
    """One region's whole mesh (the two-region tests and ``tools/bench/region_mesh.py``): its
    executors slowed to ``step_s`` a step, spilling to the other ``regions`` past
    ``spill_queue_ms`` of queue. One executor per region keeps none in reserve, or no region
    would take guests. ``users``: each role's NATS login (``MeshHarness.users``)."""
    mesh = MeshHarness(
        model,
        max_num_seqs=max_num_seqs,
        executors=executors,
        nats_url=nats_url,
        region=region,
        kv_replicas=2,
        users=dict(users or {}),
        required_stages=("tokenizer", "scheduler", "detokenizer"),
        scheduler_options={
            "regions": RegionConfig(
                peer_regions=tuple(r for r in regions if r != region),
                spill_queue_ms=spill_queue_ms,
                spill_reserve_executors=spill_reserve_executors,
            )
        },
    ).start()
    mesh.slow_steps(step_s, prefill_s_per_token)
    return mesh


@contextlib.contextmanager
def supercluster_meshes(
    model: Path,
    plans: list[ClusterPlan],
    step_s: float,
    gateway_urls: Mapping[str, list[str]] | None = None,
) -> Iterator[tuple[Supercluster, dict[str, MeshHarness]]]:
    """A supercluster of one cluster per plan (``gateway_urls``: as ``Supercluster.start``)
    and a whole mesh per region on it (``start_region_mesh``); all stopped on exit."""
    regions = tuple(plan.name for plan in plans)
    meshes: dict[str, MeshHarness] = {}
    supercluster: Supercluster | None = None
    try:
        supercluster = Supercluster.start(plans, gateway_urls)
        supercluster.wait_jetstream()
        for region in regions:
            url = supercluster.clusters[region].url
            meshes[region] = start_region_mesh(model, region, regions, url, step_s)
        yield supercluster, meshes
    finally:
        for mesh in meshes.values():
            mesh.stop()
        if supercluster is not None:
            supercluster.stop()


@dataclass
class RegionMeshes:
    """One in-process mesh per region (the supercluster and partition tests)."""

    meshes: dict[str, MeshHarness]

    def scheduler(self, region: str) -> SchedulerService:
        return next(s for s in self.meshes[region].services if isinstance(s, SchedulerService))

    def spilled(self, region: str) -> float:
        """Requests this region's scheduler sent to another region so far."""
        return counter_total(self.scheduler(region).spill.spilled_total)

    def spilled_in(self, region: str) -> float:
        """Requests another region's scheduler sent here so far."""
        return counter_total(self.scheduler(region).spill.received_total)

    def sees_peer(self, region: str) -> bool:
        """Whether this region's scheduler has a fresh load report from another region."""
        return bool(self.scheduler(region).spill.remotes(1))
