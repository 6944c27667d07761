"""Every NATS subject the mesh uses, built in one place (nothing else spells a subject)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "mesh.v1"


@dataclass(frozen=True)
class Subjects:
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in " *>"):
            raise ValueError(f"invalid subject prefix {self.prefix!r}")

    # gateway -> tokenizer (queue group "tokenizer")
    @property
    def tokenizer_encode(self) -> str:
        return f"{self.prefix}.tokenizer.encode"

    # gateway -> tokenizer (request/reply, queue group "tokenizer"): vLLM's /tokenize and
    # /detokenize
    @property
    def tokenizer_tokenize(self) -> str:
        return f"{self.prefix}.tokenizer.tokenize"

    @property
    def tokenizer_detokenize(self) -> str:
        return f"{self.prefix}.tokenizer.detokenize"

    # tokenizer -> scheduler (queue group "scheduler")
    @property
    def scheduler_submit(self) -> str:
        return f"{self.prefix}.scheduler.submit"

    # gateway -> scheduler (request/reply): which of these requests are still alive?
    @property
    def scheduler_status(self) -> str:
        return f"{self.prefix}.scheduler.status"

    # another region's scheduler -> this region's (queue group "scheduler"): a request it
    # spilled here; served here, never sent on (services/scheduler/spill.py)
    @property
    def scheduler_spill(self) -> str:
        return f"{self.prefix}.scheduler.spill"

    # another region's scheduler -> this region's (request/reply): your load?
    @property
    def scheduler_region_status(self) -> str:
        return f"{self.prefix}.scheduler.region_status"

    # executors -> scheduler: load reports
    @property
    def executor_heartbeat(self) -> str:
        return f"{self.prefix}.executor.heartbeat"

    # every service -> anyone watching the mesh (gateway, scheduler): "I am alive", about
    # once a second; one subject per service name so a watcher can pick stages
    def presence(self, service: str) -> str:
        return f"{self.prefix}.presence.{service}"

    @property
    def presence_all(self) -> str:
        return f"{self.prefix}.presence.*"

    # a watcher that just started -> every service: announce yourself now (not a
    # ``presence.*`` subject, so watchers never mistake a probe for an announcement)
    @property
    def presence_probe(self) -> str:
        return f"{self.prefix}.presence_probe"

    # scheduler -> one executor
    def executor_submit(self, executor_id: str) -> str:
        return f"{self.prefix}.executor.{executor_id}.submit"

    # disaggregated prefill/decode: decode executor -> prefill executor (compute this prompt
    # into my pages), prefill -> decode (it is there), and prefill -> decode (request/reply)
    # for the decode side's NIXL agent metadata
    def executor_prefill(self, executor_id: str) -> str:
        return f"{self.prefix}.executor.{executor_id}.prefill"

    def executor_prefilled(self, executor_id: str) -> str:
        return f"{self.prefix}.executor.{executor_id}.prefilled"

    def executor_kv_agent(self, executor_id: str) -> str:
        return f"{self.prefix}.executor.{executor_id}.kv_agent"

    # gateway -> one executor (request/reply): load or unload a LoRA adapter at run time
    def executor_lora(self, executor_id: str) -> str:
        return f"{self.prefix}.executor.{executor_id}.lora"

    # anyone -> every executor and the scheduler: stop these requests
    @property
    def abort(self) -> str:
        return f"{self.prefix}.requests.abort"

    # executor -> detokenizer shard: one message per step per shard
    def detok(self, shard: int) -> str:
        return f"{self.prefix}.detok.{shard}"

    # scheduler -> one detokenizer shard (request/reply): what has each stream received?
    def detok_progress(self, shard: int) -> str:
        return f"{self.prefix}.detok.{shard}.progress"

    # detokenizer / any stage -> the gateway that owns the request
    def gateway_inbox(self, gateway_id: str) -> str:
        return f"{self.prefix}.gateway.{gateway_id}.inbox"

    # prefix-cache events per executor (JetStream) and the index's query subject
    def kv_events(self, executor_id: str) -> str:
        return f"{self.prefix}.kv.events.{executor_id}"

    @property
    def kv_events_all(self) -> str:
        return f"{self.prefix}.kv.events.>"

    @property
    def kv_events_stream(self) -> str:
        """The JetStream stream over ``kv_events_all`` (a name, not a subject: no dots)."""
        return "KV_EVENTS_" + "".join(c if c.isalnum() else "_" for c in self.prefix).upper()

    @property
    def index_match(self) -> str:
        return f"{self.prefix}.index.match"

    @property
    def speculator_propose(self) -> str:
        return f"{self.prefix}.speculator.propose"

    # executor -> every speculator replica (no queue group): finished sequences to forget
    @property
    def speculator_release(self) -> str:
        return f"{self.prefix}.speculator.release"


def region_subjects(prefix: str, region: str) -> Subjects:
    """The subjects of the mesh in ``region`` (``<prefix>.<region>.*``; empty: the mesh
    without regions). ``MeshConfig.subjects_of`` and the per-region NATS users use this."""
    return Subjects(f"{prefix}.{region}" if region else prefix)
