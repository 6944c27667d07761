"""The JetStream stream of prefix-cache events: executors publish to it, index replicas replay it.

Events are deltas, so a replay is only right if it starts from a full picture. Each executor
therefore publishes, now and then, a snapshot of its whole cache as a *rollup*
(``Nats-Rollup: sub``): the server then drops that executor's older messages. The stream holds
at most one snapshot plus the deltas since, per executor, and a restarted index rebuilds the
exact view by replaying it from the start. A byte cap (discarding the oldest) bounds what
executors that died without clearing leave behind.
"""

from __future__ import annotations

import logging

from nats.js.api import DiscardPolicy, Placement, StorageType, StreamConfig
from nats.js.client import JetStreamContext
from nats.js.errors import BadRequestError, NotFoundError

from common.subjects import Subjects

log = logging.getLogger("meshserve.kv_stream")

MAX_BYTES = 1 << 30  # far above (executors x snapshot + deltas); only dead executors hit it
ROLLUP = {"Nats-Rollup": "sub"}  # this message replaces every earlier one on its subject


def kv_stream_config(subjects: Subjects, replicas: int = 1, region: str = "") -> StreamConfig:
    """``replicas`` > 1 on a NATS cluster: the stream survives the loss of a server. In a
    supercluster each region has its own stream (its subjects carry the region), placed on
    its region's servers by their ``region:<name>`` tag (``services/launcher/nats_cluster.py``)
    so the index of a region replays it without crossing a gateway."""
    return StreamConfig(
        name=subjects.kv_events_stream,
        description="meshserve prefix-cache events (KVEventBatch), one subject per executor",
        subjects=[subjects.kv_events_all],
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_bytes=MAX_BYTES,
        allow_rollup_hdrs=True,
        num_replicas=replicas,
        placement=Placement(tags=[f"region:{region}"]) if region else None,
    )


class StreamNameTaken(RuntimeError):
    """The stream's name is held by another mesh's stream (see ``ensure_kv_stream``)."""


async def ensure_kv_stream(
    js: JetStreamContext, subjects: Subjects, replicas: int = 1, region: str = ""
) -> None:
    """Create the stream, or bring an existing one to this config (idempotent, race-safe).

    The name is the subject prefix with its punctuation folded (``mesh.v1.us-east`` and
    ``mesh.v1.us_east`` both give ``KV_EVENTS_MESH_V1_US_EAST``), so a stream of that name
    may be another mesh's: updating it would move it onto this mesh's subjects and leave the
    other mesh's executors publishing into nothing. That is refused with ``StreamNameTaken``.
    """
    config = kv_stream_config(subjects, replicas, region)
    try:
        await js.add_stream(config)
    except BadRequestError:  # it exists with another config (e.g. an older limit)
        try:
            held = (await js.stream_info(subjects.kv_events_stream)).config.subjects or []
        except NotFoundError:  # deleted in between: create it
            await js.add_stream(config)
            return
        if held != config.subjects:
            raise StreamNameTaken(
                f"JetStream stream {config.name} holds subjects {held}, not this mesh's "
                f"{config.subjects}: another mesh's subject prefix folds to the same name "
                f"(this one's is {subjects.prefix!r}); give one of them another "
                "--subject-prefix or --region"
            ) from None
        log.info("updating stream %s to the current config", config.name)
        await js.update_stream(config)


async def purge_executor(js: JetStreamContext, subjects: Subjects, executor_id: str) -> None:
    """Drop every message of one executor from the stream (a no-op once it holds none)."""
    await js.purge_stream(subjects.kv_events_stream, subject=subjects.kv_events(executor_id))
