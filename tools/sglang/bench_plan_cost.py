"""Cost of the backend's per-step metadata (gather rows + forest + packing) at SGLang scale.

Runs on CPU or GPU with SGLang's real ReqToTokenPool: batch B decode requests whose
``req_to_token`` rows (page size 1) share a P-token prefix and have T private tokens, the
layout the radix cache produces. Times ``PrefixAttnBackend.init_forward_metadata`` (what
SGLang calls once per step) and, separately, the core's ``plan`` on host arrays.

    python -m tools.sglang.bench_plan_cost --device cpu --batch 256 --prefix 4096 --tail 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.runtime_context import get_parallel

from prefixattn.adapters.sglang.backend import PrefixAttnBackend


class _Config:
    head_dim = 128

    def get_num_attention_heads(self, tp):
        return 32 // tp

    def get_num_kv_heads(self, tp):
        return 8 // tp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prefix", type=int, nargs="+", default=[4096])
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    single_rank = get_parallel().override(attn_tp_size=1)  # no distributed init here
    single_rank.__enter__()
    dev = args.device
    for prefix in args.prefix:
        b, t = args.batch, args.tail
        ctx = prefix + t + 1
        pool = ReqToTokenPool(size=b, max_context_len=ctx, device=dev, enable_memory_saver=False)
        shared = np.arange(1, prefix + 1)
        rows = np.zeros((b, ctx), dtype=np.int32)
        for i in range(b):
            rows[i, :prefix] = shared
            rows[i, prefix : prefix + t] = prefix + 1 + i * t + np.arange(t)
        pool.req_to_token[1 : b + 1] = torch.from_numpy(rows).to(dev)
        runner = SimpleNamespace(
            device=dev, page_size=1, kv_cache_dtype=torch.bfloat16, model_config=_Config(),
            req_to_token_pool=pool, token_to_kv_pool=None, use_mla_backend=False,
        )  # fmt: skip
        backend = PrefixAttnBackend(runner)
        seq = torch.full((b,), prefix + t, dtype=torch.int32)
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=b,
            input_ids=torch.zeros(b, dtype=torch.int64, device=dev),
            req_pool_indices=torch.arange(1, b + 1, device=dev),
            seq_lens=seq.to(dev), seq_lens_cpu=seq, out_cache_loc=None,
            seq_lens_sum=int(seq.sum()), positions=None,
        )  # fmt: skip
        times, plan_only = [], []
        host_table = rows[:, : prefix + t]
        for _ in range(args.repeat):
            if dev != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            backend.init_forward_metadata(fb)
            t1 = time.perf_counter()
            backend.core.plan(host_table, seq.numpy())
            t2 = time.perf_counter()
            times.append(t1 - t0)
            plan_only.append(t2 - t1)
        assert backend.forward_metadata is not None
        plan = backend.forward_metadata.plan
        print(
            f"B={b} prefix={prefix} tail={t} page_size=1 device={dev}: "
            f"init_forward_metadata median {statistics.median(times) * 1e3:.2f} ms, "
            f"core plan() on host arrays median {statistics.median(plan_only) * 1e3:.2f} ms; "
            f"work items {plan.num_work_items}, KV bytes/layer {plan.kv_bytes / 1e6:.1f} MB "
            f"vs query-centric {plan.query_centric_kv_bytes / 1e6:.1f} MB"
        )


if __name__ == "__main__":
    main()
