"""Per-region NATS users (``common.nats_permissions.region_config``) on a real supercluster.

- each role gets exactly the few subjects of a peer region the regions need (the scheduler's
  spill, load question, forwarded watchdog question and abort; the way home of a guest's
  stream), and every subject a service's code names under ``subjects_of(<peer>)`` is in it;
- the checked-in supercluster configs include their region's users and nats-server accepts
  them (passwords from the environment);
- two regions of two servers each, every service of both logged in as its own user: an
  overloaded us-east spills to eu-west, every stream ends with the greedy text, the watchdog's
  question and the client's abort are forwarded to eu-west, and no service meets a
  permissions violation;
- what must not cross is refused by the real servers: a us-east tokenizer cannot submit to
  eu-west, a us-east executor cannot take eu-west's work, a eu-west gateway cannot read
  us-east's inboxes, a scheduler cannot read another region's replies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client

from common.config import NatsAuth
from common.nats_permissions import ANY, ROLES, password_variable, region_config
from common.nats_server import nats_server_binary
from common.recent_ids import RecentIds
from common.subjects import region_subjects
from common.wire.scheduler import RequestStatusQuery, RequestStatusReply
from services.launcher.nats_cluster import ClusterPlan, Supercluster
from tests.mesh import (
    MeshHarness,
    RegionMeshes,
    runtime_of,
    start_region_mesh,
    stream_greedy,
    wait_for,
)
from tests.test_nats_permissions import (
    JETSTREAM_MEMBERS,
    PACKAGES,
    Login,
    Received,
    denied,
    settle,
    subject_members,
)

ROOT = Path(__file__).resolve().parent.parent
REGIONS = ("us-east", "eu-west")
EAST, WEST = (region_subjects("mesh.v1", r) for r in REGIONS)
STEP_S = 0.015
PROMPT = "hello region"
# Each region's servers have their own users: other passwords than the other region's.
PASSWORDS = {r: {role: f"pw-{r}-{role}-0123456789" for role in ROLES} for r in REGIONS}
# What each role of us-east may do under eu-west's prefix, and nothing more.
PEER_GRANTS = {
    "scheduler": {
        WEST.scheduler_spill,  # a spilled request
        WEST.abort,  # the client's abort of one, forwarded
        WEST.gateway_inbox(ANY),  # a guest of eu-west's that fails here
        WEST.scheduler_region_status,  # your load? (request/reply)
        WEST.scheduler_status,  # the watchdog's question about spilled requests, forwarded
    },
    "executor": {WEST.gateway_inbox(ANY)},  # a guest's error reply
    "detokenizer": {WEST.gateway_inbox(ANY)},  # a guest's text
}
# The stages a spilled request passes through in the region serving it: they answer to its
# reply_to, the home region's gateway inbox (the tokenizer ran at home, before the spill).
GUEST_STAGES = {"scheduler", "executor", "detokenizer"}


def east_role(role: str) -> tuple[set[str], set[str]]:
    perms = ROLES[role](EAST, (WEST,), "us-east")
    return set(perms.publish), set(perms.subscribe)


@pytest.mark.parametrize("role", sorted(ROLES))
def test_a_role_gets_exactly_what_crosses_to_a_peer(role: str) -> None:
    publish, subscribe = east_role(role)
    peer = "mesh.v1.eu-west."
    assert {s for s in publish if s.startswith(peer)} == PEER_GRANTS.get(role, set())
    assert not [s for s in subscribe if s.startswith(peer)]  # nothing of a peer comes in
    # The rest is the role in its own region, with its region's reply inbox.
    alone = ROLES[role](EAST, (), "us-east")
    assert publish - PEER_GRANTS.get(role, set()) == set(alone.publish)
    assert subscribe == set(alone.subscribe)
    for subject in publish | subscribe:
        assert subject.startswith(("mesh.v1.us-east.", peer, "$JS.")) or subject == (
            f"_INBOX.{role}.us-east.>"
        ), subject
    assert not [s for s in publish | subscribe if "KV_EVENTS" in s and "US_EAST" not in s]


@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_subject_a_service_names_is_in_its_region_role(role: str) -> None:
    source = "\n".join(
        path.read_text() for path in (ROOT / "services" / PACKAGES[role]).rglob("*.py")
    )
    publish, subscribe = east_role(role)
    own, peer = subject_members(EAST), subject_members(WEST)
    for name in sorted({n for n in re.findall(r"\.(\w+)", source) if n in own}):
        if name in JETSTREAM_MEMBERS:
            assert any(EAST.kv_events_stream in s for s in publish), (role, name)
        else:
            assert own[name] in publish | subscribe, (role, name)
    # Another region's subjects: only what the code sends there (spill.py).
    for name in sorted(set(re.findall(r"subjects_of\([^()]*\)\s*\.(\w+)", source))):
        assert peer[name] in publish, (
            f"services/{PACKAGES[role]} sends to another region's subjects.{name}, which the "
            f"{role} role does not grant for peers: add it in common/nats_permissions.py"
        )
    if role in GUEST_STAGES:
        assert "reply_to" in source and WEST.gateway_inbox(ANY) in publish, role


def test_the_supercluster_configs_include_their_region_s_users(tmp_path: Path) -> None:
    env = {**os.environ, "NATS_SERVER_NAME": "check"}
    env.update({password_variable(role): "pw" for role in ROLES})
    for region in REGIONS:
        conf = ROOT / "deploy" / "nats" / f"supercluster-{region}.conf"
        assert f"\ninclude ./authorization-{region}.conf\n" in conf.read_text()
        run = [nats_server_binary(), "-t", "-c", str(conf)]
        checked = subprocess.run(run, env=env, capture_output=True, text=True, timeout=30)
        assert checked.returncode == 0, checked.stderr
        # The passwords come from each server's environment: none set, no start.
        missing = {k: v for k, v in env.items() if k != password_variable("executor")}
        checked = subprocess.run(run, env=missing, capture_output=True, text=True, timeout=30)
        assert checked.returncode != 0
        assert password_variable("executor") in checked.stdout + checked.stderr


# -- two regions, every service as its own user ------------------------------------------------


@dataclass
class Regions(RegionMeshes):
    supercluster: Supercluster


def auth(region: str, role: str) -> NatsAuth:
    return NatsAuth(role, PASSWORDS[region][role])


@pytest.fixture(scope="module")
def regions(tiny_llama: Path) -> Iterator[Regions]:
    users = {r: region_config(r, [p for p in REGIONS if p != r], PASSWORDS[r]) for r in REGIONS}
    plans = [ClusterPlan.free(r, 2, gateways=True) for r in REGIONS]
    supercluster = Supercluster.start(plans, authorization=users)
    meshes: dict[str, MeshHarness] = {}
    try:
        supercluster.wait_jetstream(
            connect_options={r: auth(r, "prefix-index").connect_options(r) for r in REGIONS}
        )
        for region in REGIONS:
            url = supercluster.clusters[region].url
            logins = {role: auth(region, role) for role in ROLES}
            meshes[region] = start_region_mesh(
                tiny_llama, region, REGIONS, url, STEP_S, users=logins
            )
        yield Regions(meshes, supercluster)
    finally:
        for mesh in meshes.values():
            mesh.stop()
        supercluster.stop()


@pytest.fixture
async def login(regions: Regions) -> AsyncIterator[Callable[[str, str], Awaitable[Login]]]:
    made: list[Client] = []

    async def connect(region: str, role: str) -> Login:
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        nc = await nats.connect(
            regions.supercluster.clusters[region].url.split(","),
            error_cb=on_error,
            allow_reconnect=False,
            **auth(region, role).connect_options(region),
        )
        made.append(nc)
        return Login(nc, errors)

    yield connect
    for nc in made:
        await nc.close()


async def on_loop(mesh: MeshHarness, coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` on the mesh's loop (its services' connections live there)."""
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, mesh.loop))


def violations(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "permissions violation" in r.getMessage()]


def guests(regions: Regions, region: str) -> int:
    """Guests (spilled-in requests) running on ``region``'s executors, as last reported."""
    executors = regions.scheduler(region).router.executors.values()
    return sum(e.heartbeat.guests for e in executors)


async def test_an_overloaded_region_spills_with_every_service_as_its_own_user(
    regions: Regions, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    east, east_sched = regions.meshes["us-east"], regions.scheduler("us-east")
    await wait_for(lambda: regions.sees_peer("us-east"), 20, "eu-west's load report")
    await wait_for(lambda: regions.sees_peer("eu-west"), 20, "us-east's load report")
    expected = await stream_greedy(east.base_url, PROMPT, 100)
    assert expected[1] == "length"
    spilled, spilled_in = regions.spilled("us-east"), regions.spilled_in("eu-west")
    load = [asyncio.ensure_future(stream_greedy(east.base_url, PROMPT, 100)) for _ in range(8)]
    await wait_for(lambda: regions.spilled("us-east") > spilled, 20, "a spill")

    # The watchdog's question about spilled requests goes on to eu-west, which answers.
    async def alive() -> list[str]:
        return await east_sched.spill.alive_elsewhere(east_sched.spill.spilled.keys())

    assert await on_loop(east, alive()), "eu-west did not answer for its guests"
    results = await asyncio.wait_for(asyncio.gather(*load), 120)
    assert results == [expected] * 8
    assert regions.spilled_in("eu-west") - spilled_in >= regions.spilled("us-east") - spilled
    assert not violations(caplog)


@pytest.mark.parametrize("record", ["kept", "lost"])
async def test_a_client_leaving_aborts_its_spilled_stream_in_the_other_region(
    regions: Regions, caplog: pytest.LogCaptureFixture, record: str
) -> None:
    """``lost``: us-east's scheduler no longer knows where it sent them (it restarted, or
    the record expired), so the abort goes to every peer region."""
    caplog.set_level(logging.WARNING)
    east = regions.meshes["us-east"]
    await wait_for(lambda: regions.sees_peer("us-east"), 20, "eu-west's load report")
    await wait_for(lambda: guests(regions, "eu-west") == 0, 20, "eu-west without guests")
    # 200 tokens at 15 ms a step: each stream runs 3 s at least. A request spills when it
    # arrives to a queue already long (at submit), so they come one after another.
    spilled = regions.spilled("us-east")
    load: list[asyncio.Future[tuple[str, str | None]]] = []
    while regions.spilled("us-east") == spilled:
        assert len(load) < 16, "nothing spilled"
        load.append(asyncio.ensure_future(stream_greedy(east.base_url, PROMPT, 200)))
        await asyncio.sleep(0.2)
    await wait_for(
        lambda: guests(regions, "eu-west") > 0 or any(t.done() for t in load), 20, "a guest"
    )
    assert not [t for t in load if t.done()], [t.result() for t in load if t.done()]
    if record == "lost":
        spill = regions.scheduler("us-east").spill

        async def forget() -> None:
            spill.spilled = RecentIds(ttl_s=spill.spilled.ttl_s)

        await on_loop(east, forget())
    for task in load:  # the clients leave: the gateway aborts, us-east forwards it
        task.cancel()
    await asyncio.gather(*load, return_exceptions=True)
    await wait_for(lambda: guests(regions, "eu-west") == 0, 2, "the guests aborted")
    assert not violations(caplog)


async def test_what_must_not_cross_is_refused(regions: Regions, login) -> None:
    # A us-east tokenizer cannot submit work to eu-west's scheduler.
    tokenizer = await login("us-east", "tokenizer")
    await tokenizer.nc.publish(WEST.scheduler_submit, b"forged")
    assert await tokenizer.violations(1) == [denied("publish", WEST.scheduler_submit)]
    # A us-east executor cannot take eu-west's work, nor its spilled requests.
    executor = await login("us-east", "executor")
    for subject in (WEST.executor_submit("executor-0"), WEST.executor_submit(ANY)):
        await executor.nc.subscribe(subject, cb=Received().cb)
    await executor.nc.publish(WEST.scheduler_spill, b"forged")
    assert await executor.violations(3) == [
        denied("subscription", WEST.executor_submit("executor-0")),
        denied("subscription", WEST.executor_submit(ANY)),
        denied("publish", WEST.scheduler_spill),
    ]
    # A eu-west gateway cannot read us-east's inboxes (its streams, its watchdog's replies).
    gateway = await login("eu-west", "gateway")
    spied = Received()
    for subject in (EAST.gateway_inbox(ANY), "_INBOX.gateway.us-east.>"):
        await gateway.nc.subscribe(subject, cb=spied.cb)
    assert await gateway.violations(2) == [
        denied("subscription", EAST.gateway_inbox(ANY)),
        denied("subscription", "_INBOX.gateway.us-east.>"),
    ]
    # The same user name in the other region: its replies stay its own.
    scheduler = await login("eu-west", "scheduler")
    await scheduler.nc.subscribe("_INBOX.scheduler.us-east.>", cb=spied.cb)
    await scheduler.nc.subscribe(EAST.scheduler_spill, cb=spied.cb)
    assert await scheduler.violations(2) == [
        denied("subscription", "_INBOX.scheduler.us-east.>"),
        denied("subscription", EAST.scheduler_spill),
    ]
    # What does cross still does: a us-east guest's text reaches eu-west's gateway, and
    # us-east's scheduler asks eu-west's, through the real gateway link.
    detokenizer = await login("us-east", "detokenizer")
    home_gateway = await login("eu-west", "gateway")
    inbox = Received()
    await home_gateway.nc.subscribe(WEST.gateway_inbox("gw-probe"), cb=inbox.cb)
    await home_gateway.nc.flush()
    await wait_for(lambda: bool(regions.sees_peer("us-east")), 20, "eu-west's load report")
    east_sched = runtime_of(regions.scheduler("us-east"))
    asked = east_sched.request(
        WEST.scheduler_status, RequestStatusQuery(["nobody"]), RequestStatusReply, 5
    )
    assert (await on_loop(regions.meshes["us-east"], asked)).known == []
    for _ in range(50):  # the gateways learn the new interest asynchronously
        await detokenizer.nc.publish(WEST.gateway_inbox("gw-probe"), b"text")
        await detokenizer.nc.flush()
        if inbox.messages:
            break
        await asyncio.sleep(0.1)
    await settle(inbox)
    assert await detokenizer.violations() == [] and await home_gateway.violations() == []
    assert spied.messages == []
