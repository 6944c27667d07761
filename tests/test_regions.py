"""The region decision (services/scheduler/regions.py) alone, and the cluster configs."""

from __future__ import annotations

import math
import signal

import pytest

from common.config import MeshConfig
from services.launcher.mesh import LocalMesh
from services.launcher.nats_cluster import ClusterPlan, Supercluster, server_config
from services.launcher.regions import RegionMesh
from services.launcher.up import parse_up_args
from services.scheduler.regions import QueueEstimate, RegionConfig, RegionLoad, choose_region

HOME = "us-east"


def load(region: str = HOME, **kw: float) -> RegionLoad:
    values = {
        "live_executors": 1, "queue_ms": 0.0, "rtt_ms": 0.0, "spare_seqs": 4,
        "guest_executors": 1, **kw,
    }  # fmt: skip
    return RegionLoad(
        region,
        int(values["live_executors"]),
        values["queue_ms"],
        values["rtt_ms"],
        int(values.get("uncached_tokens", 0)),
        int(values["spare_seqs"]),
        int(values["guest_executors"]),
    )


def test_within_budget_stays_home_even_if_elsewhere_is_idle() -> None:
    d = choose_region(load(queue_ms=90), [load("eu-west", rtt_ms=1)], 100, 0.1)
    assert (d.region, d.reason) == (HOME, "local")


def test_over_budget_goes_to_the_cheapest_region() -> None:
    remotes = [
        load("eu-west", queue_ms=50, rtt_ms=80),
        load("ap-south", queue_ms=0, rtt_ms=200),
    ]
    d = choose_region(load(queue_ms=800), remotes, 100, 0.1)
    assert (d.region, d.reason) == ("eu-west", "over-budget")
    assert d.cost_ms == pytest.approx(130)
    assert d.spilled(HOME)


def test_a_cold_prefill_and_the_round_trip_can_make_waiting_home_cheaper() -> None:
    home = load(queue_ms=300, uncached_tokens=0)  # its cache holds the prompt
    remote = load("eu-west", queue_ms=0, rtt_ms=150, uncached_tokens=2000)  # 150 + 200
    d = choose_region(home, [remote], 100, 0.1)
    assert (d.region, d.reason) == (HOME, "no-better-region")


def test_no_spare_slots_elsewhere_keeps_the_request_home() -> None:
    d = choose_region(load(queue_ms=5000), [load("eu-west", spare_seqs=0)], 100, 0.1)
    assert d.region == HOME


def test_without_local_executors_everything_goes_to_a_live_region() -> None:
    home = load(live_executors=0)
    remotes = [load("eu-west", live_executors=0), load("ap-south", spare_seqs=0, queue_ms=900)]
    d = choose_region(home, remotes, 100, 0.1)
    assert (d.region, d.reason) == ("ap-south", "no-local-executor")
    # ... and with no live region anywhere it waits at home.
    assert choose_region(home, [load("eu-west", live_executors=0)], 100, 0.1).region == HOME
    assert math.isinf(choose_region(home, [], 100, 0.1).cost_ms)


def test_without_local_executors_a_region_that_takes_no_guests_is_passed_over() -> None:
    # eu-west is live but keeps every executor guest-free (--spill-reserve-executors): it
    # would send a guest straight back (SchedulerService.return_guests), so it waits at home.
    home = load(live_executors=0)
    no_guests = load("eu-west", live_executors=1, guest_executors=0, spare_seqs=0)
    assert choose_region(home, [no_guests], 100, 0.1).region == HOME
    busy = load("ap-south", queue_ms=5000, spare_seqs=0)
    assert choose_region(home, [no_guests, busy], 100, 0.1).region == "ap-south"


def test_queue_estimate_from_dispatch_rate_and_oldest_wait() -> None:
    est = QueueEstimate(window_s=5)
    assert est.queue_ms(0, 0.0, has_room=True, now=100) == 0
    assert est.queue_ms(3, 0.4, has_room=False, now=100) == pytest.approx(400)  # no rate yet
    for i in range(11):
        est.dispatched(now=100 + i * 0.1)  # 10 per second
    assert est.queue_ms(9, 0.2, has_room=False, now=101) == pytest.approx(1000, rel=0.1)
    assert est.queue_ms(0, 3.0, has_room=False, now=101) == pytest.approx(3000)


def test_region_names_and_config_are_checked() -> None:
    with pytest.raises(ValueError, match="region"):
        MeshConfig(region="US East")
    with pytest.raises(ValueError, match="peer regions"):
        RegionConfig(peer_regions=("eu.west",))
    mesh = MeshConfig(nats_url="nats://a:1, nats://b:2", region="eu-west")
    assert mesh.nats_servers == ["nats://a:1", "nats://b:2"]
    assert mesh.subjects.scheduler_submit == "mesh.v1.eu-west.scheduler.submit"
    assert mesh.subjects_of("us-east").scheduler_spill == "mesh.v1.us-east.scheduler.spill"
    assert MeshConfig().subjects.scheduler_submit == "mesh.v1.scheduler.submit"


def test_server_config_lists_the_other_routes_and_gateways() -> None:
    plan = ClusterPlan("eu-west", (4222, 4223), (6222, 6223), (7222, 7223))
    text = server_config(plan, 1, {"us-east": ["127.0.0.1:9000"]}, "127.0.0.1:9100")
    assert 'server_name: "eu-west-1"' in text and 'server_tags: ["region:eu-west"]' in text
    assert 'routes: ["nats://127.0.0.1:6222"]' in text  # not its own
    assert '{name: "us-east", urls: ["nats://127.0.0.1:9000"]}' in text
    assert 'advertise: "127.0.0.1:9100"' in text


def test_up_regions_with_one_executor_keeps_none_guest_free(monkeypatch, tmp_path):
    # The scheduler keeps --spill-reserve-executors 1 guest-free by default: with one executor
    # per region, `meshserve up --regions` would then never take spilled work.
    spawned: dict[str, tuple[str, ...]] = {}
    monkeypatch.setattr(
        LocalMesh, "spawn", lambda self, name, module, *flags: spawned.update({name: flags})
    )
    for extra, reserve in (([], ["--spill-reserve-executors", "0"]), (["--executors", "2"], [])):
        args = parse_up_args(["--regions", "us-east,eu-west", *extra])
        mesh = RegionMesh(args, tmp_path, region="eu-west", peers=("us-east",))
        mesh.spawn("scheduler", "services.scheduler")
        assert spawned["eu-west-scheduler"] == (
            "--region",
            "eu-west",
            "--peer-regions",
            "us-east",
            *reserve,
        )


def test_up_regions_give_every_service_its_own_metrics_port(monkeypatch, tiny_llama) -> None:
    """Each region numbers its /metrics ports on from where the previous region stopped (both
    regions once took the same ports, and the second to bind exited)."""
    from types import SimpleNamespace

    from services.launcher import regions

    commands: dict[str, list[str]] = {}

    def popen(self: LocalMesh, name: str) -> SimpleNamespace:
        commands.update(self.commands)
        return SimpleNamespace(poll=lambda: 0)  # an exited process, for stop()

    monkeypatch.setattr(LocalMesh, "popen", popen)
    clusters = {r: SimpleNamespace(url=f"nats://127.0.0.1:{i + 1}") for i, r in enumerate("ab")}
    fake = SimpleNamespace(clusters=clusters, wait_jetstream=lambda: None, stop=lambda: None)
    monkeypatch.setattr(Supercluster, "start", lambda plans: fake)
    args = parse_up_args(["--regions", "a,b", "--executors", "2", "--metrics-port", "9101"])
    _, meshes = regions.start_regions(args, tiny_llama)
    ports = [
        int(c[c.index("--metrics-port") + 1]) for c in commands.values() if "--metrics-port" in c
    ]
    per_region = len(commands) // 2 - 1  # all but the gateway, which serves it on its HTTP port
    assert sorted(ports) == list(range(9101, 9101 + 2 * per_region))
    urls = [u for m in meshes for n, u in m.metrics_urls.items() if not n.endswith("gateway")]
    assert sorted(int(u.split(":")[2].split("/")[0]) for u in urls) == sorted(ports)


def test_up_stops_its_nats_cluster_when_jetstream_never_answers(monkeypatch, tmp_path) -> None:
    """The cluster's servers run in a session of their own: a failed start must stop them."""
    from common.nats_server import LocalNatsServer
    from services.launcher import up
    from services.launcher.nats_cluster import NatsCluster

    started: list[LocalNatsServer] = []
    start = LocalNatsServer.start

    def recorded(*a, **kw) -> LocalNatsServer:
        started.append(start(*a, **kw))
        return started[-1]

    def never(self, *a, **kw) -> None:
        raise TimeoutError("JetStream did not answer")

    monkeypatch.setattr(LocalNatsServer, "start", recorded)
    monkeypatch.setattr(NatsCluster, "wait_jetstream", never)
    monkeypatch.setattr(up, "resolve_model", lambda spec: tmp_path)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # leave pytest's handlers
    args = up.parse_up_args(["--nats-cluster-size", "3", "--log-dir", str(tmp_path / "logs")])
    assert up.run_up(args) == 1
    assert len(started) == 3
    assert all(server.process.poll() is not None for server in started)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--executors", "0"], "no executor would decode"),
        (["--prefill-executors", "1"], "no executor would decode"),
        (["--executors", "-1"], "--executors must be >= 0"),
        (["--decode-executors", "-2"], "--decode-executors must be >= 0"),
        (["--nats-cluster-size", "0"], "--nats-cluster-size must be >= 1"),
        (
            ["--prefill-executors", "1", "--decode-executors", "1", "--tensor-parallel-size", "2"],
            "for mixed executors only",
        ),
    ],
)
def test_up_refuses_counts_that_could_never_serve(argv: list[str], message: str, capsys) -> None:
    """Before starting anything (such a mesh waited out --ready-timeout, 600 s)."""
    from services.launcher.cli import main

    assert main(["up", *argv]) == 2
    assert message in capsys.readouterr().err


def test_regions_restart_a_service_that_dies_while_the_mesh_starts(monkeypatch, tmp_path) -> None:
    """``up --regions`` waited for every region with the default check (a service that exits
    fails the whole launch): its supervisors never ran until all regions were healthy, so a
    crash while a model loaded ended ``up`` instead of restarting the service."""
    from services.launcher import regions

    watched: list[object] = []

    def wait_ready(self, timeout, watch=None, until=None) -> None:
        assert watch is not None, "waited without the supervisors"
        watch()
        watched.append(self.region)

    monkeypatch.setattr(RegionMesh, "wait_ready", wait_ready)
    args = parse_up_args(["--nats-url", "nats://127.0.0.1:1"])
    meshes = [RegionMesh(args, tmp_path, region=r, peers=()) for r in ("us-east", "eu-west")]
    polls: list[int] = []
    regions.wait_all_ready(meshes, 10, lambda: polls.append(1))
    assert watched == ["us-east", "eu-west"] and polls == [1, 1]
