"""Cost of the backend's metadata builder per step (one plan, shared by all layers).

Builds vLLM's real ``CommonAttentionMetadata`` for decode batches and times
``PrefixAttentionMetadataBuilder.build`` (device-to-host copy of the block table rows and
``seq_lens`` included when ``--device cuda``). Workloads: B requests sharing a P-token prefix
(one level), the same prefix split into 4 levels, and nothing shared.

    python -m tools.vllm.bench_builder --batch 256 --prefix 2048 --tail 128 [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from vllm.config import DeviceConfig, ModelConfig, VllmConfig
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec

from prefixattn.adapters.vllm.backend import PrefixAttentionMetadataBuilder


def batch_tables(kind: str, batch: int, prefix: int, tail: int, block: int) -> torch.Tensor:
    """int32 [batch, pages]: block ids with the sharing ``kind`` describes (block 0 unused)."""
    p_blocks, t_blocks = prefix // block, -(-tail // block)
    next_id = 1
    rows = []
    if kind == "shared":
        shared = list(range(next_id, next_id + p_blocks))
        next_id += p_blocks
        prefixes = [shared] * batch
    elif kind == "multilevel":
        # 4 levels: root shared by all, then 4, 16, 64 groups (each a quarter of the prefix).
        q = p_blocks // 4
        prefixes = []
        level_ids: dict[tuple[int, int], list[int]] = {}
        for b in range(batch):
            row: list[int] = []
            for lvl, groups in enumerate((1, 4, 16, 64)):
                key = (lvl, b * groups // batch)
                if key not in level_ids:
                    level_ids[key] = list(range(next_id, next_id + q))
                    next_id += q
                row += level_ids[key]
            prefixes.append(row)
    else:
        prefixes = []
        for _ in range(batch):
            prefixes.append(list(range(next_id, next_id + p_blocks)))
            next_id += p_blocks
    for pre in prefixes:
        rows.append(pre + list(range(next_id, next_id + t_blocks)))
        next_id += t_blocks
    return torch.tensor(rows, dtype=torch.int32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--tail", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    dev = torch.device(args.device)

    with tempfile.TemporaryDirectory() as d:
        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
            "num_hidden_layers": 32, "vocab_size": 128256, "max_position_embeddings": 16384,
        }  # fmt: skip
        Path(d, "config.json").write_text(json.dumps(cfg))
        mc = ModelConfig(model=d, dtype="bfloat16", skip_tokenizer_init=True)
        vc = VllmConfig(model_config=mc, device_config=DeviceConfig(device=args.device))
        spec = FullAttentionSpec(
            block_size=args.block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
        )
        builder = PrefixAttentionMetadataBuilder(spec, ["l"], vc, dev)

    results = []
    for kind in ("shared", "multilevel", "none"):
        table = batch_tables(kind, args.batch, args.prefix, args.tail, args.block_size)
        b = table.shape[0]
        seq_lens = torch.full((b,), args.prefix + args.tail, dtype=torch.int32)
        qsl = torch.arange(b + 1, dtype=torch.int32)
        width = table.shape[1] + 64  # vLLM's table is as wide as max_model_len allows
        bt = torch.zeros(b, width, dtype=torch.int32)
        bt[:, : table.shape[1]] = table
        cm = CommonAttentionMetadata(
            query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=seq_lens.to(dev),
            num_reqs=b, num_actual_tokens=b, max_query_len=1,
            max_seq_len=args.prefix + args.tail, block_table_tensor=bt.to(dev),
            slot_mapping=torch.zeros(b, dtype=torch.int64, device=dev),
        )  # fmt: skip
        for _ in range(3):
            builder.build(0, cm)
        times = []
        for _ in range(args.iters):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            md = builder.build(0, cm)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e6)
        r = {
            "workload": kind, "batch": b, "prefix": args.prefix, "tail": args.tail,
            "block_size": args.block_size, "device": args.device,
            "build_us_median": round(statistics.median(times), 1),
            "build_us_p90": round(sorted(times)[int(0.9 * len(times))], 1),
            "work_items": md.plan.num_work_items,
        }  # fmt: skip
        results.append(r)
        print(json.dumps(r))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
