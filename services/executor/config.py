from __future__ import annotations

from dataclasses import dataclass

from common.config import (
    MeshConfig,
    device_setting,
    lora_modules_setting,
    model_setting,
    page_size_setting,
    parse_lora_modules,
)
from common.settings import parse, setting
from common.wire.executor import ROLES
from gpu.formats import KV_CACHE_DTYPES, LOGPROBS_MODES, QUANTIZATIONS, TRITON_GEMV_MODES

SPECULATORS = ("off", "ngram", "remote")


@dataclass(frozen=True)
class ExecutorConfig:
    mesh: MeshConfig
    model: str | None = model_setting()
    device: str = device_setting()
    page_size: int = page_size_setting()
    kv_cache_tokens: int = setting(16384, "KV cache size in tokens (pages x page size)")
    max_num_batched_tokens: int = setting(512, "token budget of one engine step")
    max_num_seqs: int = setting(64, "sequences in one engine step at most")
    enable_prefix_caching: bool = setting(
        True, "recompute every prompt: reuse no cached pages", flag="--no-prefix-caching"
    )
    heartbeat_s: float = 0.25
    speculator: str = setting(
        "off",
        "where draft tokens come from: off, nowhere; ngram, the prompt (in process); remote, "
        "the speculator service's draft model",
        choices=SPECULATORS,
    )
    num_speculative_tokens: int = setting(
        0, "draft tokens per decode step at most (>= 1 with a speculator; 0 when off)"
    )
    speculator_timeout_s: float = setting(
        2.0,
        "seconds to wait for the speculator's drafts before decoding without",
        flag="--speculator-timeout",
    )
    quantization: str = setting(
        "auto",
        "weight format (auto: a GGUF model in its own blocks on CPU, else unquantized)",
        choices=QUANTIZATIONS,
    )
    cuda_graphs: bool = setting(
        True,
        "decode eagerly: capture no CUDA graphs (captured per batch-size bucket in the warm-up, "
        "on CUDA with FlashInfer only)",
        flag="--no-cuda-graphs",
    )
    overlap_steps: str = setting(
        "auto",
        "queue each engine step before reading the last one's tokens (gpu/overlap.py); auto: "
        "on CUDA devices (a CPU runs each op as it is issued: nothing to overlap); never for "
        "a prefill-role executor, or where drafts are verified",
        choices=("auto", "on", "off"),
    )
    logprobs_mode: str = setting(
        "raw",
        "what logprobs are taken from: raw: the model's logits (a grammar's mask applied; no "
        "bias, penalty or temperature), vLLM's default; processed: the logits sampled from",
        choices=LOGPROBS_MODES,
    )
    fused_rope_append: bool = setting(
        False,
        "rotate q and k inside the KV append, one Triton kernel per layer (CUDA, fp16/bf16 "
        "pages); off until timed on a GPU (tools/gpu_check)",
    )
    triton_gemv: str = setting(
        "off",
        "decode steps of up to 8 tokens on CUDA (dense fp16/bf16 weights): matmuls: the "
        "linears through a Triton matrix-vector kernel (gpu/triton_gemv.py); layers: also the "
        "norms, SiLU and residual adds inside those matmuls (a quantized model runs "
        "matmuls); off until timed on a GPU (tools/gpu_check)",
        choices=TRITON_GEMV_MODES,
    )
    kv_cache_dtype: str = setting(
        "auto", "KV cache dtype; auto: the model's", choices=KV_CACHE_DTYPES
    )
    # Niceness added to the engine thread (and the OpenMP threads it starts): the mesh's light
    # services on the same host then preempt the model at once instead of waiting for a time
    # slice, which is most of the TTFT the mesh would add on a busy CPU. 0 for dedicated cores.
    engine_nice: int = setting(
        10, "niceness added to the engine's threads (0..19; 0 for dedicated cores)"
    )
    # Several CPU executors on one host, each with torch's default of a thread per core, run
    # N times as many threads as cores: every step then waits for the threads that lost their
    # core (and OpenMP's spinning ones burn it). ``meshserve up`` gives each its share.
    cpu_threads: int = setting(
        0, "torch CPU threads of this executor's engine (0: torch's default, one per core)"
    )

    tensor_parallel_size: int = setting(
        1,
        "ranks (processes, one device each) one model replica is split across: heads, MLP "
        "and vocabulary (Megatron-style; gloo on CPU, NCCL on CUDA)",
    )
    tensor_parallel_timeout_s: float = setting(
        30.0,
        "seconds a rank waits in a collective for the others before the group counts as lost",
        flag="--tensor-parallel-timeout",
    )

    lora_modules: tuple[str, ...] = lora_modules_setting()

    role: str = setting(
        "mixed",
        "mixed: prefill and decode; prefill: compute prompts and write their KV to decode "
        "executors (NIXL); decode: decode prompts computed by prefill executors",
        choices=ROLES,
    )
    kv_transfer_timeout_s: float = setting(
        30.0,
        "decode role: seconds to wait for a prompt's KV from its prefill executor before "
        "computing it here",
        flag="--kv-transfer-timeout",
    )

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.tensor_parallel_timeout_s <= 0:
            raise ValueError("tensor_parallel_timeout_s must be > 0")

        if self.kv_transfer_timeout_s <= 0:
            raise ValueError("kv_transfer_timeout_s must be > 0")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.triton_gemv not in TRITON_GEMV_MODES:
            raise ValueError(f"triton_gemv must be one of {', '.join(TRITON_GEMV_MODES)}")
        if self.speculator not in SPECULATORS:
            raise ValueError(f"speculator must be one of {', '.join(SPECULATORS)}")
        if self.speculator == "off":
            # No drafts without a speculator, whatever k says (a k from the environment
            # must not make the engine expect proposals nobody makes).
            object.__setattr__(self, "num_speculative_tokens", 0)
        elif self.num_speculative_tokens < 1:
            raise ValueError("a speculator needs --num-speculative-tokens >= 1")
        if self.kv_cache_tokens < self.page_size:
            raise ValueError("kv_cache_tokens must hold at least one page")
        if not 0 <= self.engine_nice <= 19:
            raise ValueError("engine_nice must be within 0..19")
        if self.cpu_threads < 0:
            raise ValueError("cpu_threads must be >= 0")
        parse_lora_modules(self.lora_modules)  # (a ValueError naming a malformed one)
        if self.lora_modules and self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters are not supported with tensor parallelism")

    @property
    def executor_id(self) -> str:
        return self.mesh.instance_id

    @property
    def num_pages(self) -> int:
        return self.kv_cache_tokens // self.page_size


def parse_args(argv: list[str] | None = None) -> ExecutorConfig:
    return parse(ExecutorConfig, argv, "python -m services.executor")
