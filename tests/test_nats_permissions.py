"""One NATS user per service (common/nats_permissions.py), on a real nats-server.

- deploy/nats/nats-server.conf is exactly what the module generates, and so are the per-region
  deploy/nats/authorization-<region>.conf (tests/test_region_permissions.py: the regions);
- every subject a service's code names is in its role's permissions;
- with the generated config, a client logged in as the tokenizer cannot forge an executor
  heartbeat, subscribe to ``>``, to a gateway's inbox or to another service's reply inbox,
  nor ask the prefix index: nats-py reports the server's permissions violation, and nothing is
  delivered; what the tokenizer needs (encode in, submit and error replies out) works;
- request/reply goes through each requester's own inbox, and an answerer can only answer;
- a service announces its presence under its own name only; only watchers probe;
- JetStream: the executor publishes KV events and the prefix index replays them with the real
  code, but neither may create another stream (one capturing ``mesh.v1.>`` would read every
  prompt);
- the whole in-process mesh serves requests with every service logged in as its own user.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from common.config import MeshConfig, NatsAuth
from common.kv_stream import ensure_kv_stream
from common.nats_permissions import (
    ANY,
    ROLES,
    executor,
    inbox_prefix,
    password_variable,
    region_config,
    server_config,
)
from common.nats_server import LocalNatsServer, free_port
from common.page_hash import page_hashes
from common.runtime import Service
from common.subjects import Subjects
from common.wire.prefix_index import KVEventBatch
from services.executor.kv_events import KVEventPublisher
from tests.mesh import MeshHarness

ROOT = Path(__file__).resolve().parent.parent
S = Subjects()
PAGE = 16  # MeshHarness's page size
PASSWORDS = {role: f"pw-{role}-0123456789" for role in ROLES}
# Where each role's code lives: every subject it names must be in its permissions.
PACKAGES = {
    "gateway": "gateway",
    "tokenizer": "tokenizer",
    "prefix-index": "prefix_index",
    "scheduler": "scheduler",
    "executor": "executor",
    "speculator": "speculator",
    "detokenizer": "detokenizer",
}
# Members that are no NATS subscription of their own but a JetStream stream's name or filter:
# a role that uses them needs that stream's API instead.
JETSTREAM_MEMBERS = {"kv_events_all", "kv_events_stream"}


# The supercluster's two regions (deploy/nats/supercluster-*.conf) -> their peers.
DEPLOYED_REGIONS = {"us-east": ("eu-west",), "eu-west": ("us-east",)}


@pytest.mark.parametrize("region", ["", *DEPLOYED_REGIONS])
def test_the_checked_in_configs_are_the_generated_ones(region: str) -> None:
    if region:
        name = f"authorization-{region}.conf"
        generated = region_config(region, DEPLOYED_REGIONS[region])
        command = f"--region {region} --peer-regions {','.join(DEPLOYED_REGIONS[region])}"
    else:
        name, generated, command = "nats-server.conf", server_config(), ""
    checked_in = (ROOT / "deploy" / "nats" / name).read_text()
    assert checked_in == generated, (
        f"deploy/nats/{name} is stale: "
        f"python -m common.nats_permissions {command} --out deploy/nats/{name}"
    )
    for role in ROLES:  # no secret in the file: nats-server reads them from the environment
        assert f"password: ${password_variable(role)}\n" in checked_in


def subject_members(s: Subjects = S) -> dict[str, str]:
    """Each ``Subjects`` member -> the subject it spells (``ANY`` for an instance id)."""
    out = {}
    for name, member in vars(Subjects).items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            out[name] = getattr(s, name)
        elif callable(member):
            out[name] = getattr(s, name)(ANY)
    return out


@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_subject_a_service_names_is_in_its_role(role):
    members = subject_members()
    source = "\n".join(
        path.read_text() for path in (ROOT / "services" / PACKAGES[role]).rglob("*.py")
    )
    used = {name for name in re.findall(r"\.(\w+)", source) if name in members}
    perms = ROLES[role](S)
    allowed = set(perms.publish) | set(perms.subscribe)
    # Every service's runtime announces itself and answers probes (common/runtime.py).
    assert S.presence(role) in perms.publish and S.presence_probe in perms.subscribe
    for name in sorted(used):
        if name in JETSTREAM_MEMBERS:
            assert any(S.kv_events_stream in subject for subject in perms.publish), (role, name)
        else:
            assert members[name] in allowed, (
                f"services/{PACKAGES[role]} uses subjects.{name} ({members[name]}), which the "
                f"{role} role does not list: add it in common/nats_permissions.py"
            )


def test_a_plain_user_name_scopes_the_reply_inbox():
    assert inbox_prefix("prefix-index") == "_INBOX.prefix-index"
    assert inbox_prefix(None) == inbox_prefix("a.b") == inbox_prefix("x*") == "_INBOX"
    options = NatsAuth("scheduler", "pw").connect_options()
    assert options["inbox_prefix"] == "_INBOX.scheduler"
    # in a region: every region's servers have a "scheduler", each with its own inbox
    options = NatsAuth("scheduler", "pw").connect_options("eu-west")
    assert options["inbox_prefix"] == "_INBOX.scheduler.eu-west"
    assert "inbox_prefix" not in NatsAuth().connect_options()


def test_an_instance_id_is_one_subject_token():
    """The roles match a service's own subjects with one-token wildcards
    (``executor.*.submit``): a dotted id (``$(hostname -f)``) would be refused them on the
    server, and a service only warns of that, so it is refused at start instead."""
    assert "mesh.v1.executor.*.submit" in executor(Subjects()).subscribe
    for bad in ("gpu-1.example.com", "a*", "a b", "x" * 257):
        with pytest.raises(ValueError, match="instance_id"):
            MeshConfig(instance_id=bad)
    assert MeshConfig(instance_id="gpu-1-example-com").instance_id == "gpu-1-example-com"
    assert "." not in MeshConfig().instance_id  # the generated one


# -- on a real nats-server with the generated users ------------------------------------------


@dataclass
class Monitored:
    """The module's nats-server and its monitoring port: a message that does not arrive is
    reported with the server's view of each connection (user, subscriptions, messages in and
    out), which says whether it was published, subscribed to, or lost on the way."""

    nats: LocalNatsServer
    monitor_port: int

    @property
    def url(self) -> str:
        return self.nats.url

    def connections(self) -> str:
        url = f"http://127.0.0.1:{self.monitor_port}/connz?subs=1&auth=1"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                conns = json.load(response)["connections"] or []
        except OSError as exc:
            return f"(no monitoring answer: {exc})"
        return "\n".join(
            f"  {c.get('authorized_user')}: in {c['in_msgs']} out {c['out_msgs']} "
            f"subs {c.get('subscriptions_list', [])}"
            for c in conns
        )


@pytest.fixture(scope="module")
def server() -> Iterator[Monitored]:
    monitor_port = free_port()
    nats_server = LocalNatsServer.start(
        config=server_config(S, PASSWORDS), extra_args=["-m", str(monitor_port)]
    )
    yield Monitored(nats_server, monitor_port)
    nats_server.stop()


class Login:
    """A nats-py connection as one role, keeping the errors the server sent it."""

    def __init__(self, nc: Client, errors: list[Exception]) -> None:
        self.nc = nc
        self.errors = errors

    async def subscribed(self) -> None:
        """Return once the server holds this connection's subscriptions. nats-py's ``flush``
        writes its PING at once, ahead of the SUBs its flusher task has not sent yet, so one
        PONG does not mean the server has them (another connection's publish could then find
        no subscriber: the message is gone). By the first PONG the flusher has written them;
        a second PING goes behind them on the same stream."""
        await self.nc.flush()
        await self.nc.flush()

    async def violations(self, expected: int = 0) -> list[str]:
        """The permissions violations reported so far, once ``expected`` of them are in.

        nats-server may send the ``-ERR`` of a denied publish after the ``PONG`` of a later
        ``PING``, so a flush alone does not wait for it.
        """
        await self.nc.flush()
        deadline = time.monotonic() + 5
        while len(self.found()) < expected and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.found()

    def found(self) -> list[str]:
        messages = [str(e) for e in self.errors if isinstance(e, nats.errors.Error)]
        return [m for m in messages if "permissions violation" in m]


def denied(action: str, subject: str) -> str:
    """The error nats-py reports for a denied ``publish``/``subscription`` (it lower-cases the
    server's ``-ERR`` text, subject included)."""
    return f'nats: permissions violation for {action} to "{subject}"'.lower()


@pytest.fixture
async def login(server: Monitored) -> AsyncIterator[Callable[[str], Awaitable[Login]]]:
    made: list[Client] = []

    async def connect(role: str) -> Login:
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        options = NatsAuth(role, PASSWORDS[role]).connect_options()
        nc = await nats.connect(server.url, error_cb=on_error, allow_reconnect=False, **options)
        made.append(nc)
        return Login(nc, errors)

    yield connect
    for nc in made:
        await nc.close()


class Received:
    """A subscription callback that collects message payloads."""

    def __init__(self) -> None:
        self.messages: list[bytes] = []

    async def cb(self, msg: Msg) -> None:
        self.messages.append(msg.data)


async def settle(*expected: Received, server: Monitored | None = None) -> None:
    """Until each of ``expected`` has received a message (the server forwards asynchronously,
    and a loaded machine can take a while), then a moment more for anything that must NOT
    arrive to have had its chance. A ``server`` with a monitoring port is asked, on a timeout,
    what it saw of each connection."""
    deadline = time.monotonic() + 10
    while not all(r.messages for r in expected):
        if time.monotonic() > deadline:
            waiting = [i for i, r in enumerate(expected) if not r.messages]
            seen = f"; the server's connections:\n{server.connections()}" if server else ""
            raise AssertionError(
                f"after 10 s, receivers {waiting} of {len(expected)} have nothing{seen}"
            )
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)


async def test_the_tokenizer_cannot_forge_an_executor_heartbeat(server, login):
    scheduler, tokenizer, executor = (
        await login("scheduler"),
        await login("tokenizer"),
        await login("executor"),
    )
    beats = Received()
    await scheduler.nc.subscribe(S.executor_heartbeat, cb=beats.cb)
    await scheduler.subscribed()

    await tokenizer.nc.publish(S.executor_heartbeat, b"forged: all load, send me nothing")
    assert await tokenizer.violations(1) == [denied("publish", S.executor_heartbeat)]
    await executor.nc.publish(S.executor_heartbeat, b"real")
    await executor.nc.flush()
    await settle(beats, server=server)
    assert beats.messages == [b"real"]
    assert await scheduler.violations() == [] and await executor.violations() == []


async def test_the_tokenizer_cannot_read_other_traffic(server, login):
    tokenizer, gateway, detokenizer = (
        await login("tokenizer"),
        await login("gateway"),
        await login("detokenizer"),
    )
    inbox = S.gateway_inbox("gw-1")
    spied = Received()
    for subject in (">", "mesh.v1.>", inbox, "_INBOX.>", "_INBOX.scheduler.>"):
        await tokenizer.nc.subscribe(subject, cb=spied.cb)
    assert await tokenizer.violations(5) == [
        denied("subscription", subject)
        for subject in (">", "mesh.v1.>", inbox, "_INBOX.>", "_INBOX.scheduler.>")
    ]
    owner = Received()
    await gateway.nc.subscribe(inbox, cb=owner.cb)
    await gateway.subscribed()
    await detokenizer.nc.publish(inbox, b"the answer")
    await detokenizer.nc.flush()
    await settle(owner, server=server)
    assert await detokenizer.violations() == []
    assert owner.messages == [b"the answer"] and spied.messages == []


async def test_a_service_announces_only_itself(server, login):
    gateway, tokenizer = await login("gateway"), await login("tokenizer")
    seen, probes = Received(), Received()
    await gateway.nc.subscribe(S.presence_all, cb=seen.cb)
    await tokenizer.nc.subscribe(S.presence_probe, cb=probes.cb)
    await gateway.subscribed()
    await tokenizer.subscribed()
    await gateway.nc.publish(S.presence_probe, b"who is there?")
    await gateway.nc.flush()
    await tokenizer.nc.publish(S.presence("tokenizer"), b"me")
    await tokenizer.nc.publish(S.presence("scheduler"), b"posing as the scheduler")
    await tokenizer.nc.publish(S.presence_probe, b"probe storm")
    assert await tokenizer.violations(2) == [
        denied("publish", S.presence("scheduler")),
        denied("publish", S.presence_probe),
    ]
    await settle(seen, probes, server=server)
    assert seen.messages == [b"me"] and probes.messages == [b"who is there?"]


async def test_the_tokenizer_can_do_its_job(server, login):
    gateway, tokenizer, scheduler = (
        await login("gateway"),
        await login("tokenizer"),
        await login("scheduler"),
    )
    encode, submitted, replies = Received(), Received(), Received()
    inbox = S.gateway_inbox("gw-1")
    await tokenizer.nc.subscribe(S.tokenizer_encode, queue="tokenizer", cb=encode.cb)
    await scheduler.nc.subscribe(S.scheduler_submit, queue="scheduler", cb=submitted.cb)
    await gateway.nc.subscribe(inbox, cb=replies.cb)
    for login_ in (tokenizer, scheduler, gateway):
        await login_.subscribed()

    await gateway.nc.publish(S.tokenizer_encode, b"prompt")
    await tokenizer.nc.publish(S.scheduler_submit, b"tokens")
    await tokenizer.nc.publish(inbox, b"error reply")  # a request it cannot tokenize
    for login_ in (gateway, tokenizer):
        await login_.nc.flush()
    await settle(encode, submitted, replies, server=server)
    assert (encode.messages, submitted.messages, replies.messages) == (
        [b"prompt"],
        [b"tokens"],
        [b"error reply"],
    )
    for login_ in (gateway, tokenizer, scheduler):
        assert await login_.violations() == []


async def test_requests_reply_to_the_asker_s_own_inbox_only(server, login):
    scheduler, index = await login("scheduler"), await login("prefix-index")
    executor, speculator = await login("executor"), await login("speculator")
    tokenizer = await login("tokenizer")

    async def answer(msg: Msg) -> None:
        await msg.respond(b"answer to " + msg.data)

    gateway, detokenizer = await login("gateway"), await login("detokenizer")
    await index.nc.subscribe(S.index_match, queue="index", cb=answer)
    await speculator.nc.subscribe(S.speculator_propose, queue="speculator", cb=answer)
    await scheduler.nc.subscribe(S.scheduler_status, queue="scheduler", cb=answer)
    await detokenizer.nc.subscribe(S.detok_progress(3), cb=answer)
    for answerer in (index, speculator, scheduler, detokenizer):
        await answerer.subscribed()

    reply = await scheduler.nc.request(S.index_match, b"hashes", timeout=5)
    assert reply.data == b"answer to hashes"
    assert reply.subject.startswith("_INBOX.scheduler.")
    reply = await executor.nc.request(S.speculator_propose, b"seqs", timeout=5)
    assert reply.data == b"answer to seqs"
    reply = await gateway.nc.request(S.scheduler_status, b"ids", timeout=5)  # the watchdog
    assert reply.data == b"answer to ids"
    reply = await scheduler.nc.request(S.detok_progress(3), b"lost", timeout=5)  # a migration
    assert reply.data == b"answer to lost"

    # Answering is not writing into inboxes at will, nor reading another service's replies.
    await index.nc.publish("_INBOX.scheduler.x.y", b"unasked")
    assert await index.violations(1) == [denied("publish", "_INBOX.scheduler.x.y")]
    await executor.nc.subscribe("_INBOX.scheduler.>", cb=Received().cb)
    assert await executor.violations(1) == [denied("subscription", "_INBOX.scheduler.>")]
    with pytest.raises(nats.errors.TimeoutError):  # the server drops the request
        await tokenizer.nc.request(S.index_match, b"hashes", timeout=0.5)
    # (its reply inbox was refused too: the tokenizer never asks anyone)
    assert denied("publish", S.index_match) in await tokenizer.violations(2)
    for login_ in (scheduler, speculator, gateway, detokenizer):
        assert await login_.violations() == []


async def test_kv_events_flow_through_jetstream_and_nothing_else_does(server, login):
    def service(role: str) -> Service:
        auth = NatsAuth(role, PASSWORDS[role])
        return Service(role, MeshConfig(server.url, instance_id=f"{role}-0", auth=auth))

    executor, index = service("executor"), service("prefix-index")
    batches: list[KVEventBatch] = []
    try:
        await index.connect()
        await ensure_kv_stream(index.nc.jetstream(), S)  # what PrefixIndexService.start does
        await index.nc.jetstream().stream_info(S.kv_events_stream)

        async def on_events(batch: KVEventBatch, pending: int) -> None:
            batches.append(batch)

        await index.replay(S.kv_events_all, KVEventBatch, on_events)
        await executor.connect()
        publisher = KVEventPublisher(executor, "executor-0")
        await publisher.start()  # ensure_kv_stream, then the start-up snapshot (a rollup)
        for _ in range(100):
            if batches:
                break
            await asyncio.sleep(0.05)
        assert [(b.executor_id, b.seq, b.cleared) for b in batches] == [("executor-0", 1, True)]
        assert not publisher.need_snapshot, "the executor's publish was not acknowledged"
        # ensure_kv_stream's question (is the stream of that name this mesh's?), and the
        # index's purge of an executor it forgot
        await executor.nc.jetstream(timeout=2).stream_info(S.kv_events_stream)
        index_js = index.nc.jetstream(timeout=2)
        assert await index_js.purge_stream(S.kv_events_stream, subject=S.kv_events("executor-0"))
        assert (await index_js.stream_info(S.kv_events_stream)).state.messages == 0
    finally:
        executor.stopping.set()
        await executor.close()
        await index.close()

    # A stream over every subject would hand its creator every prompt: no service may make one.
    for role in ("prefix-index", "executor", "tokenizer"):
        intruder = await login(role)
        js = intruder.nc.jetstream(timeout=0.5)
        with pytest.raises(nats.errors.TimeoutError):
            await js.add_stream(name="CAPTURE", subjects=["mesh.v1.>"])
        created = denied("publish", "$JS.API.STREAM.CREATE.CAPTURE")
        assert created in await intruder.violations(2 if role == "tokenizer" else 1)
    tokenizer = await login("tokenizer")
    with pytest.raises(nats.errors.TimeoutError):
        await tokenizer.nc.jetstream(timeout=0.5).stream_info(S.kv_events_stream)
    info = f"$JS.API.STREAM.INFO.{S.kv_events_stream}"
    assert denied("publish", info) in await tokenizer.violations(2)


# -- the whole mesh, each service as its own user ----------------------------------------------


@pytest.fixture(scope="module")
def mesh(tiny_llama: Path) -> Iterator[MeshHarness]:
    users = {role: NatsAuth(role, password) for role, password in PASSWORDS.items()}
    harness = MeshHarness(
        tiny_llama,
        executors=2,  # the kv router asks the prefix index (request/reply + JetStream)
        kv_cache_tokens=1024,
        router="kv",
        nats_config=server_config(S, PASSWORDS),
        users=users,
    ).start()
    # Route on what the index reports, not on the scheduler's memory of recent decisions.
    harness.services[2].router.recent.ttl_s = 0
    yield harness
    harness.stop()


async def test_the_mesh_serves_with_one_user_per_service(
    mesh: MeshHarness, openai_clients: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    client = openai_clients(mesh.base_url)
    system = list(range(3, 3 + 4 * PAGE))  # 4 full pages
    first = await client.completions.create(model="tiny", prompt=[*system, 1], max_tokens=3)
    assert first.choices[0].finish_reason in ("stop", "length")
    # The executor's KV events reach the index through JetStream...
    assert mesh.index is not None
    deadline = time.monotonic() + 10
    while not mesh.index.tree.match(page_hashes(system, PAGE)):
        assert time.monotonic() < deadline, "no KV event reached the prefix index"
        await asyncio.sleep(0.02)
    # ... and the scheduler's query (request/reply) routes the next request to that cache.
    again = await client.completions.create(model="tiny", prompt=[*system, 2], max_tokens=3)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 4 * PAGE
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    )
    assert [chunk async for chunk in stream]
    problems = [
        r.getMessage()
        for r in caplog.records
        if "permissions violation" in r.getMessage() or "did not answer" in r.getMessage()
    ]
    assert not problems, problems
