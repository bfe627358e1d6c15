#!/usr/bin/env bash
# Long GPU runs through short remote commands: start a run in the background on the GPU machine,
# then wait for it (or for one of its steps) in later commands and bring its logs back.
#
#   bash scripts/gpu_bg.sh start NAME CMD...   # runs CMD detached, in its own session; returns
#   bash scripts/gpu_bg.sh mark NAME STEP      # (inside CMD) records that STEP is done
#   bash scripts/gpu_bg.sh wait NAME [STEP] [SECONDS]
#                                              # waits up to SECONDS (default 540) for STEP
#                                              # (default: the run's end), prints the progress
#                                              # log and packs the run's folder into $OUT/NAME.tgz
#   bash scripts/gpu_bg.sh status NAME
#
# Everything of run NAME lives in $GPU_BG_ROOT/NAME (default /tmp/gpu-bg/NAME): `progress.log`
# (CMD's output, with a timestamped line per step), `steps/STEP` markers and `rc` (CMD's exit
# status, written last).
# CMD sees BG_DIR (that folder), so its steps can write their logs and JSON there.
# Model weights (*.safetensors, *.bin) are left out of the archive.
#
# Example, a build and test step then an engine check, brought back in two commands:
#   bash scripts/gpu_bg.sh start k bash -c 'OUT=$BG_DIR bash scripts/gpu_kernels.sh build test;
#     bash scripts/gpu_bg.sh mark k tests; OUT=$BG_DIR/vllm bash integration/vllm/run_gpu.sh check'
#   bash scripts/gpu_bg.sh wait k tests 300
#   bash scripts/gpu_bg.sh wait k
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root=${GPU_BG_ROOT:-/tmp/gpu-bg}
cmd=${1:-}
name=${2:-}
usage() { awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; }
[[ -n $cmd && -n $name ]] || { usage; exit 2; }
dir=$root/$name

case $cmd in
  start)
    shift 2
    (($# > 0)) || { echo "start: no command" >&2; exit 2; }
    [[ -e $dir && ! -e $dir/rc ]] && { echo "run '$name' is still going" >&2; exit 1; }
    rm -rf "$dir" && mkdir -p "$dir/steps"
    echo "$(date +%T) start: $*" >"$dir/progress.log"
    BG_DIR=$dir setsid nohup bash -c '"$@" >>"$BG_DIR/progress.log" 2>&1; rc=$?
      echo "$(date +%T) end: exit $rc" >>"$BG_DIR/progress.log"; echo $rc >"$BG_DIR/rc"' \
      bash "$@" </dev/null >/dev/null 2>&1 &
    echo "started '$name' (pid $!); log $dir/progress.log"
    ;;
  mark)
    step=${3:?mark: no step name}
    mkdir -p "$dir/steps" && touch "$dir/steps/$step"
    echo "$(date +%T) step done: $step" >>"$dir/progress.log"
    ;;
  wait)
    step=${3:-}
    secs=${4:-540}
    if [[ $step =~ ^[0-9]+$ && $# -eq 3 ]]; then secs=$step step=""; fi
    marker=$dir/rc
    [[ -n $step ]] && marker=$dir/steps/$step
    [[ -d $dir ]] || { echo "no run '$name' on this machine (was it given back?)" >&2; exit 1; }
    start=$SECONDS
    until [[ -e $marker || -e $dir/rc ]] || ((SECONDS - start >= secs)); do sleep 5; done
    tail -n 60 "$dir/progress.log"
    if [[ -e $marker ]]; then
      echo "== '${step:-end}' reached after $((SECONDS - start)) s of waiting"
    elif [[ -e $dir/rc ]]; then
      echo "== the run ended (exit $(cat "$dir/rc")) without step '$step'"
    else
      echo "== '${step:-end}' not reached after $secs s (the run goes on)"
    fi
    [[ -e $dir/rc ]] && echo "== run '$name' ended: exit $(cat "$dir/rc")"
    if [[ -n ${OUT:-} ]]; then
      tar -czf "$OUT/$name.tgz" --exclude='*.safetensors' --exclude='*.bin' -C "$root" "$name"
      echo "logs: $OUT/$name.tgz"
    fi
    [[ -e $marker ]]
    ;;
  status)
    [[ -d $dir ]] || { echo "no run '$name'"; exit 1; }
    ls "$dir/steps"
    [[ -e $dir/rc ]] && echo "ended: exit $(cat "$dir/rc")" || echo "running"
    tail -n 20 "$dir/progress.log"
    ;;
  *)
    usage
    exit 2
    ;;
esac
