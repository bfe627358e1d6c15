#!/usr/bin/env bash
# On the GPU machine: run one part of a GPU check under a hard time limit, with its output in
# a log file (never a pipe a leftover server could hold open), then kill whatever still uses
# the GPU, pack the logs into $OUT/NAME.tgz and print the log's tail.
#   bash scripts/gpu_part.sh SECONDS NAME COMMAND...
# COMMAND sees OUT=/tmp/gpu-logs/NAME for its own files.
secs=$1
name=$2
shift 2
logs=/tmp/gpu-logs
mkdir -p "$logs/$name"
start=$SECONDS
OUT="$logs/$name" timeout -k 15 "$secs" "$@" >"$logs/$name.log" 2>&1 </dev/null
rc=$?
echo "== $name: exit $rc after $((SECONDS - start)) s" >>"$logs/$name.log"
nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | xargs -r kill -9 2>/dev/null
sleep 2
if [[ -n ${OUT:-} ]]; then
  # Logs and reports only: model weights would make the archive too big to bring back.
  tar -czf "$OUT/$name.tgz" --exclude='models' --exclude='*.safetensors' --exclude='*.bin' \
    -C "$logs" "$name" "$name.log" 2>/dev/null
fi
tail -n 60 "$logs/$name.log"
exit $rc
