#!/usr/bin/env bash
# The device calls docs/gpu-runbook.md owes, one argument each, so a session whose machine
# comes late spends no time writing them.  From the repository root, on the device, with
# `.whl` and `.fi-cache.tgz` carried:
#   bash benchmarks/device_calls.sh ab       # quant1's tokens, the GEMV forms, the batch-1 A/B,
#                                            # the switches' tokens (with no kernels carried:
#                                            # those tokens move to `ab2`)
#   bash benchmarks/device_calls.sh replan   # decode graphs re-planned each step (GRAPH_REPLAN):
#                                            # the batch-1 A/B at a 131k limit, graph and token tests
#   bash benchmarks/device_calls.sh combo    # ab2 + replan in one call (router and re-plan on together)
#   bash benchmarks/device_calls.sh ownkeys  # issue 20's prefill: GPU tests, then 8k/32k for the
#                                            # defaults, all switches, MOE_COMBINE_RANKED,
#                                            # SHARED_SILU_QUANT, the old rope, own keys off,
#                                            # paged earlier keys (PREFILL_VARIANTS)
#   bash benchmarks/device_calls.sh vecrank  # ROPE_VEC, MOE_COMBINE_RANKED, SHARED_SILU_QUANT: tests,
#                                            # tokens, prefill A/B
#   bash benchmarks/device_calls.sh oracle   # the FP8 oracle tests under COMBINE_RANKED / SHARED_SILU_QUANT
#   bash benchmarks/device_calls.sh earlier  # rope forms; gathered vs paged earlier keys, alternated;
#                                            # memory and engine tests with them on
#   bash benchmarks/device_calls.sh tpot     # the async batch-1 step: defaults, router, gemv16
#   bash benchmarks/device_calls.sh targets  # one H200 call: the batch-1 step (defaults, gemv16)
#                                            # and the 8k/32k prefill (defaults, onepass), twice
#   bash benchmarks/device_calls.sh tune     # every GEMV tile (the tensor-core form's too) at 1, 2, 16 rows
#   bash benchmarks/device_calls.sh stress   # issue 20: FA2/FA3 stress (500 batches, 50 reporter reps)
#   bash benchmarks/device_calls.sh verify   # the defaults' paths: attention, engine, memory,
#                                            # piecewise and norm tests (about 300 s)
#   bash benchmarks/device_calls.sh checks   # verify's tests, then the oracle tests with both
#                                            # prefill switches on (one call)
#   bash benchmarks/device_calls.sh suite    # the rest of tests/gpu
#   bash benchmarks/device_calls.sh quantrows # FP8 quantization's warps / blocks at prefill sizes
#   bash benchmarks/device_calls.sh serve    # issue 24: full-size Scout FP8 1k/1k, 256 clients (H200)
#   bash benchmarks/device_calls.sh sanitize # issue 20: the FA3 probe under each compute-sanitizer tool
#   bash benchmarks/device_calls.sh ragged   # issue 20, item 4: the step's own keys ragged + paged,
#                                            # merged by LSE, against paged only (never run)
#   bash benchmarks/device_calls.sh tokens   # the FP8 engine tokens with the defaults alone
#   bash benchmarks/device_calls.sh quick    # Triton only (no FlashInfer kernel to compile, for
#                                            # a call of under 200 s): the one-pass quantization
#                                            # and every GEMV form against the torch reference
#   bash benchmarks/device_calls.sh splitkv  # decode graphs at 1k contexts planned for 1k keys
#                                            # and for a 128k max_model_len (runbook)
# Each step has its own time limit (a call may run 600 s), writes under $OUT as it goes,
# and the call ends by packing the compiled kernels into $OUT/fi-cache.tgz.part* (cat them
# into .fi-cache.tgz here).  pytest summaries also land in $OUT/pytest-summaries.txt: a wide
# benchmark table can push them out of the output's tail.
set -u
source .whl/device-env.sh || exit 1
find /tmp/site -exec touch -h -d '2020-01-01 00:00' {} + 2>/dev/null
# FlashInfer kernels compiled on the CPU machine (tools/flashinfer_aot.py): FlashInfer
# loads data/aot/<name>/<name>.so before it compiles anything.
if [ -f .fi-aot.tgz ]; then
  mkdir -p /tmp/site/flashinfer/data/aot && tar xzf .fi-aot.tgz -C /tmp/site/flashinfer/data/aot \
    && echo "AOT kernels: $(ls /tmp/site/flashinfer/data/aot | wc -l) modules"
fi
export TRITON_CACHE_DIR=$PWD/.fi-cache/triton
export CHUNKLOCAL_TEST_LOG=$OUT/tests.log
t0=$(date +%s)
say() { echo "[t=$(( $(date +%s) - t0 ))s] $*"; }
pt() {  # pt LIMIT_S PYTEST_ARGS... (pyproject's addopts is -q already: a second -q hides
  # the "N passed" line, as it did in every call before the 30th session's last)
  local limit=$1; shift
  say "pytest $*"
  timeout "$limit" python3 -m pytest -rfEs -p no:cacheprovider "$@" 2>&1 | tail -25 \
    | tee -a "$OUT/pytest-summaries.txt"
}
bench() {  # bench LIMIT_S LOG_NAME MODULE ARGS...
  local limit=$1 log=$2; shift 2
  say "python -m $*"
  timeout "$limit" python3 -m "$@" >> "$OUT/$log.log" 2>&1
  echo "rc=$?"; grep -v '^\s*$' "$OUT/$log.log" | tail -16 | cut -c1-240
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv \
  | tee "$OUT/nvidia-smi.txt"
big=$(python3 -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory > 100e9))")
# A fresh checkout carries no compiled kernels: the first pytest step compiles them
# (15-80 s each), so it gets longer and the switches' token step moves to `ab2`.
# FlashInfer's modules built on the CPU (.fi-aot.tgz) leave only Triton's kernels to compile.
cold=0; [ -f .fi-cache.tgz ] || cold=1
[ "$cold" = 1 ] && [ -f .fi-aot.tgz ] && cold=aot
ab_tokens() {  # the engine's tokens with the in-kernel router on (PDL and the GEMV's partial
  # sums are defaults since the 27th session)
  ( export CHUNKLOCAL_MOE_ROUTER_IN_KERNEL=1
    pt "$1" tests/gpu/test_fp8_gpu.py tests/gpu/test_engine_gpu.py tests/gpu/test_fp8_triton_gpu.py \
      -k "gemv or oracle or tokens" )
}
# full-size Scout FP8 where it fits (the H200), else 12 of its layers: switch_ab's
# arguments, the model of the decode benchmarks, prefill_profile's --models
if [ "$big" = 1 ]; then model="--model scout-fp8 --repeats 3"; tmodel=scout-fp8; pmodel=""
else model="--model scout-fp8-12 --repeats 4"; tmodel=scout-fp8-12; pmodel="--models scout-fp8-12"; fi
variant_env() {  # variant_env NAME[+NAME...]: export a prefill variant's switches (in a
  # subshell); "defaults" exports none.  all: every prefill switch still off (ROPE_VEC is a
  # default since the 30th session; novec turns it off); "all+fast": both sets
  local part
  if [ "${1#*+}" != "$1" ]; then
    for part in ${1//+/ }; do variant_env "$part" || return 1; done; return 0
  fi
  case $1 in own0) export CHUNKLOCAL_RAGGED_OWN_KEYS=0 ;;
             paged) export CHUNKLOCAL_RAGGED_EARLIER=0 ;;
             novec) export CHUNKLOCAL_ROPE_VEC=0 ;;
             combine) export CHUNKLOCAL_MOE_COMBINE_RANKED=1 ;;
             shared) export CHUNKLOCAL_MOE_SHARED_SILU_QUANT=1 ;;
             all) export CHUNKLOCAL_MOE_COMBINE_RANKED=1 CHUNKLOCAL_MOE_SHARED_SILU_QUANT=1 ;;
             fastx) export CHUNKLOCAL_FP8_FAST_ACCUM=experts ;;  # unpromoted FP8 partial
             fast) export CHUNKLOCAL_FP8_FAST_ACCUM=1 ;;         # sums: experts; all GEMMs
             promoted) export CHUNKLOCAL_FP8_FAST_ACCUM=0 ;;     # (the default since s32)
             onepass) export CHUNKLOCAL_FP8_QUANT_TWO_PASS_ROWS=0 ;;  # prefill rows of 5120
               # in one pass, as before the 33rd session (the two 1024-wide passes: default)
             quant2) export CHUNKLOCAL_FP8_QUANT_ONE_PASS=0 ;;  # the quantization's two-pass
               # form (smaller blocks, more programs a multiprocessor), measured at batch 1 only
             defaults) ;;
             *) echo "unknown variant: $1"; return 1 ;; esac
}
prefill_run() {  # prefill_run VARIANT LIMIT_S LOG OUT_DIR: the 8k and 32k prefill in one
  # process with a prefill variant's switches (variant_env)
  ( variant_env "$1" || exit
    # shellcheck disable=SC2086
    bench "$2" "$3" benchmarks.prefill_profile --prompts 8192 32768 $pmodel --profile-steps 1 \
      --out "$4" )
}
tpot_run() {  # tpot_run VARIANT LIMIT_S LOG OUT_DIR [ARGS...]: issue 19's async-scheduled
  # batch-1 step (benchmarks.overlap_decode) in one process with a batch-1 variant's switches
  local variant=$1 limit=$2 log=$3 out=$4; shift 4
  ( case $variant in router) export CHUNKLOCAL_MOE_ROUTER_IN_KERNEL=1 ;;
                     gemv16) export CHUNKLOCAL_GEMV_LINEAR=1 ;;
                     norouter) export CHUNKLOCAL_MOE_ROUTER_IN_KERNEL=0 ;;
                     replan) export CHUNKLOCAL_MOE_ROUTER_IN_KERNEL=1 CHUNKLOCAL_GRAPH_REPLAN=1 ;; esac
    bench "$limit" "$log" benchmarks.overlap_decode --model $tmodel --kv-cache-dtype fp8 \
      --batches 1 --new 64 --rounds 2 "$@" --out "$out" )
}
prefill_variants() {  # prefill_variants "VARIANTS": 8k and 32k prefill, one process a variant,
  # until 545 s into the call; one JSON archive (a call brings back at most 8 files)
  for variant in $1; do
    left=$(( 545 - $(date +%s) + t0 ))
    if [ "$left" -lt 60 ]; then say "no time for $variant"; continue; fi
    echo "== variant $variant" >> "$OUT/prefill.log"
    prefill_run "$variant" $(( left < 150 ? left : 150 )) prefill "/tmp/pj/prefill_$variant"
  done
  tar czf "$OUT/prefill_json.tgz" -C /tmp pj 2>/dev/null
}
verify_tests() {  # verify_tests LIMIT_S: the defaults' GPU paths (attention: own keys, the
  # all-rows merge, the gathered earlier keys; the engine's tokens, the memory profile,
  # piecewise graphs, rope)
  pt "$1" tests/gpu/test_flashinfer.py tests/gpu/test_engine_gpu.py tests/gpu/test_memory_gpu.py \
    tests/gpu/test_piecewise_gpu.py tests/gpu/test_norm_triton_gpu.py
}
accumulation_tests() {  # torch's FP8 GEMMs in both accumulation forms (the `accumulation`
  # fixture); -s: the printed error ratios
  pt 90 tests/gpu/test_fp8_gpu.py -s -k "fast_accum_error or scaled_mm_equals or scaled_grouped_mm_equals"
}
oracle_tests() {  # oracle_tests VARIANT LIMIT_S: the FP8 oracle tests (a model trained in
  # the process) with a prefill variant's switches
  ( variant_env "$1" || exit
    echo "== oracle $1" | tee -a "$OUT/pytest-summaries.txt"
    pt "$2" tests/gpu/test_fp8_gpu.py -k "fake_quant_oracle_on_a_trained_model or shared_expert_as_a_group" )
}
case ${1:-ab} in
  ab)
    case $cold in 0) first=140 ;; aot) first=180 ;; *) first=230 ;; esac
    pt $first tests/gpu/test_fp8_gpu.py tests/gpu/test_fp8_quant_gpu.py
    pt 60 tests/gpu/test_fp8_triton_gpu.py -k gemv  # every form, the tensor-core one too
    # a switch flips its default: pdl and gemv_partial (on) measure them off
    # shellcheck disable=SC2086
    bench 200 ab1 benchmarks.switch_ab $model --batch 1 --switches router gemv_mma pdl \
      gemv_partial --out "$OUT/ab1" ;;&
  ab|replan)  # decode graphs re-planned each step, under a server's 131k limit
    # shellcheck disable=SC2086
    bench 150 replan benchmarks.switch_ab $model --batch 1 --max-model-len 131072 \
      --switches graph_replan router+graph_replan --out "$OUT/replan" ;;&
  replan)  # its graphs against the reference and the engine's tokens with it on
    ( export CHUNKLOCAL_GRAPH_REPLAN=1
      pt 300 tests/gpu/test_flashinfer.py tests/gpu/test_engine_gpu.py tests/gpu/test_fp8_gpu.py \
        -k "graph or tokens" ) ;;
  ab)
    left=$(( 540 - $(date +%s) + t0 ))  # the call's 600 s less setup and packing
    if [ "$cold" = 1 ] || [ "$left" -lt 60 ]; then say "the switches' tokens run in 'ab2'"
    else ab_tokens "$left"; fi ;;
  ab2)
    ab_tokens 300 ;;
  combo)  # ab2 and replan in one call: the 131k A/B, then the tokens and graph tests with
    # the in-kernel router and the re-plan both on (a failure is then read per test name)
    # shellcheck disable=SC2086
    bench 200 replan benchmarks.switch_ab $model --batch 1 --max-model-len 131072 \
      --switches graph_replan router router+graph_replan --out "$OUT/replan"
    ( export CHUNKLOCAL_MOE_ROUTER_IN_KERNEL=1 CHUNKLOCAL_GRAPH_REPLAN=1
      pt 320 tests/gpu/test_fp8_gpu.py tests/gpu/test_engine_gpu.py tests/gpu/test_fp8_triton_gpu.py \
        tests/gpu/test_flashinfer.py -k "gemv or oracle or tokens or graph" ) ;;
  ownkeys)  # issue 20's prefill: the GPU tests (OWNKEYS_TESTS=0 skips them), then the
    # prefill at 8k and 32k, one process a variant, in order of what they decide: the
    # defaults (own keys ragged, earlier keys gathered, the whole-head rope), all three
    # prefill switches on, the ranked combine (MOE_COMBINE_RANKED) and the shared expert's
    # fused SiLU (MOE_SHARED_SILU_QUANT) alone, then the old rope, own keys off and the paged
    # earlier keys
    if [ "${OWNKEYS_TESTS:-1}" = 1 ]; then
      pt 200 tests/gpu/test_flashinfer.py tests/gpu/test_engine_gpu.py -k "own_keys or tokens or reporter or logits"
      pt 90 tests/gpu/test_norm_triton_gpu.py tests/gpu/test_moe_gpu.py -k "rope or by_rank"
    fi
    prefill_variants "${PREFILL_VARIANTS:-defaults all combine shared novec own0 paged}" ;;
  vecrank)  # issue 20's three prefill switches (ROPE_VEC, MOE_COMBINE_RANKED with the shared
    # expert's add, MOE_SHARED_SILU_QUANT), off by default: their kernel and FP8 token tests,
    # the engine's tokens with all three on, then the prefill with all three against the
    # defaults (VECRANK_VARIANTS)
    pt 150 tests/gpu/test_norm_triton_gpu.py tests/gpu/test_moe_gpu.py tests/gpu/test_fp8_gpu.py \
      -k "rope or by_rank or SHARED_SILU"
    ( variant_env all
      pt 200 tests/gpu/test_engine_gpu.py -k "tokens or reporter or logits" )
    prefill_variants "${VECRANK_VARIANTS:-all defaults}" ;;
  oracle)  # the FP8 oracle tests (a model trained in each process, about 60 s) under the
    # prefill switches still off: both on ("all"), each alone, both on again (a process a variant:
    # one trained model failed all four with ROPE_VEC + both on in the 30th session's call,
    # each of ROPE_VEC and SHARED_SILU_QUANT alone passed on other trained models)
    for v in ${ORACLE_VARIANTS:-all combine shared all}; do
      left=$(( 545 - $(date +%s) + t0 ))
      if [ "$left" -lt 100 ]; then say "no time for $v"; continue; fi
      oracle_tests "$v" $(( left < 200 ? left : 200 ))
    done
    # the shared expert now runs before the routed ones (after the 30th session's calls)
    left=$(( 560 - $(date +%s) + t0 ))
    if [ "$left" -ge 40 ]; then pt "$left" tests/gpu/test_memory_gpu.py; fi ;;
  earlier)  # issue 20's two prefill switches, off by default: the rope kernel's forms
    # (ROPE_TILED, ROPE_VEC: GPU test, then each form's kernel time in an 8k prefill), the
    # gathered earlier keys (RAGGED_EARLIER) against the paged ones alternated twice at 32k
    # and 64k, then the memory and engine tests with them on.  At most 8 files come back:
    # the rope runs leave their JSON out (their figures go to the log), no kernels packed.
    export CHUNKLOCAL_TEST_LOG=/tmp/tests.log  # (a file fewer)
    pt 90 tests/gpu/test_norm_triton_gpu.py -k rope
    for v in one tiled vec; do
      # shellcheck disable=SC2086
      CHUNKLOCAL_ROPE_TILED=$([ $v = tiled ] && echo 1 || echo 0) \
      CHUNKLOCAL_ROPE_VEC=$([ $v = vec ] && echo 1 || echo 0) \
        bench 90 rope benchmarks.prefill_profile --prompts 8192 $pmodel --profile-steps 2 \
          --out "/tmp/rope_$v"
      python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][-1]; \
k=r['profile']['kernels_ms_per_step']; print('rope form', sys.argv[2], 'prefill_s', \
round(r['prefill_s'], 4), 'rope kernel ms/step', round(k.get('_rope_norm_kernel', -1), 3), \
'busy ms/step', round(r['profile']['device_busy_ms_per_step'], 2))" \
        "/tmp/rope_$v/prefill_profile.json" "$v" | tee -a "$OUT/rope.log"
    done
    for round in 1 2; do
      for v in paged gathered; do
        e=0; [ "$v" = gathered ] && e=1
        left=$(( ${CALL_S:-560} - 80 - $(date +%s) + t0 ))
        if [ "$left" -lt 60 ]; then say "no time for $v round $round"; continue; fi
        # shellcheck disable=SC2086
        CHUNKLOCAL_RAGGED_EARLIER=$e bench 100 earlier benchmarks.prefill_profile \
          --prompts 32768 65536 $pmodel --profile-steps 1 --out "$OUT/earlier_${v}_$round"
      done
    done
    left=$(( ${CALL_S:-560} - $(date +%s) + t0 ))  # CALL_S: the call's own limit
    ( export CHUNKLOCAL_RAGGED_EARLIER=1
      pt "$left" tests/gpu/test_memory_gpu.py tests/gpu/test_engine_gpu.py \
        -k "memory or profile or tokens or reporter or logits" ) ;;
  tpot)  # issue 19's target, the async-scheduled batch-1 step: the defaults, the in-kernel
    # router (on by default since the 28th session: `norouter` is its A/B), the 16-bit GEMV
    # (q/k/v, o_proj and the LM head, which runs outside the graph), one process each,
    # alternated twice
    for round in 1 2; do
      for v in ${TPOT_VARIANTS:-defaults norouter gemv16}; do
        left=$(( 545 - $(date +%s) + t0 ))
        if [ "$left" -lt 100 ]; then say "no time for $v round $round"; continue; fi
        tpot_run "$v" $(( left < 110 ? left : 110 )) "tpot_${v}_$round" "$OUT/tpot_${v}_$round"
      done
    done ;;
  targets)  # one H200 call for issues 19 and 20's targets at full size: the async batch-1
    # step (defaults, then the 16-bit GEMV for the bf16 projections and the LM head, which
    # runs outside the graph: only the async step sees it), the 8k/32k prefill (defaults, then the
    # one-pass quantization, as before the 33rd session), then each again while time is left;
    # one log (targets.log) and one JSON archive: a call brings back at most 8 files
    for round in 1 2; do
      for v in tpot_defaults tpot_gemv16 prefill_defaults prefill_onepass; do
        left=$(( 530 - $(date +%s) + t0 ))
        if [ "$left" -lt 90 ]; then say "no time for $v round $round"; continue; fi
        echo "== $v round $round" >> "$OUT/targets.log"
        case $v in
          tpot_*) tpot_run "${v#tpot_}" $(( left < 110 ? left : 110 )) targets "/tmp/pj/${v}_$round" ;;
          prefill_*) prefill_run "${v#prefill_}" $(( left < 150 ? left : 150 )) targets \
                       "/tmp/pj/${v}_$round" ;;
        esac
      done
    done
    tar czf "$OUT/prefill_json.tgz" -C /tmp pj 2>/dev/null ;;
  tune)
    bench 540 gemv_tune benchmarks.fp8_small_m --rows 1 --gemv-tune 1 2 16 --out "$OUT/tune" ;;
  stress)
    bench 470 prefill_stress benchmarks.prefill_stress --random-budget-s 330 --deadline-s 420 \
      --out "$OUT/prefill_stress.json" ;;
  verify)  # the defaults' GPU paths first (verify_tests)
    verify_tests 500
    # then issue 19's async batch-1 step with the defaults, profiled (kernel classes, idle)
    left=$(( 545 - $(date +%s) + t0 ))
    if [ "$left" -ge 120 ]; then
      tpot_run defaults "$left" tpot_profile "$OUT/tpot_profile" --profile
    else say "no time for the profiled step"; fi ;;
  checks)  # one call for a session with little device time: the defaults' GPU tests (as
    # verify's), then the FP8 oracle tests with both prefill switches still off turned on
    verify_tests 330
    accumulation_tests
    left=$(( 545 - $(date +%s) + t0 ))
    if [ "$left" -ge 100 ]; then bench 150 quant_rows benchmarks.quant_rows --out "$OUT"
    else say "no time for quant_rows"; fi
    left=$(( 545 - $(date +%s) + t0 ))
    if [ "$left" -ge 100 ]; then oracle_tests all "$left"
    else say "no time for the oracle tests"; fi ;;
  fastchecks)  # a short call (CALL_S seconds, 330 by default): torch's FP8 GEMMs in both
    # accumulation forms, quant_rows, then verify's tests in what is left
    accumulation_tests
    bench 150 quant_rows benchmarks.quant_rows --out "$OUT"
    left=$(( ${CALL_S:-330} - $(date +%s) + t0 ))
    if [ "$left" -ge 60 ]; then verify_tests "$left"; else say "no time for verify's tests"; fi ;;
  quantrows)  # the quantization kernel's launch choices at prefill sizes (8,192 rows)
    bench 200 quant_rows benchmarks.quant_rows --rows 256 1024 2048 8192 --out "$OUT" ;;
  suite)
    pt 540 tests/gpu --ignore=tests/gpu/test_engine_gpu.py --ignore=tests/gpu/test_piecewise_gpu.py \
      --ignore=tests/gpu/test_memory_gpu.py --ignore=tests/gpu/test_pdl_gpu.py ;;
  sanitize)
    cs=/usr/local/cuda/bin/compute-sanitizer; [ -x $cs ] || cs=$(command -v compute-sanitizer)
    probe="python3 -m benchmarks.fa3_sanitizer_probe"
    for tool in "racecheck --racecheck-report hazard" "racecheck --racecheck-memcpy-async no" \
                "synccheck" "memcheck"; do
      name=$(echo "$tool" | tr -s ' -' '_' | cut -c1-40)
      say "compute-sanitizer --tool $tool"
      extra=""; [ "$tool" = memcheck ] && extra="--reporter --repeats 2"
      # shellcheck disable=SC2086
      timeout 140 "$cs" --tool $tool --print-limit 30 $probe $extra \
        --out "$OUT/probe_$name.json" > "$OUT/$name.txt" 2>&1
      echo "rc=$?"; tail -6 "$OUT/$name.txt"
    done ;;
  ragged)
    bench 540 prefill_ragged benchmarks.prefill_ragged --out "$OUT/ragged" ;;
  tokens)  # the engine's FP8 tokens with the defaults (one-pass quantization on), first
    pt "${TOKENS_LIMIT:-175}" tests/gpu/test_fp8_gpu.py tests/gpu/test_fp8_quant_gpu.py ;;
  quick)
    pt 80 tests/gpu/test_fp8_quant_gpu.py
    pt 90 tests/gpu/test_fp8_triton_gpu.py -k gemv ;;
  serve)  # issue 24: full-size Scout FP8, 1k prompts / 1k new tokens through the server,
    # 256 clients (an H200: the weights are 105 GiB).  SERVE_MAX_SEQS caps the requests in
    # flight (256 x 2048 tokens overfill the KV pool's 313k a group, so the twentieth
    # session's run preempted); SERVE_MNBT: steps of 2048 tokens (a smaller activation
    # reserve, so a larger KV pool, and prompt pieces beside the decodes).  224 and 2048
    # are benchmarks/serve_sim.py's best on the twentieth session's step times (BENCHMARKS.md,
    # within the model's own 5%); SERVE_REQUESTS: three waves by default, so the steady
    # state outweighs the ramp and the tail
    if [ "$big" != 1 ]; then say "serve needs an H200"; exit 0; fi
    timeout 560 python3 -m benchmarks.serve --make-scout-fp8 /tmp/sfp8 --launch /tmp/sfp8 \
      --routing balanced --serve-args "--load-format dummy --kv-cache-dtype fp8 \
      --gpu-memory-utilization 0.97 --max-model-len 2304 --max-num-seqs ${SERVE_MAX_SEQS:-224} \
      --max-num-batched-tokens ${SERVE_MNBT:-2048}" \
      --clients 256 --requests "${SERVE_REQUESTS:-768}" --duration 330 --timeout 420 \
      --prompt-tokens 1024 --max-tokens 1024 --max-token-id 100000 --verify 0 --progress 10 \
      --server-log "$OUT/server.log" --out "$OUT" 2>&1 | tail -40
    echo "rc=${PIPESTATUS[0]}" ;;
  splitkv)
    for len in 1024 131072; do
      bench 150 "splitkv_$len" benchmarks.cuda_graphs --batch-sizes 1 8 64 --min-context 1024 \
        --max-context 1024 --max-model-len $len --out "$OUT/splitkv_$len"
    done ;;
  *) echo "unknown call: $1 (ab, ab2, combo, replan, ownkeys, vecrank, oracle, verify, checks, earlier, tpot, tune, stress, suite, sanitize, ragged, splitkv, quick, tokens, quantrows, serve, fastchecks, targets)"; exit 2 ;;
esac
# a call brings back at most 8 files: `earlier` leaves the kernels (the AOT ones suffice)
[ "${1:-ab}" = earlier ] || tar czf - -C .fi-cache . | split -b 15M - "$OUT/fi-cache.tgz.part"
say "done; kernels packed"
grep -E "passed|failed|error" "$OUT/pytest-summaries.txt" 2>/dev/null || true  # none: a benchmark-only call
