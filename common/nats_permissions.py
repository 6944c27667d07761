"""One NATS user per service role, allowed exactly the subjects that service uses.

The allow lists are derived from ``common/subjects.py`` (nothing here spells a mesh subject), one
function per role below, and turned into the ``authorization`` block of a nats-server config by
``server_config``. Everything not allowed is denied: a tokenizer that subscribes to ``>`` or
publishes an executor heartbeat gets a permissions violation and nothing is delivered.

Adding a subject is a one-line change in the role function(s) of the services that use it:

- plain publish/subscribe: add ``s.<subject>`` to ``publish=`` of the sender and to
  ``subscribe=`` of the receiver (a per-instance subject, one per gateway, executor or shard,
  is allowed for all instances with ``every``: ``every(s.detok)``);
- request/reply: add it to ``requests=`` of the asker (it may publish the request and
  subscribe to its own reply inbox) and to ``serves=`` of the answerer (it may subscribe to the
  request and publish exactly one reply to each request it received: nats-server's
  ``allow_responses``, so an answerer cannot write into anyone's inbox at will).

Then regenerate the compose config (``python -m common.nats_permissions --out
deploy/nats/nats-server.conf``); tests/test_nats_permissions.py fails until the checked-in file
matches, and also fails when a service's code names a subject its role does not list.

Reply inboxes are per user: a service logged in as user ``u`` uses the inbox prefix
``_INBOX.u`` (``inbox_prefix``; ``NatsAuth.connect_options`` sets it), so a requester may
subscribe to ``_INBOX.u.>`` only and cannot read another service's replies.

JetStream (the prefix-cache event stream, ``common/kv_stream.py``) is allowed API by API on that
one stream, not ``$JS.API.>``: with the whole API a service could create a stream over
``mesh.v1.>`` and read every prompt through it, whatever its subscribe permissions say. What is
left: the two users allowed to create and update that stream (executor, prefix index) could
still change its subjects; closing that needs the stream made by an operator instead.

Regions (a supercluster, docs/deploy.md): each region's servers load that region's users
(``region_config``; ``python -m common.nats_permissions --region us-east --peer-regions eu-west
--out deploy/nats/authorization-us-east.conf``), the same roles over the region's subjects
(``mesh.v1.us-east.*``) plus exactly what crosses to a peer region: the scheduler spills to
its ``scheduler.spill``, asks its ``scheduler.region_status`` and ``scheduler.status`` (the
watchdog's question about a spilled request, forwarded) and forwards aborts to its
``requests.abort``; a spilled request's stream goes back to the home region's gateway inbox,
written by the executors, the detokenizer and the scheduler (error replies) of the region
serving it. Nothing else of a peer is allowed: a tokenizer cannot submit to another region,
an executor cannot take another region's work. Reply inboxes then carry the region too
(``_INBOX.<user>.<region>``): the same user name exists in every region.

Instance ids that appear in subjects (gateway and executor ids) must be one subject token (no
dots) for ``every`` to match them; compose's are (container ids, ``executor-N``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from common.subjects import DEFAULT_PREFIX, Subjects, region_subjects

ANY = "*"  # one subject token: any instance (gateway id, executor id, detokenizer shard)
DEFAULT_INBOX_PREFIX = "_INBOX"  # nats-py's, for a service that logs in without a user name
_TOKEN = re.compile(r"[A-Za-z0-9_-]+")


def every(subject_of: Callable[[Any], str]) -> str:
    """A per-instance subject for every instance (``every(s.detok)`` -> ``mesh.v1.detok.*``).

    Instance ids (gateway and executor ids) must then be one subject token: no dots.
    """
    return subject_of(ANY)


def inbox_prefix(user: str | None, region: str = "") -> str:
    """The reply-inbox prefix of a service logged in as ``user``: ``_INBOX.<user>``, in a
    region ``_INBOX.<user>.<region>`` (its peer regions' servers have a user of that name too).

    A user name that is not a single plain subject token (or none: creds, nkeys) keeps nats-py's
    default ``_INBOX``, which then needs ``_INBOX.>`` in that user's permissions.
    """
    if user is None or not _TOKEN.fullmatch(user):
        return DEFAULT_INBOX_PREFIX
    if region and _TOKEN.fullmatch(region):
        return f"{DEFAULT_INBOX_PREFIX}.{user}.{region}"
    return f"{DEFAULT_INBOX_PREFIX}.{user}"


@dataclass(frozen=True)
class Permissions:
    """A nats-server user's permissions: publish/subscribe allow lists (everything else is
    denied), and whether it may answer the requests it receives."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False


def grant(
    s: Subjects,
    user: str,
    publish: Iterable[str] = (),
    subscribe: Iterable[str] = (),
    requests: Iterable[str] = (),
    serves: Iterable[str] = (),
    jetstream: Iterable[str] = (),
    region: str = "",
) -> Permissions:
    """``Permissions`` from what a service does (see the module docstring).

    Every service's runtime (``common/runtime.py``) announces its presence on
    ``presence.<service>`` and answers probes, so each user may do that, under its own service
    name only: no service can pose as another stage. ``jetstream``: JetStream API subjects it
    calls (``kv_stream_api``); those calls are requests, so they also open the reply inbox
    (``region``'s: ``inbox_prefix``).
    """
    requests, serves, jetstream = list(requests), list(serves), list(jetstream)
    pub = [*publish, s.presence(user), *requests, *jetstream]
    sub = [*subscribe, s.presence_probe, *serves]
    if requests or jetstream:
        sub.append(f"{inbox_prefix(user, region)}.>")
    return Permissions(_unique(pub), _unique(sub), allow_responses=bool(serves))


def _unique(subjects: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(subjects))


def kv_stream_api(s: Subjects, *apis: str) -> list[str]:
    """JetStream API subjects on the prefix-cache event stream only (``$JS.API.<api>.<stream>``).

    ``STREAM.NAMES`` (how nats-py finds a subject's stream) names no stream, and ``FC`` (flow
    control replies of a push consumer) lives outside ``$JS.API``: both are spelled here too.
    """
    stream = s.kv_events_stream
    out = []
    for api in apis:
        if api == "STREAM.NAMES":
            out.append("$JS.API.STREAM.NAMES")
        elif api == "FC":
            out.append(f"$JS.FC.{stream}.>")
        else:
            out.append(f"$JS.API.{api}.{stream}")
            if api == "CONSUMER.CREATE":  # newer servers/clients name the consumer and filter
                out.append(f"$JS.API.{api}.{stream}.>")
    return out


# -- the roles: what each service publishes and subscribes to (read from services/<role>/) -----


# Each role takes its region's subjects (or the mesh's, without regions), the peer regions'
# subjects and its region's name (for the reply inbox). Without peers nothing crosses.


def gateway(s: Subjects, peers: Sequence[Subjects] = (), region: str = "") -> Permissions:
    # Nothing crosses: a spilled stream comes back into its inbox; its abort and watchdog
    # question go to its own scheduler, which forwards them to the region serving the request.
    return grant(
        s,
        "gateway",
        region=region,
        publish=[s.tokenizer_encode, s.abort, s.presence_probe],
        subscribe=[every(s.gateway_inbox), s.executor_heartbeat, s.presence_all],
        # the watchdog (are these silent requests alive?), /tokenize and /detokenize, and
        # LoRA adapters loaded at run time on each executor
        requests=[
            s.scheduler_status,
            s.tokenizer_tokenize,
            s.tokenizer_detokenize,
            every(s.executor_lora),
        ],
    )


def tokenizer(s: Subjects, peers: Sequence[Subjects] = (), region: str = "") -> Permissions:
    return grant(
        s,
        "tokenizer",
        region=region,
        publish=[s.scheduler_submit, every(s.gateway_inbox)],  # the inbox: error replies
        subscribe=[s.tokenizer_encode],
        serves=[s.tokenizer_tokenize, s.tokenizer_detokenize],
    )


def prefix_index(s: Subjects, peers: Sequence[Subjects] = (), region: str = "") -> Permissions:
    return grant(
        s,
        "prefix-index",
        region=region,
        subscribe=[s.executor_heartbeat],
        serves=[s.index_match],
        # ensure_kv_stream, stream_info, then replay()'s ordered push consumer (MSG.GET: is
        # there anything past what it delivered?); purge: a forgotten executor's subject
        jetstream=kv_stream_api(
            s,
            "STREAM.CREATE",
            "STREAM.UPDATE",
            "STREAM.INFO",
            "STREAM.MSG.GET",
            "STREAM.PURGE",
            "STREAM.NAMES",
            "CONSUMER.CREATE",
            "FC",
        ),
    )


def scheduler(s: Subjects, peers: Sequence[Subjects] = (), region: str = "") -> Permissions:
    return grant(
        s,
        "scheduler",
        region=region,
        # the inbox: failed requests; abort: moved or failed with a lost executor. To each
        # peer (services/scheduler/spill.py): spilled requests, forwarded aborts, and the
        # inbox: a guest from there that fails here is answered in its home gateway's inbox
        publish=[
            every(s.executor_submit),
            every(s.gateway_inbox),
            s.abort,
            s.presence_probe,
            *(subject for p in peers for subject in (p.scheduler_spill, p.abort)),
            *home_inboxes(peers),
        ],
        # spill: requests another region's scheduler sends here (services/scheduler/spill.py)
        subscribe=[
            s.scheduler_submit,
            s.scheduler_spill,
            s.executor_heartbeat,
            s.abort,
            s.presence_all,
        ],
        # peers: their load, and the watchdog's question about requests spilled there
        requests=[
            s.index_match,
            every(s.detok_progress),
            *(
                subject
                for p in peers
                for subject in (p.scheduler_region_status, p.scheduler_status)
            ),
        ],
        serves=[s.scheduler_status, s.scheduler_region_status],
    )


def home_inboxes(peers: Sequence[Subjects]) -> list[str]:
    """The peer regions' gateway inboxes: a guest's replies (text, errors) go to its home
    gateway from every stage of the region serving it that answers a client."""
    return [every(p.gateway_inbox) for p in peers]


def executor(s: Subjects, peers: Sequence[Subjects] = (), region: str = "") -> Permissions:
    return grant(
        s,
        "executor",
        region=region,
        publish=[
            s.executor_heartbeat,
            every(s.detok),
            every(s.gateway_inbox),  # error replies
            s.abort,  # expired or failed requests
            every(s.kv_events),
            every(s.executor_prefill),  # disaggregated: decode -> prefill executor
            every(s.executor_prefilled),  # and back
            *home_inboxes(peers),  # error replies to a guest's client
            s.speculator_release,  # finished sequences: every replica frees their drafts
        ],
        subscribe=[
            every(s.executor_submit),
            s.abort,
            every(s.executor_prefill),
            every(s.executor_prefilled),
            s.executor_heartbeat,  # decode role: are its prefill peers alive?
        ],
        # kv_agent: a decode peer's NIXL metadata; detok_progress: a decode executor falling
        # back to local prefill asks what its prefill peer streamed
        requests=[s.speculator_propose, every(s.executor_kv_agent), every(s.detok_progress)],
        serves=[every(s.executor_kv_agent), every(s.executor_lora)],
        # ensure_kv_stream (INFO: is an existing stream of that name this mesh's?)
        jetstream=kv_stream_api(s, "STREAM.CREATE", "STREAM.UPDATE", "STREAM.INFO"),
    )


def speculator(s: Subjects, peers: Sequence[Subjects] = (), region: str = "") -> Permissions:
    return grant(
        s,
        "speculator",
        serves=[s.speculator_propose],
        subscribe=[s.speculator_release],
        region=region,
    )


def detokenizer(s: Subjects, peers: Sequence[Subjects] = (), region: str = "") -> Permissions:
    return grant(
        s,
        "detokenizer",
        region=region,
        # abort: a stop string, a lost stream; a peer's inbox: a guest's text goes home
        publish=[every(s.gateway_inbox), s.abort, *home_inboxes(peers)],
        subscribe=[every(s.detok), s.abort],
        serves=[every(s.detok_progress)],  # what each stream received (a lost executor)
    )


class Role(Protocol):
    def __call__(
        self, s: Subjects, peers: Sequence[Subjects] = (), region: str = ""
    ) -> Permissions: ...


# role (= NATS user name = compose service) -> its permissions
ROLES: dict[str, Role] = {
    "gateway": gateway,
    "tokenizer": tokenizer,
    "prefix-index": prefix_index,
    "scheduler": scheduler,
    "executor": executor,
    "speculator": speculator,
    "detokenizer": detokenizer,
}


def password_variable(role: str) -> str:
    """The environment variable holding ``role``'s NATS password (compose, .env)."""
    return "NATS_PASSWORD_" + role.upper().replace("-", "_")


def server_config(
    subjects: Subjects | None = None, passwords: Mapping[str, str] | None = None
) -> str:
    """A nats-server config holding the ``authorization`` block: every role as a user.

    ``passwords`` (role -> password) writes them literally (tests); without it each password
    is a reference to the environment variable ``password_variable(role)``, which nats-server
    resolves at start and refuses to start without (compose), so no secret is in the file.
    Listen address, JetStream and monitoring stay on the command line.
    """
    header = [
        "# nats-server authorization for meshserve: one user per service, each allowed only the",
        "# subjects it uses. Generated from common/nats_permissions.py by",
        "#   python -m common.nats_permissions --out deploy/nats/nats-server.conf",
    ]
    return _authorization(header, subjects or Subjects(), (), "", passwords)


def region_config(
    region: str,
    peer_regions: Sequence[str],
    passwords: Mapping[str, str] | None = None,
    subject_prefix: str = DEFAULT_PREFIX,
) -> str:
    """The ``authorization`` block of ``region``'s servers in a supercluster (the module
    docstring): its users over its subjects, plus what each role sends to ``peer_regions``.
    Passwords as in ``server_config``: each region's servers read their own environment."""
    if not region or region in peer_regions:
        raise ValueError(f"region {region!r} must be named and not among its peers")
    peers = tuple(region_subjects(subject_prefix, r) for r in peer_regions)
    options = f"--region {region} --peer-regions {','.join(peer_regions)}"
    if subject_prefix != DEFAULT_PREFIX:
        options += f" --subject-prefix {subject_prefix}"
    header = [
        f"# nats-server authorization for meshserve's region {region} of a supercluster,",
        "# included by every server of that region: one user per service, each allowed only",
        "# the subjects it uses in its region and the few it sends to another one.",
        "# Generated from common/nats_permissions.py by",
        f"#   python -m common.nats_permissions {options} \\",
        f"#     --out deploy/nats/authorization-{region}.conf",
    ]
    s = region_subjects(subject_prefix, region)
    return _authorization(header, s, peers, region, passwords)


def _authorization(
    header: list[str],
    s: Subjects,
    peers: Sequence[Subjects],
    region: str,
    passwords: Mapping[str, str] | None,
) -> str:
    lines = [
        *header,
        "# Do not edit: change the role functions there and regenerate.",
        "authorization {",
        "  users = [",
    ]
    for role, permissions_of in ROLES.items():
        perms = permissions_of(s, peers, region)
        if passwords is None:
            password = "$" + password_variable(role)
        else:
            password = json.dumps(passwords[role])
        lines += [
            "    {",
            f"      user: {json.dumps(role)}",
            f"      password: {password}",
            "      permissions: {",
            *_allow("publish", perms.publish),
            *_allow("subscribe", perms.subscribe),
        ]
        if perms.allow_responses:
            lines.append("        allow_responses: true")
        lines += ["      }", "    }"]
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def _allow(kind: str, subjects: tuple[str, ...]) -> list[str]:
    """One ``publish``/``subscribe`` entry, a subject per line (nats-server arrays may be
    newline-separated), so a diff of the generated file shows which subject changed."""
    # nats-server reads ``allow: []`` as "no restriction" (an empty list is no list), so a role
    # that may use nothing says so with a deny-all; allow_responses still lets it answer.
    if not subjects:
        return [f'        {kind}: {{ deny: [">"] }}']
    quoted = [f"            {json.dumps(subject)}" for subject in subjects]
    return [f"        {kind}: {{", "          allow: [", *quoted, "          ]", "        }"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m common.nats_permissions",
        description="write the nats-server config with one user per meshserve service",
    )
    parser.add_argument("--out", type=Path, default=None, help="file to write (default: stdout)")
    parser.add_argument("--subject-prefix", default=DEFAULT_PREFIX)
    parser.add_argument(
        "--region", default="", help="the users of this region's servers (a supercluster)"
    )
    parser.add_argument(
        "--peer-regions", default="", help="with --region: the other regions, comma-separated"
    )
    args = parser.parse_args(argv)
    peers = [r.strip() for r in args.peer_regions.split(",") if r.strip()]
    if args.region:
        text = region_config(args.region, peers, subject_prefix=args.subject_prefix)
    elif peers:
        parser.error("--peer-regions needs --region")
    else:
        text = server_config(Subjects(args.subject_prefix))
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
