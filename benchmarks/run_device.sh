#!/usr/bin/env bash
# Every GPU benchmark in one device call (BENCHMARKS.md's numbers).  Each script
# runs under its own timeout and writes its JSON after every case, so one hang
# or failure cannot cost the others.  From the repository root, on the device:
#   source .whl/device-env.sh && benchmarks/run_device.sh "$OUT" [ENGINE ARGS...]
set -u
out=${1:-benchmarks/results}; shift || true
mkdir -p "$out/host"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv | tee "$out/nvidia-smi.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$out/nvidia-smi.txt"
bench() {
  local limit=$1; shift
  local start; start=$(date +%s)
  echo "=== python -m $* (limit ${limit}s) ==="
  timeout "$limit" python3 -m "$@"
  echo "=== rc=$? after $(( $(date +%s) - start )) s: $1 ==="
}
bench "${KERNEL_FLOOR_S:-200}" benchmarks.kernel_floor --out "$out"
bench "${METADATA_S:-90}" benchmarks.metadata --device cuda --repeats 30 --out "$out"
bench 40 benchmarks.metadata --device cpu --repeats 100 --out "$out/host"
bench 30 benchmarks.metadata_stages --out "$out/host"
bench "${CUDA_GRAPHS_S:-60}" benchmarks.cuda_graphs --out "$out"
bench "${ENGINE_S:-200}" benchmarks.engine --out "$out" "$@"
