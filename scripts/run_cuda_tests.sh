#!/usr/bin/env bash
# The CUDA check, on a machine with one GPU and a CUDA build of torch (>= 2.11), no
# network needed: installs fairring_pg from this checkout, starts MPS when it can,
# runs the CUDA tests (tests/test_cuda.py: M = 2, 3, 4 simulated machines x 1 rank on
# cuda:0, each with its own FAIRRING_MACHINE_ID and NCCL_HOSTID, and 2 x 2 with Gloo
# local groups), then prints fairring vs NCCL vs Gloo at 2x1 and 4x1 from the same
# processes (bench/cuda_allreduce.py). Figures and logs go to $OUT (the device tool's
# folder) or bench/results/tmp/cuda.
#
#   bash scripts/run_cuda_tests.sh              # tests, then the benchmark
#   bash scripts/run_cuda_tests.sh --no-bench   # tests only
#   bash scripts/run_cuda_tests.sh --bench-only
#   bash scripts/run_cuda_tests.sh --no-bench -- -k 2x1   # the rest goes to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

out_dir=${OUT:-bench/results/tmp/cuda}
mkdir -p "$out_dir"
run_tests=1
run_bench=1
while [[ $# -gt 0 ]]; do
    case "$1" in
        --no-bench) run_bench=0 ;;
        --bench-only) run_tests=0 ;;
        --) shift; break ;;
        *) echo "run_cuda_tests.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
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
if [[ $run_tests == 1 ]]; then
    set +e
    # M ranks x (lanes + 1) communicators of spinning kernels share one GPU's SMs under
    # MPS; fewer channels per communicator keep them all resident (a kernel that cannot
    # be scheduled while its peers spin would hang the job). The benchmark keeps NCCL's
    # own choice, for fairring and NCCL alike.
    export NCCL_MAX_NCHANNELS=${NCCL_MAX_NCHANNELS:-4}
    start_mps
    python -m pytest -q -m "cuda and not cuda_fault" tests/test_cuda.py -p no:cacheprovider \
        --durations=15 "$@" 2>&1 | tee "$out_dir/cuda_tests.log"
    status=${PIPESTATUS[0]}
    # MPS contains a fatal fault per GPU, not per process: a client killed mid-kernel
    # takes every other client of the GPU down with it (seen on an H100: the survivors
    # got cudaErrorIllegalAddress, the next job cudaErrorDevicesUnavailable). On real
    # machines each rank has a GPU of its own, so the tests in which a rank dies or
    # fails run without MPS, each rank in a context of its own.
    stop_mps
    python -m pytest -q -m cuda_fault tests/test_cuda.py -p no:cacheprovider \
        --durations=5 "$@" 2>&1 | tee "$out_dir/cuda_fault_tests.log"
    fault_status=${PIPESTATUS[0]}
    # pytest's 5: every test deselected (a -k that names none of them)
    if [[ $fault_status != 0 && $fault_status != 5 ]]; then status=$fault_status; fi
    set -e
fi
if [[ $run_bench == 1 ]]; then
    start_mps
    python bench/cuda_allreduce.py --shapes 2x1,4x1 --timeout 200 --out "$out_dir" \
        2>&1 | tee "$out_dir/cuda_bench.log" || status=1
fi
exit "$status"
