"""``python -m sglang.launch_server --attention-backend prefixattn`` answers an HTTP request.

Starts the server on localhost with the given model folder (e.g. the one engine_check.py
writes; ``--save-model DIR`` writes a fresh tiny random Llama there) and SGLang's default
settings (CUDA graphs on) plus ``--extra`` flags, waits for /health (bounded), sends one
/generate request with token ids, prints the answer, then stops the server's process group.

    python -m tools.sglang.server_smoke --save-model /tmp/tiny --timeout 240 \
        [--extra --disable-cuda-graph]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--save-model", default=None)
    ap.add_argument("--port", type=int, default=31234)
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more server flags")
    args = ap.parse_args()
    # On SIGTERM (e.g. from `timeout`) unwind, so the engines' process groups get killed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = args.model
    if args.save_model:
        from tools.sglang.engine_check import save_model

        save_model(args.save_model)
        model = args.save_model
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model,
           "--attention-backend", "prefixattn", "--skip-tokenizer-init", "--host", "127.0.0.1",
           "--port", str(args.port), "--mem-fraction-static", "0.3", *args.extra]  # fmt: skip
    proc = subprocess.Popen(cmd, start_new_session=True)
    base = f"http://127.0.0.1:{args.port}"
    t0 = time.time()
    try:
        while True:
            if proc.poll() is not None:
                print(f"server exited with {proc.returncode}", flush=True)
                return 1
            if time.time() - t0 > args.timeout:
                print("server did not become healthy in time", flush=True)
                return 1
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(2)
        print(f"healthy after {time.time() - t0:.1f} s", flush=True)
        body = json.dumps({"input_ids": list(range(100, 164)),
                           "sampling_params": {"temperature": 0, "max_new_tokens": 8}}).encode()  # fmt: skip
        req = urllib.request.Request(base + "/generate", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        print("answer:", json.dumps(answer)[:400], flush=True)
        return 0 if len(answer.get("output_ids", [])) == 8 else 1
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass  # the server already exited
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
