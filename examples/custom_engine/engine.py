"""A small paged-KV decoding engine that uses only prefixattn's public engine API.

It is the runnable documentation of ``PrefixAttention``:

- a Llama-style model in plain PyTorch (RMSNorm, rotary embeddings, GQA attention, SwiGLU);
- a block allocator with prefix caching: a full block is identified by its tokens and its
  parent block, so requests with a common prefix get the same block ids (shared KV is
  stored once) and a request whose prefix is cached skips computing it;
- continuous batching: requests arrive at given steps, prefill (the uncached part of their
  prompt) and decode in the same step, and leave when done;
- one ``plan`` per step from the block table, one ``run`` per layer.

``reference_generate`` decodes the same prompts with dense attention and no cache, so the
engine's output can be checked token by token.

    python examples/custom_engine/engine.py [--device cpu] [--requests 12] [--block-size 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Callable
from typing import cast

import torch

import prefixattn


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    hidden: int = 256
    num_layers: int = 3
    num_qo_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    rope_theta: float = 10000.0


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(layer_id, q, k, v) -> o``: attention of one layer's tokens."""

Init = Callable[..., torch.nn.Parameter]
"""``init(*shape)``: a new random weight of that shape."""


class Layer(torch.nn.Module):
    """One decoder layer's weights: attention projections and the SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig, w: Init) -> None:
        super().__init__()
        h, d = cfg.hidden, cfg.head_dim
        self.wq = w(cfg.num_qo_heads * d, h)
        self.wk = w(cfg.num_kv_heads * d, h)
        self.wv = w(cfg.num_kv_heads * d, h)
        self.wo = w(h, cfg.num_qo_heads * d)
        self.w1 = w(cfg.intermediate, h)
        self.w3 = w(cfg.intermediate, h)
        self.w2 = w(h, cfg.intermediate)


class TinyLlama(torch.nn.Module):
    """Random-weight (std 0.02) Llama-style decoder."""

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(*shape, generator=gen) * 0.02)

        self.embed = w(cfg.vocab_size, cfg.hidden)
        self.layers = torch.nn.ModuleList(Layer(cfg, w) for _ in range(cfg.num_layers))
        self.lm_head = w(cfg.vocab_size, cfg.hidden)

    @staticmethod
    def rms_norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        d = self.cfg.head_dim
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, device=x.device).float() / d))
        ang = positions.float()[:, None] * inv[None, :]
        cos, sin = ang.cos()[:, None, :].to(x.dtype), ang.sin()[:, None, :].to(x.dtype)
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """Logits of ``tokens``; ``attend(layer_id, q, k, v) -> o`` supplies attention."""
        cfg = self.cfg
        x = self.embed[tokens]
        for i, layer in enumerate(cast("list[Layer]", self.layers)):
            hx = self.rms_norm(x)
            q = (hx @ layer.wq.T).view(-1, cfg.num_qo_heads, cfg.head_dim)
            k = (hx @ layer.wk.T).view(-1, cfg.num_kv_heads, cfg.head_dim)
            v = (hx @ layer.wv.T).view(-1, cfg.num_kv_heads, cfg.head_dim)
            q, k = self.rope(q, positions), self.rope(k, positions)
            o = attend(i, q, k, v)
            x = x + o.reshape(len(tokens), -1) @ layer.wo.T
            hx = self.rms_norm(x)
            x = x + (torch.nn.functional.silu(hx @ layer.w1.T) * (hx @ layer.w3.T)) @ layer.w2.T
        return self.rms_norm(x) @ self.lm_head.T


class BlockAllocator:
    """Fixed-size KV blocks with prefix caching by (parent block, tokens) identity."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks
        self.cached: dict[tuple, int] = {}  # (parent block, tokens) -> full block
        self.key_of: dict[int, tuple] = {}

    def take(self) -> int:
        if not self.free:
            raise RuntimeError("out of KV blocks")
        b = self.free.pop()
        self.refs[b] = 1
        return b

    def lookup(self, parent: int, tokens: tuple[int, ...]) -> int | None:
        b = self.cached.get((parent, tokens))
        if b is not None:
            self.refs[b] += 1
        return b

    def seal(self, block: int, parent: int, tokens: tuple[int, ...]) -> int:
        """Register a block that just became full; returns the canonical block for it."""
        key = (parent, tokens)
        other = self.cached.get(key)
        if other is not None and other != block:
            # Same content computed twice in one step: keep the cached one.
            self.release(block)
            self.refs[other] += 1
            return other
        self.cached[key] = block
        self.key_of[block] = key
        return block

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            key = self.key_of.pop(block, None)
            if key is not None:
                del self.cached[key]
            self.free.append(block)


@dataclasses.dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)  # prompt + generated
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    output: list[int] = dataclasses.field(default_factory=list)


class Engine:
    """Continuous batching over a paged KV cache, attention through prefixattn."""

    def __init__(self, model: TinyLlama, num_blocks: int = 256, block_size: int = 16,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, max_batch: int = 64) -> None:  # fmt: skip
        cfg = model.cfg
        self.model = model.to(device=device, dtype=dtype)
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_batch = max_batch
        self.alloc = BlockAllocator(num_blocks, block_size)
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = [
            torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)
        ]
        self.v_cache = [
            torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)
        ]
        self.attn = prefixattn.PrefixAttention(
            cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, block_size,
            kv_layout="NHD", device=device, dtype=dtype,
        )  # fmt: skip
        self.step_times: list[float] = []
        self.kv_bytes = 0  # KV bytes read per layer, summed over steps
        self.query_centric_kv_bytes = 0  # the same for a kernel reading each request's KV

    def _admit(self, req: Request) -> None:
        """Reuse cached full blocks of the prompt's prefix (never the whole prompt: the last
        prompt token must be computed to produce the first output)."""
        req.tokens = list(req.prompt)
        bs = self.block_size
        parent = -1
        for start in range(0, len(req.prompt) - 1 - (len(req.prompt) - 1) % bs, bs):
            b = self.alloc.lookup(parent, tuple(req.prompt[start : start + bs]))
            if b is None:
                break
            req.blocks.append(b)
            parent = b
        req.num_computed = len(req.blocks) * bs

    def step(self, running: list[Request]) -> None:
        """One forward step: every running request computes its uncomputed tokens."""
        bs = self.block_size
        new_tokens, positions, slots = [], [], []
        qo_indptr, seq_lens = [0], []
        for req in running:
            todo = req.tokens[req.num_computed :]
            for i, tok in enumerate(todo):
                pos = req.num_computed + i
                if pos // bs >= len(req.blocks):
                    req.blocks.append(self.alloc.take())
                new_tokens.append(tok)
                positions.append(pos)
                slots.append(req.blocks[pos // bs] * bs + pos % bs)
            qo_indptr.append(qo_indptr[-1] + len(todo))
            seq_lens.append(len(req.tokens))
        width = max(len(r.blocks) for r in running)
        table = torch.zeros(len(running), width, dtype=torch.int32)
        for i, req in enumerate(running):
            table[i, : len(req.blocks)] = torch.tensor(req.blocks, dtype=torch.int32)

        t0 = time.perf_counter()
        # Once per step: the plan (host work), shared by every layer.
        plan = self.attn.plan(table, torch.tensor(seq_lens, dtype=torch.int32),
                              torch.tensor(qo_indptr, dtype=torch.int32))  # fmt: skip
        self.kv_bytes += plan.kv_bytes
        self.query_centric_kv_bytes += plan.query_centric_kv_bytes
        dev = self.device
        slot_t = torch.tensor(slots, device=dev, dtype=torch.long)
        num_slots = self.k_cache[0].shape[0] * bs

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc = self.k_cache[layer].view(num_slots, *k.shape[1:])
            vc = self.v_cache[layer].view(num_slots, *v.shape[1:])
            kc.index_copy_(0, slot_t, k)
            vc.index_copy_(0, slot_t, v)
            return self.attn.run(q.contiguous(), self.k_cache[layer], self.v_cache[layer])

        with torch.no_grad():
            logits = self.model(torch.tensor(new_tokens, device=dev),
                                torch.tensor(positions, device=dev), attend)  # fmt: skip
        if dev.type == "cuda":
            torch.cuda.synchronize()
        self.step_times.append(time.perf_counter() - t0)

        last = torch.tensor(qo_indptr[1:], device=dev) - 1
        next_tokens = logits[last].argmax(-1).tolist()
        for req, tok in zip(running, next_tokens, strict=True):
            # Seal blocks that became full so later requests can share them.
            full = len(req.tokens) // bs
            parent = -1
            for j in range(full):
                block = req.blocks[j]
                canon = self.alloc.seal(block, parent, tuple(req.tokens[j * bs : (j + 1) * bs]))
                if canon != block:
                    req.blocks[j] = canon
                parent = req.blocks[j]
            req.num_computed = len(req.tokens)
            req.output.append(tok)
            req.tokens.append(tok)

    def generate(self, requests: list[Request]) -> dict[int, list[int]]:
        """Run until every request is done; requests join at their ``arrival_step``."""
        waiting = sorted(requests, key=lambda r: r.arrival_step)
        running: list[Request] = []
        done: dict[int, list[int]] = {}
        step = 0
        while waiting or running:
            while waiting and waiting[0].arrival_step <= step and len(running) < self.max_batch:
                req = waiting.pop(0)
                self._admit(req)
                running.append(req)
            if running:
                self.step(running)
            for req in [r for r in running if len(r.output) >= r.max_new_tokens]:
                running.remove(req)
                done[req.rid] = req.output
                for b in req.blocks:
                    self.alloc.release(b)
            step += 1
        return done


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """Causal GQA attention over a whole sequence, in float64."""
    n, hq, _ = q.shape
    hkv = k.shape[1]
    qf = q.double().view(n, hkv, hq // hkv, head_dim)
    s = torch.einsum("thgd,khd->thgk", qf, k.double()) / math.sqrt(head_dim)
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    s = s.masked_fill(mask[:, None, None, :], -math.inf)
    o = torch.einsum("thgk,khd->thgd", s.softmax(-1), v.double())
    return o.reshape(n, hq, head_dim).to(q.dtype)


def reference_generate(model: TinyLlama, requests: list[Request]) -> dict[int, list[int]]:
    """Greedy decoding with dense causal attention over the whole sequence, no cache."""
    d = model.cfg.head_dim
    dev = next(model.parameters()).device
    out = {}
    for req in requests:
        tokens = list(req.prompt)
        for _ in range(req.max_new_tokens):
            positions = torch.arange(len(tokens), device=dev)
            with torch.no_grad():
                logits = model(
                    torch.tensor(tokens, device=dev),
                    positions,
                    lambda _layer, q, k, v: dense_causal_attention(q, k, v, d),
                )
            tokens.append(int(logits[-1].argmax()))
        out[req.rid] = tokens[len(req.prompt) :]
    return out


def shared_prefix_requests(
    num_requests: int = 12, seed: int = 0, vocab: int = 512
) -> list[Request]:
    """Two system prompts (a forest), per-topic documents (a second level), short questions,
    parallel samples of one prompt, and late arrivals."""
    gen = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    systems = [rand(100), rand(67)]
    docs = [rand(40), rand(17), rand(9)]
    reqs = []
    for i in range(num_requests):
        prompt = systems[i % 2] + docs[i % 3] + rand(3 + i % 5)
        reqs.append(
            Request(rid=i, prompt=prompt, max_new_tokens=4 + i % 4, arrival_step=(i % 4) * 2)
        )
    sample = systems[0] + docs[0] + rand(4)
    for j in range(3):  # parallel sampling: identical prompts
        reqs.append(
            Request(rid=num_requests + j, prompt=list(sample), max_new_tokens=5, arrival_step=1)
        )
    return reqs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the custom engine and check it.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = TinyLlama(ModelConfig())
    reqs = shared_prefix_requests(args.requests)
    num_blocks = 8192 // args.block_size + 64  # room for every request's tokens
    engine = Engine(
        model, num_blocks=num_blocks, block_size=args.block_size, device=args.device, dtype=dtype
    )
    got = engine.generate([dataclasses.replace(r) for r in reqs])
    ref = reference_generate(TinyLlama(ModelConfig()).to(args.device, torch.float64), reqs)
    same = sum(got[r.rid] == ref[r.rid] for r in reqs)
    print(
        f"KV bytes read: {engine.kv_bytes / 1e6:.2f} MB per layer over the run, "
        f"{engine.query_centric_kv_bytes / max(engine.kv_bytes, 1):.2f}x less than query-centric"
    )
    print(f"{same}/{len(reqs)} requests match dense attention token for token; "
          f"{len(engine.step_times)} steps, median step {1e3 * sorted(engine.step_times)[len(engine.step_times) // 2]:.2f} ms")  # fmt: skip
    return 0 if same == len(reqs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
