#!/usr/bin/env bash
# The CUDA check, on a machine with one GPU and a CUDA build of torch (>= 2.11), no
# network needed: installs fairring_pg from this checkout, starts MPS when it can, and
# runs four parts:
#   tests   tests/test_cuda*.py under MPS (M = 2, 3, 4 simulated machines x 1 rank on
#           cuda:0, each with its own FAIRRING_MACHINE_ID and NCCL_HOSTID, 2 x 2 with
#           Gloo local groups and 2 x 2 with NCCL ones, a rank its own NCCL host: the
#           async delegated all-gather of a temporary, calls in flight, capture, what
#           the composition cannot do against NCCL's own), and the GPU-free logic
#           tests (test_subgroup_logic.py);
#   blocking  the exact results, streams and ordering tests again under
#           TORCH_NCCL_BLOCKING_WAIT=1 (no step may wait on the host);
#   fuzz    seeded random programs (scripts/cuda_fuzz.py --device cuda): fairring against
#           backend="nccl" on the same programs at 2x1 and 2x2 under MPS, every mode
#           (FUZZ_JOBS jobs from FUZZ_SEED, default 8 from 0; each rank its own NCCL
#           host); the same generator CI runs on the stream vehicle;
#   faults  the tests in which a rank dies or fails (marker cuda_fault), without MPS;
#   bench   bench/cuda_allreduce.py at 2x1 and 4x1: fairring (FAIRRING_CUDA_ALLREDUCE=
#           auto and lanes) against NCCL in the same processes, issue 26's targets with
#           PASS/FAIL, the measured choice's trials (a group whose plan measures 64 KiB,
#           1, 25 and 100 MiB: each trial call's time, the times the timing events gave
#           each way, the winner), and torch.profiler traces of the 25 MiB and in-flight
#           cases with a summary of where the time goes (profile/profile_<shape>.txt).
# Figures, traces and logs go to $OUT (the device tool's folder) or bench/results/tmp/cuda.
# Together they outlast one 10-minute device call (the tests part alone ran past 320 s on
# an H100 in November 2026): run one part per call.
#
#   bash scripts/run_cuda_tests.sh                      # all four
#   bash scripts/run_cuda_tests.sh --parts tests        # a comma list of the parts
#   bash scripts/run_cuda_tests.sh --parts bench --shapes 4x1
#   bash scripts/run_cuda_tests.sh --parts tests -- -k 2x1   # the rest goes to pytest
#   bash scripts/run_cuda_tests.sh --no-bench | --bench-only  # as --parts tests,faults | bench
set -euo pipefail
cd "$(dirname "$0")/.."
# The tests that need a GPU (marker cuda), one file per part of the CUDA path.
CUDA_TESTS=(tests/test_cuda.py tests/test_cuda_capture.py tests/test_cuda_ddp_and_delegated.py
    tests/test_cuda_faults.py tests/test_cuda_like_nccl.py)

out_dir=${OUT:-bench/results/tmp/cuda}
mkdir -p "$out_dir"
parts=tests,blocking,fuzz,faults,bench
shapes=2x1,4x1
while [[ $# -gt 0 ]]; do
    case "$1" in
        --parts) parts=$2; shift ;;
        --shapes) shapes=$2; shift ;;
        --no-bench) parts=tests,faults ;;
        --bench-only) parts=bench ;;
        --) shift; break ;;
        *) echo "run_cuda_tests.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
for part in ${parts//,/ }; do
    case "$part" in
        tests|blocking|fuzz|faults|bench) ;;
        *) echo "run_cuda_tests.sh: unknown part '$part' (expected tests, blocking, fuzz, faults, bench)" >&2; exit 2 ;;
    esac
done
wants() { [[ ",$parts," == *",$1,"* ]]; }
# The tests lower NCCL's channels (below); the benchmark keeps the user's setting or NCCL's
# own choice, for fairring and NCCL alike.
user_nchannels=${NCCL_MAX_NCHANNELS-}
export PYTHONUNBUFFERED=1
# What is measured must not depend on the machine's fabric: NCCL between the simulated
# machines goes over its socket transport on loopback, also where InfiniBand is present.
export NCCL_NET=${NCCL_NET:-Socket} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}

python - <<'PY'
import sys

import torch

if torch.version.cuda is None or not torch.cuda.is_available():
    sys.exit(f"run_cuda_tests.sh: needs a GPU and a CUDA build of torch (torch {torch.__version__})")
nccl = ".".join(map(str, torch.cuda.nccl.version()))
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, "
      f"{torch.cuda.get_device_name(0)}")
PY

# Everything it needs (torch, ninja, pybind11, pytest) is already on the GPU machine.
if ! (cd / && python -c "import fairring_pg" 2>/dev/null); then
    python -m pip install -q --no-build-isolation --no-deps --no-index -e .
fi

# Without MPS the ranks' processes time-slice the GPU, and NCCL's spinning kernels
# take milliseconds per operation (64 KiB: 4.5 ms without, 0.15 ms with).
mps_started=0
start_mps() {
    if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
        echo "MPS: nvidia-cuda-mps-control not found; timings will suffer"
    elif echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; then
        echo "MPS: already running"
    elif nvidia-cuda-mps-control -d 2>/dev/null; then
        mps_started=1
        echo "MPS: started"
    else
        echo "MPS: could not start it (not root?); timings will suffer"
    fi
}
stop_mps() {
    if [[ $mps_started == 1 ]]; then
        echo quit | nvidia-cuda-mps-control || true
        mps_started=0
        sleep 1
        echo "MPS: stopped"
    fi
}
trap stop_mps EXIT

# Compile the C++ core once, up front, outside any test's deadline.
start=$(date +%s)
python -c "import fairring_pg._build as b; b.load_extension()"
echo "core built or loaded in $(( $(date +%s) - start )) s"

status=0
# pytest's 5: every test deselected (a -k that names none of them) is no failure
note_status() { if [[ $1 != 0 && $1 != 5 ]]; then status=$1; fi; }
if wants tests; then
    echo "== tests (MPS), $(date -u +%H:%M:%S)"
    set +e
    # M ranks x (lanes + 1) communicators of spinning kernels share one GPU's SMs under
    # MPS; fewer channels per communicator keep them all resident (a kernel that cannot
    # be scheduled while its peers spin would hang the job).
    export NCCL_MAX_NCHANNELS=${user_nchannels:-4}
    start_mps
    python -m pytest -q -m "cuda and not cuda_fault" "${CUDA_TESTS[@]}" \
        tests/test_subgroup_logic.py -p no:cacheprovider --durations=15 "$@" 2>&1 \
        | tee "$out_dir/cuda_tests.log"
    note_status "${PIPESTATUS[0]}"
    set -e
fi
if wants blocking; then
    echo "== tests under TORCH_NCCL_BLOCKING_WAIT=1 (MPS), $(date -u +%H:%M:%S)"
    set +e
    export NCCL_MAX_NCHANNELS=${user_nchannels:-4}
    start_mps
    TORCH_NCCL_BLOCKING_WAIT=1 python -m pytest -q -m "cuda and not cuda_fault" "${CUDA_TESTS[@]}" \
        -k "2x1 or concurrent or same_memory or bucket_views or blocking or gather_of_a_temporary" \
        -p no:cacheprovider --durations=10 "$@" 2>&1 | tee "$out_dir/cuda_blocking_tests.log"
    note_status "${PIPESTATUS[0]}"
    set -e
fi
if wants fuzz; then
    echo "== random programs against NCCL (MPS), $(date -u +%H:%M:%S)"
    set +e
    export NCCL_MAX_NCHANNELS=${user_nchannels:-4}
    start_mps
    python scripts/cuda_fuzz.py --device cuda --jobs "${FUZZ_JOBS:-8}" --seed "${FUZZ_SEED:-0}" \
        --shapes 2x1,2x2 --keep "$out_dir/fuzz_jobs" 2>&1 | tee "$out_dir/cuda_fuzz.log"
    note_status "${PIPESTATUS[0]}"
    set -e
fi
if wants faults; then
    echo "== fault tests (no MPS), $(date -u +%H:%M:%S)"
    set +e
    export NCCL_MAX_NCHANNELS=${user_nchannels:-4}
    # MPS contains a fatal fault per GPU, not per process: a client killed mid-kernel
    # takes every other client of the GPU down with it (seen on an H100: the survivors
    # got cudaErrorIllegalAddress, the next job cudaErrorDevicesUnavailable). On real
    # machines each rank has a GPU of its own, so the tests in which a rank dies or
    # fails run without MPS, each rank in a context of its own.
    stop_mps
    python -m pytest -q -m cuda_fault tests/test_cuda_faults.py -p no:cacheprovider \
        --durations=5 "$@" 2>&1 | tee "$out_dir/cuda_fault_tests.log"
    note_status "${PIPESTATUS[0]}"
    set -e
fi
if wants bench; then
    echo "== benchmark and profile (MPS), $(date -u +%H:%M:%S)"
    if [[ -n $user_nchannels ]]; then export NCCL_MAX_NCHANNELS=$user_nchannels; else unset NCCL_MAX_NCHANNELS; fi
    start_mps
    # Against NCCL only: Gloo moves CUDA tensors through the host and is not a target.
    python bench/cuda_allreduce.py --shapes "$shapes" --paths auto,lanes,measured --no-gloo \
        --timeout 300 --out "$out_dir" --profile "$out_dir/profile" \
        2>&1 | tee "$out_dir/cuda_bench.log" || status=1
fi
echo "== done, $(date -u +%H:%M:%S), status $status"
exit "$status"
