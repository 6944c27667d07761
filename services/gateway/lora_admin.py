"""vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: LoRA adapters loaded or
unloaded at run time on every live executor (``--allow-runtime-lora-updating``, vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; off by default, behind the API key like ``/v1``).

The gateway asks every executor its heartbeats name at once (request/reply,
``executor_lora``; an unload also those draining); each answers once its heartbeat says what it
serves now, so the name is a model the gateway and the scheduler accept from that moment
(``Heartbeat.loras``). Loading a folder again under its name changes nothing (a retry after an
executor did not answer completes the load); a load some executor refuses is undone on those
that took it. An executor started later loads only its own ``--lora-modules``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from common.runtime import NoAnswer, RequestError
from common.wire.executor import LoraUpdate, LoraUpdated
from services.gateway.body import Body, bad_request
from services.gateway.config import GatewayConfig
from services.gateway.mesh_client import MeshClient

LORA_UPDATE_TIMEOUT_S = 60.0  # reading an adapter's file and moving it to the device
MAX_LORA_NAME_CHARS = 256  # (every heartbeat names every adapter)


def parse_update(raw: Any, config: GatewayConfig, load: bool) -> LoraUpdate:
    body = Body(raw)
    name = body.string("lora_name")
    if not name:
        raise bad_request("Missing required parameter: 'lora_name'.", "lora_name")
    if len(name) > MAX_LORA_NAME_CHARS:
        raise bad_request(f"'lora_name' is over {MAX_LORA_NAME_CHARS} characters.", "lora_name")
    if name == config.served_model_name:
        raise bad_request("'lora_name' may not be the served model's name.", "lora_name")
    if not load:
        return LoraUpdate(name)
    path = body.string("lora_path")
    if not path:
        raise bad_request("Missing required parameter: 'lora_path'.", "lora_path")
    return LoraUpdate(name, path)


async def update_everywhere(mesh: MeshClient, update: LoraUpdate) -> None:
    """Ask every live executor (an unload: draining ones too, those silent forgiven); the
    worst failure is the answer, unless every executor that failed to unload simply did not
    hold the adapter while another did. A load refused somewhere (a 4xx) is undone where this
    one loaded it."""
    liveness = mesh.liveness.executors
    live = liveness.live()
    executors = live if update.path else sorted(liveness.recent())
    if not executors:
        raise RequestError("No executor is live; retry.", 503, "server_error")
    failures, changed = await ask_each(mesh, executors, update)
    if not update.path:
        failures = {e: f for e, f in failures.items() if e in live or f.status != 503}
        if len(failures) < len(executors):  # (held by some: unloaded there)
            failures = {e: f for e, f in failures.items() if f.status != 404}
    if update.path and changed and any(f.status < 500 for f in failures.values()):
        await ask_each(mesh, changed, LoraUpdate(update.name))
    if failures:
        raise max(failures.values(), key=lambda f: f.status)


async def ask_each(
    mesh: MeshClient, executors: list[str], update: LoraUpdate
) -> tuple[dict[str, RequestError], list[str]]:
    """Every executor's answer at once: the failures by executor, and the executors where
    the update changed something."""
    subjects = mesh.service.subjects
    answers = await asyncio.gather(
        *(
            mesh.service.request(
                subjects.executor_lora(e),
                update,
                LoraUpdated,
                LORA_UPDATE_TIMEOUT_S,
                raise_errors=True,
            )
            for e in executors
        ),
        return_exceptions=True,
    )
    failures: dict[str, RequestError] = {}
    changed: list[str] = []
    for executor, answer in zip(executors, answers, strict=True):
        if isinstance(answer, NoAnswer):
            failures[executor] = RequestError(
                f"Executor {executor} did not answer; retry.", 503, "server_error"
            )
        elif isinstance(answer, RequestError):
            failures[executor] = answer
        elif isinstance(answer, BaseException):
            raise answer
        elif answer.changed:
            changed.append(executor)
    return failures, changed


def lora_routes(app: web.Application, config: GatewayConfig, mesh: MeshClient, read: Any) -> None:
    """Add the two routes (``read``: the gateway's JSON body reader)."""

    async def load(request: web.Request) -> web.Response:
        update = parse_update(await read(request, config.max_body_bytes), config, load=True)
        await update_everywhere(mesh, update)
        return web.Response(text=f"Success: LoRA adapter '{update.name}' added successfully.")

    async def unload(request: web.Request) -> web.Response:
        update = parse_update(await read(request, config.max_body_bytes), config, load=False)
        await update_everywhere(mesh, update)
        return web.Response(text=f"Success: LoRA adapter '{update.name}' removed successfully.")

    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", unload)
