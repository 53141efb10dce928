#!/usr/bin/env bash
# Every GPU benchmark in one device call (BENCHMARKS.md's numbers).  Each script
# runs under its own time limit and writes its JSON after every case, so one hang
# or failure cannot cost the others.  From the repository root, on the device:
#   source .whl/device-env.sh && benchmarks/run_device.sh OUT_DIR [SCRIPT ...]
# SCRIPT is any of kernel_floor metadata cuda_graphs engine moe decode_floor engine_core
# host_step (default: the first four).
# Extra engine arguments go in ENGINE_ARGS.
set -u
out=${1:-benchmarks/results}; shift || true
scripts=${*:-kernel_floor metadata cuda_graphs engine}
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
for s in $scripts; do
  case $s in
    kernel_floor) bench "${KERNEL_FLOOR_S:-170}" benchmarks.kernel_floor --out "$out" ;;
    metadata)
      bench "${METADATA_S:-50}" benchmarks.metadata --device cuda --repeats 30 --out "$out"
      bench 25 benchmarks.metadata --device cpu --repeats 100 --out "$out/host"
      bench 20 benchmarks.metadata_stages --out "$out/host" ;;
    cuda_graphs) bench "${CUDA_GRAPHS_S:-45}" benchmarks.cuda_graphs --out "$out" ;;
    engine) bench "${ENGINE_S:-200}" benchmarks.engine --out "$out" ${ENGINE_ARGS:-} ;;
    moe) bench "${MOE_S:-500}" benchmarks.moe --out "$out" ;;
    decode_floor) bench "${DECODE_FLOOR_S:-540}" benchmarks.decode_floor --out "$out" \
        ${DECODE_FLOOR_ARGS:---models scout4 maverick4 --profile --alternate 5} ;;
    engine_core) bench "${ENGINE_CORE_S:-300}" benchmarks.engine_core --out "$out" ;;
    host_step) bench 60 benchmarks.host_step --out "$out/host" ;;
  esac
done
