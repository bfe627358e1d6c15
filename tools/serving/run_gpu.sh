#!/usr/bin/env bash
# The serving benchmark in both engines at once, one engine per GPU, on a GPU machine whose
# vLLM and SGLang stacks live in folders of their own (as ../shared/device's stage-wheels
# installs them: `pip install --target`):
#   setup   install this tree's wheel (dist/prefixattn-*.whl, from `python -m build --wheel`)
#           into $PA and compile its library against the vLLM stack's torch
#   run     GPU 0: `python -m tools.serving.bench --engine vllm $VLLM_ARGS`;
#           GPU 1: `python -m tools.serving.bench --engine sglang $SGLANG_ARGS`
#           (either may be empty: that engine does not run), each under BUDGET seconds in its
#           own process group, at once; on a machine of one GPU both run on it, one after
#           the other (2 x BUDGET). Then slim copies of their profiles' traces
#           (`tools/trace_summary.py --slim`) in $OUT/slim.
#   pytest  pytest on the vLLM stack (its torchvision from the SGLang stack, as below) with
#           this tree's tests, e.g. `bash tools/serving/run_gpu.sh pytest tests/gpu`
#   matrix  the integration matrix (`python -m tools.matrix.run_matrix --engines vllm
#           $VLLM_ARGS`, then `--engines sglang $SGLANG_ARGS`), each on its stack under
#           BUDGET seconds, every GPU visible; reports and logs in $OUT/matrix-ENGINE.*
#           (its models and engine logs in the folder $OUT/matrix-ENGINE)
#
#   VLLM_STACK=/root/site33 SGLANG_STACK=/root/site-sgl23 bash tools/serving/run_gpu.sh setup
#   VLLM_ARGS="--workloads forest --backends bound readfloor prefixattn --reps 2" \
#     SGLANG_ARGS="--workloads forest --backends bound readfloor prefixattn --reps 2" \
#     VLLM_STACK=... SGLANG_STACK=... BUDGET=560 bash tools/serving/run_gpu.sh run
#   VLLM_ARGS="--select delegate" SGLANG_ARGS="--select delegate" VLLM_STACK=... \
#     SGLANG_STACK=... BUDGET=280 bash tools/serving/run_gpu.sh matrix
#
# Env: VLLM_STACK, SGLANG_STACK (the engines' package folders; the SGLang stack may lack
# torch, which then comes from the vLLM stack after it), PA (prefixattn's folder, default
# /root/pa), OUT (results and logs, default /tmp/serving-gpu), BUDGET (seconds for the
# benchmarks, default 560), GPUS (the machine's GPUs, default: as nvidia-smi lists them),
# DRY_RUN=1 (print the commands only).
# Where a stack was installed with `pip --target`, its .pth files are not read: the one that
# nvidia-cutlass-dsl relies on (SGLang's `import cutlass`) is replaced by putting its
# dsl_packages folder on the path. The image's torchvision does not load beside a newer
# torch: when the SGLang stack holds torchvision, vLLM gets it from there too.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
: "${VLLM_STACK:?the vLLM stack's folder}" "${SGLANG_STACK:?the SGLang stack's folder}"
PA=${PA:-/root/pa}
OUT=${OUT:-/tmp/serving-gpu}
BUDGET=${BUDGET:-560}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export PREFIXATTN_CACHE_DIR=${PREFIXATTN_CACHE_DIR:-/root/pcache} PYTHONUNBUFFERED=1

vllm_path="$PA:$VLLM_STACK"
sglang_path="$PA:$SGLANG_STACK"
[ -d "$SGLANG_STACK/nvidia_cutlass_dsl/dsl_packages" ] &&
  sglang_path="$sglang_path:$SGLANG_STACK/nvidia_cutlass_dsl/dsl_packages"
sglang_path="$sglang_path:$VLLM_STACK"
if [ -d "$SGLANG_STACK/torchvision" ]; then
  mkdir -p "$OUT/torchvision-path"
  for f in "$SGLANG_STACK"/torchvision "$SGLANG_STACK"/torchvision-*.dist-info \
    "$SGLANG_STACK"/torchvision.libs; do
    [ -e "$f" ] && ln -sfn "$f" "$OUT/torchvision-path/"
  done
  vllm_path="$vllm_path:$OUT/torchvision-path"
fi

run() { # echo the command (with the GPU and path it gets); run it unless DRY_RUN
  echo "+ CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-} PYTHONPATH=${PYTHONPATH:-} $*"
  [ "${DRY_RUN:-0}" = 1 ] || "$@"
}

case "${1:-}" in
  setup)
    wheel=$(ls dist/prefixattn-*.whl 2>/dev/null | tail -n 1)
    [ -n "$wheel" ] || {
      echo "run_gpu.sh: no dist/prefixattn-*.whl: build one first (python -m build --wheel)" >&2
      exit 2
    }
    run rm -rf "$PA"
    run python3 -m pip install -q --no-deps --no-compile --target "$PA" "$wheel" || exit 1
    PYTHONPATH=$vllm_path run python3 -m prefixattn.cli build || exit 1
    PYTHONPATH=$vllm_path run python3 -m prefixattn.cli info
    ;;
  run)
    [ -n "${VLLM_ARGS:-}${SGLANG_ARGS:-}" ] || {
      echo "run_gpu.sh run: set VLLM_ARGS and/or SGLANG_ARGS" >&2
      exit 2
    }
    gpus=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
    sglang_gpu=1
    [ "${gpus:-0}" -ge 2 ] || sglang_gpu=0
    pids=()
    if [ -n "${VLLM_ARGS:-}" ]; then
      # shellcheck disable=SC2086
      (CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$vllm_path run setsid timeout -k 10 "$BUDGET" \
        python3 -m tools.serving.bench --engine vllm --budget $((BUDGET - 20)) \
        --out "$OUT/vllm.json" $VLLM_ARGS >"$OUT/vllm.log" 2>&1) &
      if [ "$sglang_gpu" = 1 ]; then
        pids+=($!)
      else # one GPU: SGLang waits for vLLM to finish
        wait $! || rc_first=1
      fi
    fi
    if [ -n "${SGLANG_ARGS:-}" ]; then
      # shellcheck disable=SC2086
      (CUDA_VISIBLE_DEVICES=$sglang_gpu PYTHONPATH=$sglang_path run setsid timeout -k 10 \
        "$BUDGET" python3 -m tools.serving.bench --engine sglang --budget $((BUDGET - 20)) \
        --out "$OUT/sglang.json" $SGLANG_ARGS >"$OUT/sglang.log" 2>&1) &
      pids+=($!)
    fi
    rc=${rc_first:-0}
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    [ "${DRY_RUN:-0}" = 1 ] && cat "$OUT"/*.log
    for log in "$OUT"/vllm.log "$OUT"/sglang.log; do [ -f "$log" ] && tail -n 15 "$log"; done
    # The profiles named in the arguments (--profile DIR): slim copies of their traces.
    for dir in $(echo "${VLLM_ARGS:-} ${SGLANG_ARGS:-}" | grep -o -- '--profile [^ ]*' |
      cut -d' ' -f2); do
      mapfile -t traces < <(find "$dir" -name '*.json.gz' 2>/dev/null)
      [ ${#traces[@]} -gt 0 ] && run python3 -m tools.trace_summary "${traces[@]}" \
        --slim "$OUT/slim" >/dev/null
    done
    exit $rc
    ;;
  pytest)
    shift
    PYTHONPATH=$vllm_path run python3 -m pytest -q -p no:cacheprovider "$@"
    ;;
  matrix)
    [ -n "${VLLM_ARGS:-}${SGLANG_ARGS:-}" ] || {
      echo "run_gpu.sh matrix: set VLLM_ARGS and/or SGLANG_ARGS" >&2
      exit 2
    }
    rc=0
    for engine in vllm sglang; do
      if [ "$engine" = vllm ]; then args=${VLLM_ARGS:-} path=$vllm_path; else
        args=${SGLANG_ARGS:-} path=$sglang_path
      fi
      [ -n "$args" ] || continue
      # shellcheck disable=SC2086
      (PYTHONPATH=$path run setsid timeout -k 10 "$BUDGET" python3 -m tools.matrix.run_matrix \
        --engines "$engine" --budget $((BUDGET - 20)) --work "$OUT/matrix-$engine" \
        --out-md "$OUT/matrix-$engine.md" --out-json "$OUT/matrix-$engine.json" $args \
        >"$OUT/matrix-$engine.log" 2>&1) || rc=1
      tail -n 5 "$OUT/matrix-$engine.log"
    done
    exit $rc
    ;;
  *)
    echo "usage: bash tools/serving/run_gpu.sh setup|run|pytest|matrix (see the header)" >&2
    exit 2
    ;;
esac
