#!/usr/bin/env bash
# Run tools/gpu_check/check_flashinfer.py on the lent GPU machine: no internet, Python 3.12 with a
# CUDA build of torch, nvcc and ninja preinstalled, flashinfer absent (see README.md here).
#
# From the repository root there:
#   bash tools/gpu_check/device_run.sh [--stage] [--no-aot] [check_flashinfer.py arguments...]
#
# It expects the files tools/gpu_check/make_carry.sh builds, carried in the call:
#   out/carry/           flashinfer slim tarball + apache-tvm-ffi cp312 wheel (+ the kernels
#                        prebuilt for sm_90a, unless --no-aot: then FlashInfer compiles them);
#                        always, on a fresh machine; unpacked once into $STATE_DIR/site
#   out/carry-model-1/,  optional: the real SmolLM2 GGUF in two parts, one per call (with
#   out/carry-model-2/   --stage in the first call); once both parts have arrived the check
#                        gets --model <the assembled .gguf>
# --stage unpacks, stores what was carried and builds any kernel not shipped prebuilt; the
# files it leaves in $STATE_DIR (and FlashInfer's JIT cache there) last while the machine does.
#
# Results: $OUT/flashinfer_check.json and .log (stage: flashinfer_prebuild.*); $OUT defaults to
# out/device. Env: CHECK_TIME_LIMIT (seconds for the whole script, default 540), STATE_DIR
# (default /tmp/meshserve-device), PYTHON (default python3), MAX_JOBS (default nproc).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
ROOT=$PWD
STATE=${STATE_DIR:-/tmp/meshserve-device}
RESULTS=${OUT:-$ROOT/out/device}
LIMIT=${CHECK_TIME_LIMIT:-540}
PY=${PYTHON:-python3}
STAGE=0
NO_AOT=0
args=()
for a in "$@"; do
    case "$a" in
        --stage) STAGE=1 ;;
        --no-aot) NO_AOT=1 ;;
        *) args+=("$a") ;;
    esac
done
export PYTHONUNBUFFERED=1
started=$SECONDS
log() { echo "[device_run +$((SECONDS - started))s] $*"; }
mkdir -p "$STATE" "$RESULTS"
untar_xz() { # ARCHIVE DIR, with tar+xz or, lacking xz, Python's tarfile
    if command -v xz >/dev/null; then
        tar -xJf "$1" -C "$2"
    else
        "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$1" "$2"
    fi
}

# 1. flashinfer + apache-tvm-ffi on PYTHONPATH (nothing is installed into the system Python).
SITE=$STATE/site
if [[ -f out/carry/MANIFEST ]]; then
    if ! (cd out/carry && grep -E '^[0-9a-f]{64}  ' MANIFEST | sha256sum -c --status); then
        log "out/carry does not match its MANIFEST (a partial or stale copy?)"
        exit 2
    fi
    if ! cmp -s out/carry/MANIFEST "$SITE/MANIFEST"; then
        rm -rf "$SITE"
        mkdir -p "$SITE"
        tarballs=(out/carry/flashinfer-python-*-slim.tar.xz)
        tarball=${tarballs[0]}
        log "unpacking $(basename "$tarball")"
        untar_xz "$tarball" "$SITE" || {
            log "unpacking failed"
            exit 2
        }
        wheels=(out/carry/apache_tvm_ffi-*.whl)
        wheel=${wheels[0]}
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$SITE" "$wheel" || "$PY" -m zipfile -e "$wheel" "$SITE" || {
            log "installing $wheel failed"
            exit 2
        }
        # the pure-Python modules flashinfer imports, only where this Python lacks them
        for pair in pynvml:nvidia_ml_py einops:einops tabulate:tabulate; do
            module=${pair%%:*}
            dep_wheels=(out/carry/deps/"${pair#*:}"-*.whl)
            if ! "$PY" -c "import $module" 2>/dev/null && [[ -f ${dep_wheels[0]} ]]; then
                log "adding $(basename "${dep_wheels[0]}")"
                "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                    --target "$SITE" "${dep_wheels[0]}" || log "warning: could not add $module"
            fi
        done
        cp out/carry/MANIFEST "$SITE/MANIFEST"
    fi
    aot_tars=(out/carry/flashinfer-aot-*.tar.xz)
    if [[ $NO_AOT == 0 && -f ${aot_tars[0]} && ! -d $SITE/flashinfer/data/aot ]]; then
        log "adding the prebuilt kernels $(basename "${aot_tars[0]}")"
        untar_xz "${aot_tars[0]}" "$SITE" || log "warning: unpacking the prebuilt kernels failed"
    fi
elif [[ ! -f $SITE/MANIFEST ]]; then
    log "no out/carry here and nothing staged in $SITE (a fresh machine): carry out/carry"
    exit 2
fi
if [[ $NO_AOT == 1 ]]; then
    rm -rf "$SITE/flashinfer/data/aot"
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# 2. The real model, when its parts were carried (this call or an earlier one on this machine).
MODEL_DIR=$STATE/model
mkdir -p "$MODEL_DIR"
for d in out/carry-model-*; do
    [[ -d $d ]] && cp -f "$d"/* "$MODEL_DIR"/
done
model_args=()
for sumfile in "$MODEL_DIR"/*.sha256; do
    [[ -f $sumfile ]] || continue
    name=$(awk '{print $2; exit}' "$sumfile")
    if [[ ! -f $MODEL_DIR/$name ]]; then
        parts=$(find "$MODEL_DIR" -maxdepth 1 -name "$name.part-*" | sort)
        # shellcheck disable=SC2086  # the part names have no spaces
        [[ -n $parts ]] && cat $parts >"$MODEL_DIR/$name.tmp"
        if [[ -n $parts ]] && (cd "$MODEL_DIR" && mv "$name.tmp" "$name" &&
            sha256sum -c --status "$(basename "$sumfile")"); then
            log "assembled $name"
            rm -f "$MODEL_DIR/$name".part-*
        else
            rm -f "$MODEL_DIR/$name" "$MODEL_DIR/$name.tmp"
            log "model $name incomplete so far (parts here: $(echo "$parts" | xargs -n1 basename 2>/dev/null | tr '\n' ' '))"
        fi
    fi
    if [[ -f $MODEL_DIR/$name && " ${args[*]-} " != *" --model "* ]]; then
        model_args=(--model "$MODEL_DIR/$name")
    fi
done

# 3. The JIT toolchain (for kernels not shipped prebuilt): CUDA_HOME with nvcc, headers and
#    libcudart (also behind an nvcc wrapper script), ninja, a linkable libcuda; the JIT cache
#    goes under $STATE.
find_cuda_home() {
    local c n
    for c in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-* /opt/cuda; do
        [[ -n $c && -x $c/bin/nvcc && -f $c/include/cuda_runtime.h ]] && echo "$c" && return 0
    done
    n=$(command -v nvcc) || return 1
    c=$(grep -aoE '/[^ "]*/bin/nvcc' "$n" 2>/dev/null | head -1)
    [[ -n $c ]] && n=$c
    c=$(dirname "$(dirname "$(readlink -f "$n")")")
    [[ -f $c/include/cuda_runtime.h ]] && echo "$c"
}
if cuda_home=$(find_cuda_home); then
    export CUDA_HOME=$cuda_home
    export PATH=$CUDA_HOME/bin:$PATH
else
    log "warning: no CUDA toolkit (nvcc) found; FlashInfer cannot compile kernels"
fi
# FlashInfer links its modules with -lcuda; a toolkit without stubs/ needs the driver's.
if [[ -n ${CUDA_HOME:-} && ! -e $CUDA_HOME/lib64/stubs/libcuda.so ]] &&
    ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so '; then
    driver=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
    for c in /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 \
        /usr/lib64/libcuda.so.1; do
        [[ -z ${driver:-} && -e $c ]] && driver=$c
    done
    if [[ -n ${driver:-} ]]; then
        mkdir -p "$STATE/lib"
        ln -sf "$driver" "$STATE/lib/libcuda.so"
        export LIBRARY_PATH=$STATE/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
    fi
fi
if ! command -v ninja >/dev/null; then
    ninja_dir=$("$PY" -c 'import ninja; print(ninja.BIN_DIR)' 2>/dev/null) &&
        export PATH=$ninja_dir:$PATH
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
# FlashInfer's norms default to CuTe DSL kernels (nvidia-cutlass-dsl, not carried): take its
# CUDA JIT norm module, which the check prebuilds.
export FLASHINFER_USE_CUDA_NORM=${FLASHINFER_USE_CUDA_NORM:-1}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$STATE}

# 4. What is here, in the log's first lines.
log "python $(command -v "$PY"): $("$PY" -V 2>&1); nvcc: $(command -v nvcc || echo none);" \
    "ninja: $(command -v ninja || echo none); CUDA_HOME=${CUDA_HOME:-none};" \
    "prebuilt kernels: $(find "$SITE/flashinfer/data/aot" -name "*.so" 2>/dev/null | wc -l); cores $(nproc)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader || true
command -v nvcc >/dev/null && nvcc --version | tail -2
"$PY" - <<'EOF' || {
import torch, tvm_ffi, flashinfer
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available(),
      "dlpack-c-api", hasattr(torch.Tensor, "__dlpack_c_exchange_api__"))
print("flashinfer", flashinfer.__version__, flashinfer.__file__)
print("tvm_ffi", tvm_ffi.__version__)
EOF
    log "importing torch/flashinfer failed"
    exit 3
}

# 5. The check (or, with --stage, only the kernel build), within the time limit.
if [[ $STAGE == 1 ]]; then
    name=flashinfer_prebuild
    mode=(--prebuild-only)
else
    name=flashinfer_check
    mode=()
fi
left=$((LIMIT - (SECONDS - started)))
((left > 30)) || left=30
log "running check_flashinfer ${mode[*]-} ${model_args[*]-} ${args[*]-} (limit ${left}s)"
timeout --signal=TERM --kill-after=15 "$left" \
    "$PY" -m tools.gpu_check.check_flashinfer --out "$RESULTS/$name.json" \
    "${model_args[@]}" "${mode[@]}" "${args[@]}" 2>&1 | tee "$RESULTS/$name.log"
rc=${PIPESTATUS[0]}
if ((rc == 124 || rc == 137)); then
    log "stopped at the time limit; what finished is in $RESULTS/$name.json"
fi
# Tensor parallelism over NCCL needs two GPUs: time TP=2 against TP=1 where there are.
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
left=$((LIMIT - (SECONDS - started)))
if ((STAGE == 0 && gpus >= 2 && left > 60)); then
    log "timing tensor parallelism (TP=2 over NCCL against TP=1, $gpus GPUs, limit ${left}s)"
    timeout --signal=TERM --kill-after=15 "$left" "$PY" -m tools.bench.tensor_parallel \
        --device cuda --rounds 3 2>&1 | tee "$RESULTS/tensor_parallel.log"
elif ((STAGE == 0)); then
    log "tensor parallelism not timed: $gpus GPU(s) here, TP=2 needs 2"
fi
log "exit status $rc"
exit "$rc"
