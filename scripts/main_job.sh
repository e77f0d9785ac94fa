#!/usr/bin/env bash
# Main job: end-to-end DDP training of a small Transformer LM on 2 simulated machines
# x 2 ranks, once with the fairring backend and once with gloo, then a side-by-side
# table. The machines are network namespaces joined by links shaped to LINK (default
# 1gbit, tc tbf) as scripts/netns_cluster.py builds them: between machines the data
# crosses a network, within one it does not. LINK=loopback runs every rank on this
# host's loopback instead (also what happens without root or iproute2). Usage:
#
#   scripts/main_job.sh                 # fairring vs gloo
#   scripts/main_job.sh gloo gloo       # any two backends (the ratio is first/second)
#
# Knobs (environment): LINK, MACHINES, RANKS_PER_MACHINE, STEPS, WARMUP_STEPS, REPEATS,
# TIMEOUT_S, OUT_DIR. Extra training flags go in TRAIN_ARGS (e.g. "--batch 16").
set -euo pipefail

cd "$(dirname "$0")/.."
repo=$(pwd)

backend_a=${1:-fairring}
backend_b=${2:-gloo}
machines=${MACHINES:-2}
ranks_per_machine=${RANKS_PER_MACHINE:-2}
steps=${STEPS:-30}
warmup_steps=${WARMUP_STEPS:-5}
# Each backend runs REPEATS times, interleaved, and the best run counts: on a small
# shared host a background process can slow one run down, never speed it up.
repeats=${REPEATS:-3}
timeout_s=${TIMEOUT_S:-600}
out_dir=${OUT_DIR:-bench/results/tmp/main_job}
link=${LINK:-1gbit}
read -r -a train_args <<< "${TRAIN_ARGS:-}"

# Install (editable) unless this very checkout is already what Python imports; run from /
# so that the checkout itself is not on sys.path and only an installed copy is found.
installed=$(cd / && python -c "
import importlib.util as u
s = u.find_spec('fairring_pg')
print(s.origin if s and s.origin else '')" 2>/dev/null || true)
# The install brings torch if none is installed: the newest release pip resolves
# torch>=2.11 to, as a user's `pip install .` does (an installed torch is kept).
if [[ "$installed" != "$repo/fairring_pg/__init__.py" ]] || ! python -c "import torch" 2>/dev/null
then
    echo "== installing fairring_pg (pip install -e .)"
    pip install -q --root-user-action=ignore -e "$repo"
fi
python -c "import torch; print(f'== torch {torch.__version__}')"

if [[ "$backend_a" == fairring || "$backend_b" == fairring ]]; then
    # Compile the C++ extension once, outside the timed runs (minutes on first use).
    echo "== building the fairring extension (cached after the first time)"
    python -c "import fairring_pg._build as b; b.load_extension()"
fi

if [[ "$link" != loopback ]]; then
    if ! why=$(python -c "
from fairring_pg.tools import netns_cluster
print(netns_cluster.unavailable_reason() or '')"); then
        exit 1
    fi
    if [[ -n "$why" ]]; then
        echo "== LINK=$link needs network namespaces, and $why: running on loopback instead"
        link=loopback
    fi
fi

rm -rf "$out_dir"
mkdir -p "$out_dir"

run() {  # run <label> <backend>
    local label=$1 backend=$2
    echo "== $label: $machines machines x $ranks_per_machine ranks, link $link, --backend $backend"
    local train=(bench/train_ddp.py --backend "$backend"
        --steps "$steps" --warmup-steps "$warmup_steps"
        --json-out "$out_dir/$label.json" --dump-params "$out_dir/$label.pt"
        ${train_args[@]+"${train_args[@]}"})
    if [[ "$link" == loopback ]]; then
        python scripts/simulate_machines.py \
            --machines "$machines" --ranks-per-machine "$ranks_per_machine" \
            --timeout "$timeout_s" -- "${train[@]}"
    else
        python scripts/netns_cluster.py \
            --hosts "$machines" --ranks-per-host "$ranks_per_machine" --rate "$link" \
            --timeout "$timeout_s" -- "$(command -v python)" "${train[@]}"
    fi
}

for ((i = 1; i <= repeats; i++)); do
    run "a$i-$backend_a" "$backend_a"
    run "b$i-$backend_b" "$backend_b"
done

python - "$out_dir" <<'EOF'
"""Summary: best run per backend, the throughput ratio, and how far the weights drifted."""
import json
import sys
from pathlib import Path

import torch

out = Path(sys.argv[1])
runs = {side: [] for side in "ab"}
for path in sorted(out.glob("*.json")):
    result = json.loads(path.read_text())
    result["label"] = path.stem
    runs[path.stem[0]].append(result)
best = {side: max(rs, key=lambda r: r["words_per_s"]) for side, rs in runs.items()}
a, b = best["a"], best["b"]

print()
print(f"{a['machines']} machines x {a['ranks_per_machine']} ranks, {a['steps']} timed steps, "
      f"{a['grad_mib']} MiB of gradients; best of {len(runs['a'])} runs per backend")
header = (f"{'backend':<10} {'steps/s':>9} {'words/s':>10} {'final loss':>11}  "
          "all runs: words/s (1-min load average at the end)")
print(header)
print("-" * len(header))
for side in "ab":
    r = best[side]
    all_runs = ", ".join(f"{x['words_per_s']:.0f} ({x['load_avg'][0]:.1f})" for x in runs[side])
    print(f"{r['backend']:<10} {r['steps_per_s']:>9.3f} {r['words_per_s']:>10.1f} "
          f"{r['final_loss']:>11.4f}  {all_runs}")
ratio = a["words_per_s"] / b["words_per_s"]
print(f"ratio {a['backend']}/{b['backend']} (words/s): {ratio:.3f}")

pa = torch.load(out / f"{a['label']}.pt")
pb = torch.load(out / f"{b['label']}.pt")
diff = max((pa[k] - pb[k]).abs().max().item() for k in pa)
# Same seeds and data on both sides: the weights differ only by the summation order
# of the allreduces, and Adam normalises each step, so a gradient that is ~0 up to
# rounding still moves its weight by up to lr per step.
why = (f"{diff / a['lr']:.1f} x lr: same data and seeds, the allreduces only sum in "
       f"another order, and Adam turns rounding-level gradient differences into steps of "
       f"up to lr each (--optimizer sgd: ~1e-7)" if a["optimizer"] == "adam" else
       "same data and seeds: the allreduces only sum in another order")
print(f"max |param difference| {a['backend']} vs {b['backend']}: {diff:.3e} ({why})")
EOF
