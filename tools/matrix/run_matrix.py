"""Cross-framework integration matrix: one command that runs a set of cells and writes a
Markdown table and a JSON report (default ``prefixattn-results/matrix.{md,json}`` in the
current directory).

A cell is one value of each axis (``AXES``): engine (vLLM, SGLang, the custom engine example),
head config (query/KV heads) and head_dim, workload, CUDA graphs on/off, tensor parallel size,
and mode: ``plain``; ``spec``, speculative decoding (vLLM's ``ngram`` proposer, both backends;
each prompt ends with an earlier 8-gram so drafting starts at once, and prefixattn's engine must
have drafted tokens); ``decode-only``, prefixattn as SGLang's decode backend beside the
reference backend for prefill (``--decode-attention-backend``); ``delegate``, prefixattn with
the steps it gives to the engine's own kernel switched on (``StepOptions.delegate_unshared``,
``delegate_prefills``: vLLM, SGLang).
Every cell runs the same engine twice, each run in its own subprocess (own process group,
killed on timeout): once with the engine's default attention backend (vLLM: ``FLASH_ATTN``;
SGLang: ``triton`` or ``flashinfer``, ``--sglang-reference``; custom engine: dense attention
over the same paged cache) and once with prefixattn. The model is a small Llama with random
weights (std 0.02) whose heads, KV heads and head_dim come from the cell.

Per cell:

- correctness: greedy tokens and top-5 logprobs of every request compared with the rule of
  ``tools/vllm/check_engine.py`` (imported: ``compare`` and ``TOL``); for vLLM with
  graphs on, CUSTOM must also have been captured in full decode graphs (``full_decode_graphs``
  of the same script); for SGLang, SGLang's per-step report must show every decode step as a
  graph with graphs on and none with graphs off (``decode_steps`` of
  ``tools/sglang/engine_check.py``);
- decode step time of both backends, ``(t(N2) - t(N1)) / (N2 - N1)`` over generations of the
  cell's prompts (vLLM, SGLang; the prompts are in the prefix cache by then) or the median
  decode-only step (custom engine).

A cell that cannot run says why (``status: skip``): the engine does not support the head
config or mode, no GPU, fewer GPUs than its tensor parallel size, the engine's package does not
import, or ``--budget`` is spent.

    python -m tools.matrix.run_matrix --select smoke [--engines vllm custom]
        [--cells SUBSTR ...] [--budget S] [--dry-run] [--out-md PATH] [--out-json PATH]

Selections: ``smoke`` (every value of every axis in at least one cell), ``serving`` (the
serving benchmark's workloads, ``SERVING_WORKLOADS``, in both engines with graphs on and off),
``delegate`` (``delegate`` mode where its paths occur) and ``full`` (the product of the axes).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

from tools import RESULTS
from tools.proc_group import run_in_group
from tools.prompt_trees import two_level_tree

ROOT = Path(__file__).resolve().parents[2]
# The example is a standalone script (examples/ is not a package): loaded from its file.
CUSTOM_ENGINE = ROOT / "examples" / "custom_engine" / "engine.py"

AXES: dict[str, tuple[Any, ...]] = {
    "engine": ("vllm", "sglang", "custom"),
    "heads": ("32/32", "32/8", "64/8", "28/4"),
    "head_dim": (128, 64),
    "workload": (
        "none",
        "shared1",
        "multilevel",
        "forest",
        "parallel",
        "mixed",
        "arrivals",
        "multiturn",
        "longprompt",
        "lowload",
    ),
    "graphs": ("on", "off"),
    "tp": (1, 2),
    "mode": ("plain", "spec", "decode-only", "delegate"),
}
MODES = {
    "plain": "prefixattn for every batch",
    "spec": "speculative decoding, ngram proposer with 3 draft tokens (vLLM)",
    "decode-only": "prefixattn for decode batches, the reference backend for prefill (SGLang)",
    "delegate": "steps without sharing and new prefill chunks on the engine's own kernel "
    "(StepOptions delegate_unshared, delegate_prefills)",
}
DELEGATE = {"delegate_unshared": True, "delegate_prefills": True}
"""prefixattn's StepOptions in ``delegate`` cells."""
DEFAULT_BACKEND = {"vllm": "FLASH_ATTN", "sglang": "triton", "custom": "dense"}
OUR_BACKEND = {"vllm": "CUSTOM", "sglang": "prefixattn", "custom": "prefixattn"}
PACKAGE = {"vllm": "vllm", "sglang": "sglang", "custom": "prefixattn"}

WORKLOADS = {
    "none": "16 prompts of 40-300 tokens, nothing shared",
    "shared1": "one 1024-token prefix shared by 16 requests, private tails of 1-64 tokens",
    "multilevel": "2 roots of 700 tokens, 3 children of 300 each, 4 leaves of 1-90 each, "
    "plus one unrelated prompt",
    "forest": "4 unrelated 400-token prefixes, 4 requests under each (16 requests)",
    "parallel": "parallel sampling: 4 prompts (a shared 500-token system prompt + 50 private "
    "tokens), each submitted n=4 times",
    "mixed": "chunked prefill (256-token chunks): 8 short prompts decoding 32 tokens while 8 "
    "prompts of 1500 tokens prefill in chunks (mixed prefill+decode steps)",
    "arrivals": "24 requests of 4-28 new tokens, at most 8 running: requests join as others "
    "leave (custom engine: staggered arrival steps)",
    "multiturn": "4 conversations under a 300-token system prompt, 3 turns each, each turn's "
    "prompt the previous one plus an answer and a new message (turns 1-2 cached first), all "
    "turns at once",
    "longprompt": "private prompts of 2500-3000 tokens, 8 new tokens each",
    "lowload": "4 under a 600-token prefix and 2 private, one running at a time: decode "
    "batches of one",
}
# Engine settings a workload needs: ``max_seqs`` (running requests), ``chunk`` (prefill chunk).
WORKLOAD_KNOBS: dict[str, dict[str, int]] = {
    "mixed": {"chunk": 256},
    "arrivals": {"max_seqs": 8},
    "lowload": {"max_seqs": 1},
}
# The serving benchmark's workloads (tools/serving/workloads.py) and the matrix workload with
# the same structure, at the matrix's small scale: ``--select serving`` checks each in both
# engines, CUDA graphs on and off.
SERVING_WORKLOADS = {
    "forest": "forest",
    "multiturn": "multiturn",
    "parallel": "parallel",
    "longprompt": "longprompt",
    "chat": "none",
    "decode": "shared1",
    "lowload": "lowload",
}

VOCAB = 8192
MODEL_SHAPE = {"hidden": 1024, "intermediate": 2816, "layers": 4}
N1, N2 = 4, 20  # decode step time: generations of N1 and N2 tokens
# Rough seconds one cell needs (both backends), used for --budget and the default timeout.
ESTIMATE_S = {("vllm", "on"): 200, ("vllm", "off"): 120, ("sglang", "on"): 150,
              ("sglang", "off"): 110, ("custom", "on"): 60, ("custom", "off"): 60}  # fmt: skip
TP_EXTRA_S = 150  # vLLM 0.33 engines with tensor parallel 2 took over 146 s to start (H100)


def hidden_size(num_qo_heads: int) -> int:
    """The smallest multiple of both the head count and 64 that is at least 1024: transformers
    needs the hidden size divisible by the head count (28 heads: 1344)."""
    step = math.lcm(num_qo_heads, 64)
    return -(-MODEL_SHAPE["hidden"] // step) * step


@dataclasses.dataclass(frozen=True)
class Cell:
    engine: str
    heads: str  # "query/kv"
    head_dim: int
    workload: str
    graphs: str  # "on" | "off"
    tp: int
    mode: str = "plain"

    @property
    def id(self) -> str:
        h = self.heads.replace("/", "x")
        mode = "" if self.mode == "plain" else f"-{self.mode}"
        return (f"{self.engine}-h{h}-d{self.head_dim}-{self.workload}-g{self.graphs}"
                f"-tp{self.tp}{mode}")  # fmt: skip

    @property
    def num_qo_heads(self) -> int:
        return int(self.heads.split("/")[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.heads.split("/")[1])

    def estimate_s(self) -> int:
        return ESTIMATE_S[(self.engine, self.graphs)] + (TP_EXTRA_S if self.tp > 1 else 0)


def _c(engine: str, heads: str, d: int, workload: str, graphs: str, tp: int = 1,
       mode: str = "plain") -> Cell:  # fmt: skip
    return Cell(engine, heads, d, workload, graphs, tp, mode)


# A small covering set: every value of every axis appears in at least one cell that the
# engine supports (the custom engine has no CUDA graphs and runs on one GPU).
SMOKE: tuple[Cell, ...] = (
    _c("vllm", "32/8", 128, "shared1", "on"),
    _c("vllm", "32/32", 64, "none", "off"),
    _c("vllm", "64/8", 128, "multilevel", "on"),
    _c("vllm", "28/4", 128, "forest", "on"),
    _c("vllm", "32/8", 128, "parallel", "on"),
    _c("vllm", "32/8", 64, "mixed", "on"),
    _c("vllm", "32/8", 128, "arrivals", "off"),
    _c("vllm", "32/8", 128, "multilevel", "on", tp=2),
    _c("vllm", "28/4", 64, "multilevel", "on", mode="spec"),
    _c("vllm", "32/8", 128, "forest", "on", mode="delegate"),
    _c("sglang", "32/8", 128, "shared1", "on"),
    _c("sglang", "28/4", 64, "multilevel", "off"),
    _c("sglang", "64/8", 128, "forest", "on"),
    _c("sglang", "32/32", 128, "mixed", "on"),
    _c("sglang", "32/8", 128, "arrivals", "on", tp=2),
    _c("sglang", "64/8", 64, "parallel", "on", mode="decode-only"),
    _c("custom", "32/8", 128, "multilevel", "off"),
    _c("custom", "28/4", 64, "parallel", "off"),
    _c("custom", "64/8", 64, "arrivals", "off"),
    _c("custom", "32/32", 128, "mixed", "off"),
    _c("custom", "32/8", 128, "multiturn", "off"),
    _c("custom", "28/4", 64, "longprompt", "off"),
    _c("custom", "64/8", 64, "lowload", "off"),
)


def full() -> list[Cell]:
    return [Cell(*v) for v in itertools.product(*AXES.values())]


def serving() -> list[Cell]:
    """Every serving-benchmark workload's matrix twin in vLLM and SGLang, graphs on and off,
    at the 8B model's head configuration (32/8, head_dim 128), tensor parallel 1."""
    return [
        Cell(engine, "32/8", 128, workload, graphs, 1)
        for engine in ("vllm", "sglang")
        for workload in dict.fromkeys(SERVING_WORKLOADS.values())
        for graphs in ("on", "off")
    ]


def delegate() -> list[Cell]:
    """The steps prefixattn gives to the engine's own kernel (``delegate`` mode), where they
    occur: requests joining as others leave (prefill chunks beside planned decodes, eager
    steps with and without sharing, SGLang's extend batches), one request at a time under
    graphs (vLLM's single-request graphs), chat without sharing and long private prompts;
    graphs on and off. The cells most paths go through come first."""
    cells = [("vllm", w, "on") for w in ("arrivals", "lowload")]
    cells += [("vllm", "none", "off"), ("vllm", "longprompt", "on"), ("sglang", "arrivals", "off")]
    cells += [("sglang", w, "on") for w in ("none", "longprompt")]
    return [Cell(e, "32/8", 128, w, g, 1, "delegate") for e, w, g in cells]


SELECTIONS = {
    "smoke": lambda: list(SMOKE),
    "full": full,
    "serving": serving,
    "delegate": delegate,
}


def select(
    name: str, engines: list[str] | None = None, cells: list[str] | None = None
) -> list[Cell]:
    """The named selection, kept to ``engines`` and to ids containing any of ``cells``."""
    out = SELECTIONS[name]()
    if engines:
        out = [c for c in out if c.engine in engines]
    if cells:
        out = [c for c in out if any(s in c.id for s in cells)]
    return out


# --- what a cell can run on ------------------------------------------------------------------


def supported_head_dims() -> tuple[int, ...]:
    try:
        from prefixattn.plan.tiles import SUPPORTED_HEAD_DIMS

        return tuple(SUPPORTED_HEAD_DIMS)
    except Exception:  # the package is not importable here: the dims the kernels build for
        return (64, 128, 256)


def unsupported(cell: Cell) -> str | None:
    """Why the engine (or prefixattn) cannot run this cell at all, else None."""
    hq, hkv = cell.num_qo_heads, cell.num_kv_heads
    if cell.engine == "custom" and cell.graphs == "on":
        return "the custom engine example has no CUDA graph mode"
    if cell.engine == "custom" and cell.tp > 1:
        return "the custom engine example runs on one GPU (no tensor parallelism)"
    if cell.mode == "spec" and cell.engine != "vllm":
        return "speculative decoding cells run on vLLM (its ngram proposer)"
    if cell.mode == "decode-only" and cell.engine != "sglang":
        return "a separate decode backend is SGLang's (--decode-attention-backend)"
    if cell.mode == "delegate" and cell.engine == "custom":
        return "the custom engine example has no attention kernel of its own to delegate to"
    if hq % hkv:
        return f"{hq} query heads are not a multiple of {hkv} KV heads"
    if hq // hkv > 16:
        return f"prefixattn supports GQA groups of at most 16 (this is {hq // hkv})"
    if cell.head_dim not in supported_head_dims():
        return f"prefixattn does not support head_dim {cell.head_dim}"
    if hkv % cell.tp or hq % cell.tp:
        return f"heads {cell.heads} do not split over tensor parallel size {cell.tp}"
    return None


def probe_gpus() -> int:
    """CUDA devices torch sees (0 without torch or CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


_PACKAGES: dict[str, str | None] = {}


def probe_package(name: str) -> str | None:
    """None if ``import name`` works in a fresh interpreter, else why not."""
    if name not in _PACKAGES:
        try:
            p = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True,
                               text=True, timeout=300)  # fmt: skip
            last = (p.stderr.strip().splitlines() or ["?"])[-1]
            _PACKAGES[name] = None if p.returncode == 0 else f"{name} not importable: {last}"
        except subprocess.TimeoutExpired:
            _PACKAGES[name] = f"import {name} took over 300 s"
    return _PACKAGES[name]


def skip_reason(cell: Cell, gpus: int) -> str | None:
    """Why this cell cannot run on this machine, else None. Probes are module functions so
    tests can replace them."""
    why = unsupported(cell)
    if why:
        return why
    if gpus == 0:
        return "no GPU (torch.cuda.device_count() == 0)"
    if cell.tp > gpus:
        return f"needs {cell.tp} GPUs, torch.cuda.device_count() == {gpus}"
    return probe_package(PACKAGE[cell.engine])


# --- prompts ---------------------------------------------------------------------------------


def make_requests(workload: str, seed: int = 0, echo: bool = False) -> dict[str, Any]:
    """Engine-neutral requests of a workload: ``warm`` (prefixes put in the prefix cache
    first by vLLM and SGLang), ``prompts``, ``max_new`` and ``arrival`` (custom engine's
    arrival step) per prompt, ``knobs`` (engine settings). With ``echo`` every prompt ends with
    a copy of 8 of its earlier tokens, so an n-gram proposer drafts from the first step."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(10, VOCAB) for _ in range(n)]

    warm: list[list[int]] = []
    prompts: list[list[int]] = []
    max_new: list[int] = []
    arrival: list[int] = []
    if workload == "none":
        prompts = [toks(rng.randint(40, 300)) for _ in range(16)]
    elif workload == "shared1":
        root = toks(1024)
        warm = [root]
        prompts = [root + toks(rng.randint(1, 64)) for _ in range(16)]
    elif workload == "multilevel":
        warm, prompts = two_level_tree(rng, VOCAB)
        prompts.append(toks(33))
    elif workload == "forest":
        for _ in range(4):
            root = toks(400)
            warm.append(root)
            prompts += [root + toks(rng.randint(1, 64)) for _ in range(4)]
    elif workload == "parallel":
        system = toks(500)
        warm = [system]
        for _ in range(4):
            p = system + toks(50)
            prompts += [list(p) for _ in range(4)]
    elif workload == "mixed":
        prompts = [toks(rng.randint(20, 100)) for _ in range(8)]
        prompts += [toks(1500) for _ in range(8)]
        max_new = [32] * 8 + [8] * 8
        arrival = [0] * 8 + [3 + i for i in range(8)]
    elif workload == "arrivals":
        shared = toks(600)
        warm = [shared]
        for i in range(24):
            prompts.append((shared if i % 2 else []) + toks(rng.randint(20, 200)))
        max_new = [4 + (7 * i) % 25 for i in range(24)]
        arrival = [2 * i for i in range(24)]
    elif workload == "multiturn":
        system = toks(300)
        for _ in range(4):
            turn = system + toks(rng.randint(200, 400))
            turns = [turn]
            for _ in range(2):
                turn = turn + toks(rng.randint(30, 60)) + toks(rng.randint(40, 100))
                turns.append(turn)
            warm += turns[:2]
            prompts += turns
    elif workload == "longprompt":
        prompts = [toks(rng.randint(2500, 3000)) for _ in range(4)]
        max_new = [8] * 4
    elif workload == "lowload":
        shared = toks(600)
        warm = [shared]
        prompts = [shared + toks(rng.randint(10, 80)) for _ in range(4)]
        prompts += [toks(rng.randint(50, 150)) for _ in range(2)]
        max_new = [12] * 6
        arrival = list(range(6))
    else:
        raise ValueError(f"unknown workload {workload!r}")
    if echo:
        prompts = [check_engine().with_echo(rng, p) for p in prompts]
    if not max_new:
        max_new = [8 + 8 * (i % 3) for i in range(len(prompts))]
    if not arrival:
        arrival = [0] * len(prompts)
    knobs = dict(WORKLOAD_KNOBS.get(workload, {}))
    return {"warm": warm, "prompts": prompts, "max_new": max_new, "arrival": arrival,
            "knobs": knobs}  # fmt: skip


def describe(cell: Cell) -> str:
    """What a cell would run (``--dry-run``)."""
    req = make_requests(cell.workload, echo=cell.mode == "spec")
    knobs = ", ".join(f"{k}={v}" for k, v in req["knobs"].items()) or "engine defaults"
    model = (f"Llama {MODEL_SHAPE['layers']} layers, hidden {hidden_size(cell.num_qo_heads)}, "
             f"{cell.num_qo_heads}/{cell.num_kv_heads} heads, head_dim {cell.head_dim}")  # fmt: skip
    return (
        f"{cell.engine}: {our_backend(cell)} vs {default_backend(cell)}; {model}; "
        f"{len(req['prompts'])} requests ({WORKLOADS[cell.workload]}); {knobs}; "
        f"CUDA graphs {cell.graphs}; tensor parallel {cell.tp}; {MODES[cell.mode]}"
    )


_SGLANG_REFERENCE = ["triton"]


def default_backend(cell: Cell) -> str:
    return _SGLANG_REFERENCE[0] if cell.engine == "sglang" else DEFAULT_BACKEND[cell.engine]


def our_backend(cell: Cell) -> str:
    """prefixattn's label in the cell's engine; in a ``decode-only`` cell SGLang's hybrid
    backend (``engine_check.backend_args`` reads the label)."""
    if cell.mode == "decode-only":
        return default_backend(cell) + "-prefill-prefixattn-decode"
    return OUR_BACKEND[cell.engine]


# --- engine runs (each in its own subprocess) -----------------------------------------------


# Imported when first needed, so that a dry run needs neither; tests replace these functions.


def check_engine() -> ModuleType:
    return importlib.import_module("tools.vllm.check_engine")


def sglang_check() -> ModuleType:
    return importlib.import_module("tools.sglang.engine_check")


def custom_engine() -> ModuleType:
    """The custom engine example (``examples/custom_engine/engine.py``), imported once as
    module ``custom_engine``."""
    name = "custom_engine"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, CUSTOM_ENGINE)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod


def model_config(cell: Cell) -> dict[str, Any]:
    """``LlamaConfig`` arguments of the cell's model."""
    return dict(
        hidden_size=hidden_size(cell.num_qo_heads), intermediate_size=MODEL_SHAPE["intermediate"],
        num_hidden_layers=MODEL_SHAPE["layers"], num_attention_heads=cell.num_qo_heads,
        num_key_value_heads=cell.num_kv_heads, head_dim=cell.head_dim, vocab_size=VOCAB,
        max_position_embeddings=8192, initializer_range=0.02, torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )  # fmt: skip


def ensure_model(cell: Cell, models: Path) -> str:
    """A random-weight (std 0.02) bf16 Llama with the cell's heads, saved once per config."""
    path = models / f"llama-{cell.num_qo_heads}x{cell.num_kv_heads}-d{cell.head_dim}"
    if (path / "config.json").exists():
        return str(path)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**model_config(cell))
    tmp = Path(tempfile.mkdtemp(dir=models))
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp)
    tmp.rename(path)
    return str(path)


def run_vllm(cell: Cell, backend: str, model: str, req: dict) -> dict:
    ce = check_engine()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function
    # vLLM's FlashInfer sampler compiles its kernels on a machine's first use (minutes),
    # which no cell's timeout allows; the sampler is the same for both backends.
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm import LLM, SamplingParams, TokensPrompt

    max_seqs = req["knobs"].get("max_seqs", 64)
    kwargs: dict[str, Any] = dict(
        model=model, skip_tokenizer_init=True, attention_backend=backend,
        enforce_eager=cell.graphs == "off", tensor_parallel_size=cell.tp,
        gpu_memory_utilization=0.5, max_model_len=4096, max_num_seqs=max_seqs,
        enable_prefix_caching=True, seed=0,
    )  # fmt: skip
    compilation: dict[str, Any] = {}
    if cell.tp > 1:
        # Plain NCCL all-reduce only. With tensor parallelism vLLM otherwise fuses the
        # all-reduce with RMSNorm through FlashInfer's "mnnvl" workspace, which needs NVLink
        # multicast: on a 2-GPU machine without it both backends faulted (illegal memory
        # access, then CUBLAS_STATUS_INTERNAL_ERROR) before serving.
        os.environ["VLLM_ALLREDUCE_USE_SYMM_MEM"] = "0"
        os.environ["VLLM_ALLREDUCE_USE_FLASHINFER"] = "0"
        kwargs["disable_custom_all_reduce"] = True
        compilation["pass_config"] = {"fuse_allreduce_rms": False}
    if cell.graphs == "on" and cell.mode != "spec":
        # Token counts of the captured graphs; with speculative decoding vLLM's defaults,
        # which it fits to its uniform batches of 1 + num_speculative_tokens per request.
        sizes = [s for s in (1, 2, 4, 8, 16, 24, 32, 64) if s <= max_seqs]
        compilation["cudagraph_capture_sizes"] = sizes
    if compilation:
        kwargs["compilation_config"] = compilation
    if "chunk" in req["knobs"]:
        kwargs.update(enable_chunked_prefill=True, max_num_batched_tokens=req["knobs"]["chunk"])
    if cell.mode == "spec":
        kwargs.update(speculative_config=dict(ce.SPEC), disable_log_stats=False)
    if cell.mode == "delegate" and backend == our_backend(cell):
        kwargs["additional_config"] = {"prefixattn": dict(DELEGATE)}
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = round(time.perf_counter() - t0, 1)
    sp: dict[str, Any] = dict(temperature=0, ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
    if req["warm"]:
        warm = [TokensPrompt(prompt_token_ids=p) for p in req["warm"]]
        llm.generate(warm, SamplingParams(max_tokens=1, **sp), use_tqdm=False)
    sps = [SamplingParams(max_tokens=n, logprobs=5, **sp) for n in req["max_new"]]
    outputs = ce.greedy_outputs(llm.generate(prompts, sps, use_tqdm=False))
    info = llm.collective_rpc(ce.worker_info)[0]
    if cell.mode == "spec":
        info["spec_decode"] = ce.spec_counts(llm)

    def timed(n: int) -> float:
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, **sp), use_tqdm=False)
        return time.perf_counter() - t

    timed(1)
    t1, t2 = min(timed(N1) for _ in range(2)), min(timed(N2) for _ in range(2))
    step_ms = round((t2 - t1) / (N2 - N1) * 1e3, 3)
    return {"outputs": outputs, "info": info, "start_s": start_s, "step_ms": step_ms}


def run_sglang(cell: Cell, backend: str, model: str, req: dict) -> dict:
    import sglang as sgl

    kwargs: dict[str, Any] = dict(
        model_path=model, skip_tokenizer_init=True, **sglang_check().backend_args(backend),
        disable_cuda_graph=cell.graphs == "off", cuda_graph_max_bs_decode=32,
        mem_fraction_static=0.5, context_length=4096,
        max_running_requests=req["knobs"].get("max_seqs", 64), random_seed=0, log_level="info",
        decode_log_interval=1, tp_size=cell.tp, disable_custom_all_reduce=cell.tp > 1,
    )  # fmt: skip
    if "chunk" in req["knobs"]:
        kwargs.update(chunked_prefill_size=req["knobs"]["chunk"], enable_mixed_chunk=True)
    if cell.mode == "delegate" and backend == our_backend(cell):
        # SGLang's scheduler processes take the options from a plugin they all load.
        from tools.sglang.core_options import plugin_env

        os.environ.update(plugin_env(Path(tempfile.mkdtemp(prefix="delegate-")), DELEGATE))
    t0 = time.perf_counter()
    llm = sgl.Engine(**kwargs)
    start_s = round(time.perf_counter() - t0, 1)
    sp = {"temperature": 0, "ignore_eos": True}
    try:
        if req["warm"]:
            llm.generate(input_ids=req["warm"], sampling_params={**sp, "max_new_tokens": 1})
        outs = llm.generate(
            input_ids=req["prompts"],
            sampling_params=[{**sp, "max_new_tokens": n} for n in req["max_new"]],
            return_logprob=True,
            top_logprobs_num=5,
        )

        def timed(n: int) -> float:
            t = time.perf_counter()
            llm.generate(input_ids=req["prompts"], sampling_params={**sp, "max_new_tokens": n})
            return time.perf_counter() - t

        timed(1)
        t1, t2 = min(timed(N1) for _ in range(2)), min(timed(N2) for _ in range(2))
    finally:
        llm.shutdown()
    outputs = []
    for o in outs:
        meta = o["meta_info"]
        steps = []
        for tok, chosen, top in zip(
            o["output_ids"], meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True
        ):
            pairs = {t[1]: t[0] for t in top}
            pairs.setdefault(tok, chosen[0])
            steps.append(sorted(pairs.items(), key=lambda x: -x[1]))
        outputs.append({"tokens": list(o["output_ids"]), "logprobs": steps})
    step_ms = round((t2 - t1) / (N2 - N1) * 1e3, 3)
    return {"outputs": outputs, "start_s": start_s, "step_ms": step_ms}


class DenseAttention:
    """The custom engine's default backend: causal attention over the paged cache, per request,
    in fp32 (same ``plan`` / ``run`` calls as ``PrefixAttention``)."""

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        self.hq, self.hkv, self.d, self.bs = num_qo_heads, num_kv_heads, head_dim, block_size
        self.batch: tuple[list[list[int]], list[int], list[int]] = ([], [], [])

    def plan(self, block_table: Any, seq_lens: Any, qo_indptr: Any) -> SimpleNamespace:
        self.batch = (block_table.tolist(), seq_lens.tolist(), qo_indptr.tolist())
        return SimpleNamespace(kv_bytes=0, query_centric_kv_bytes=0)

    def run(self, q: Any, k_cache: Any, v_cache: Any) -> Any:
        import torch

        table, seq_lens, indptr = self.batch
        out = torch.empty_like(q)
        g = self.hq // self.hkv
        for i, n in enumerate(seq_lens):
            q0, q1 = indptr[i], indptr[i + 1]
            pages = torch.tensor(table[i][: -(-n // self.bs)], device=q.device)
            k = k_cache[pages].reshape(-1, self.hkv, self.d)[:n].float()
            v = v_cache[pages].reshape(-1, self.hkv, self.d)[:n].float()
            qi = q[q0:q1].float().view(q1 - q0, self.hkv, g, self.d)
            s = torch.einsum("thgd,khd->thgk", qi, k) / self.d**0.5
            pos = torch.arange(n - (q1 - q0), n, device=q.device)
            mask = torch.arange(n, device=q.device)[None, :] > pos[:, None]
            s = s.masked_fill(mask[:, None, None, :], float("-inf"))
            o = torch.einsum("thgk,khd->thgd", s.softmax(-1), v)
            out[q0:q1] = o.reshape(q1 - q0, self.hq, self.d).to(q.dtype)
        return out


def run_custom(cell: Cell, backend: str, req: dict, device: str = "cuda",
               shape: dict[str, int] | None = None, block_size: int = 16,
               init_std: float = 0.02) -> dict:  # fmt: skip
    """The custom engine example with prefixattn or ``DenseAttention``; top-5 logprobs of every
    generated token are read from the logits of each step. ``shape`` and ``init_std`` (the
    weights' std) only change for tests: a tiny model needs larger weights to have
    non-flat logits."""
    import torch

    ce = custom_engine()
    shape = shape or MODEL_SHAPE
    cfg = ce.ModelConfig(
        vocab_size=VOCAB, hidden=shape["hidden"], num_layers=shape["layers"],
        num_qo_heads=cell.num_qo_heads, num_kv_heads=cell.num_kv_heads, head_dim=cell.head_dim,
        intermediate=shape["intermediate"],
    )  # fmt: skip
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    total = sum(len(p) + n for p, n in zip(req["prompts"], req["max_new"], strict=True))
    tiny = ce.TinyLlama(cfg)  # weights with std 0.02
    if init_std != 0.02:
        with torch.no_grad():
            for w in tiny.parameters():
                w.mul_(init_std / 0.02)
    engine = ce.Engine(tiny, num_blocks=total // block_size + len(req["prompts"]) + 8,
                       block_size=block_size, device=device, dtype=dtype,
                       max_batch=req["knobs"].get("max_seqs", 64))  # fmt: skip
    if backend == "dense":
        engine.attn = DenseAttention(cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, block_size)
    model = engine.model
    logprobs: dict[int, list] = {}
    decode_steps: list[bool] = []
    last: list[Any] = [None]

    def record(tokens: Any, positions: Any, attend: Any) -> Any:
        last[0] = model(tokens, positions, attend)
        return last[0]

    engine.model = record
    plain_step = engine.step

    def step(running: list) -> None:
        counts = [len(r.tokens) - r.num_computed for r in running]
        plain_step(running)
        decode_steps.append(all(c == 1 for c in counts))
        ends = torch.tensor(counts).cumsum(0) - 1
        top = last[0][ends.to(last[0].device)].float().log_softmax(-1).topk(5, dim=-1)
        for r, vals, ids in zip(running, top.values.tolist(), top.indices.tolist(), strict=True):
            logprobs.setdefault(r.rid, []).append(list(zip(ids, vals, strict=True)))

    engine.step = step
    reqs = [
        ce.Request(rid=i, prompt=list(p), max_new_tokens=n, arrival_step=a)
        for i, (p, n, a) in enumerate(
            zip(req["prompts"], req["max_new"], req["arrival"], strict=True)
        )
    ]
    t0 = time.perf_counter()
    got = engine.generate(reqs)
    wall = time.perf_counter() - t0
    decode = sorted(t for t, d in zip(engine.step_times, decode_steps, strict=True) if d)
    outputs = [{"tokens": got[r.rid], "logprobs": logprobs[r.rid]} for r in reqs]
    step_ms = round(decode[len(decode) // 2] * 1e3, 3) if decode else None
    return {"outputs": outputs, "step_ms": step_ms, "generate_s": round(wall, 2)}


# ``engine_run``'s backend name for writing the cell's model and nothing else.
MAKE_MODEL = "model"


def engine_run(cell: Cell, backend: str, models: Path) -> dict:
    """One backend of one cell, in this process (the ``--engine-run`` subprocess)."""
    if backend == MAKE_MODEL:
        return {"model": ensure_model(cell, models)}
    req = make_requests(cell.workload, echo=cell.mode == "spec")
    if cell.engine == "custom":
        return run_custom(cell, backend, req)
    model = ensure_model(cell, models)
    if cell.engine == "vllm":
        return run_vllm(cell, backend, model, req)
    return run_sglang(cell, backend, model, req)


def run_subprocess(cell: Cell, backend: str, work: Path, models: Path, timeout: float) -> dict:
    """``engine_run`` in a subprocess (own process group, killed on return or timeout), its
    output in ``work/<cell>_<backend>.log``."""
    result = work / f"{cell.id}_{backend}.json"
    log = work / f"{cell.id}_{backend}.log"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "tools.matrix.run_matrix", "--engine-run",
           json.dumps(dataclasses.asdict(cell)), backend, "--result", str(result),
           "--models", str(models)]  # fmt: skip
    # The engines' worker processes unpickle the check scripts' functions by module name
    # (``tools.vllm.check_engine.worker_info``): they need the repository root on their path.
    env = dict(os.environ)
    paths = [str(ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    t0 = time.monotonic()
    code = run_in_group(cmd, timeout, log, env)
    timed_out = isinstance(code, str)
    wall = round(time.monotonic() - t0, 1)
    print(f"  {backend}: exit {code} after {wall} s (log {log})", flush=True)
    if code != 0 or not result.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-12:]
        return {"error": f"{backend} exited {code} after {wall} s", "timed_out": timed_out,
                "log_tail": tail, "wall_s": wall}  # fmt: skip
    data = json.loads(result.read_text())
    data["wall_s"] = wall
    data["log"] = str(log)
    return data


def judge(cell: Cell, ref: dict, got: dict) -> dict:
    """Status of a cell from its two engine runs (``error`` in either: fail or timeout)."""
    out: dict[str, Any] = {
        "step_ms_backend": got.get("step_ms"),
        "step_ms_default": ref.get("step_ms"),
        "wall_s": {"default": ref.get("wall_s"), "backend": got.get("wall_s")},
    }
    errors = {k: r for k, r in (("default", ref), ("backend", got)) if "error" in r}
    if errors:
        timed_out = any(r.get("timed_out") for r in errors.values())
        out["status"] = "timeout" if timed_out else "fail"
        out["why"] = "; ".join(r["error"] for r in errors.values())
        out["log_tail"] = {k: r.get("log_tail") for k, r in errors.items()}
        return out
    cmp = check_engine().compare(ref["outputs"], got["outputs"])
    out.update(
        max_logprob_diff=cmp.get("max_logprob_diff"), tokens=cmp.get("tokens"),
        flips=cmp.get("flips"),
    )  # fmt: skip
    ok, why = bool(cmp["ok"]), cmp.get("why", "")
    if ok is False and not why:
        why = f"logprob difference {cmp['max_logprob_diff']:.4f} > {check_engine().TOL}"
    if cell.engine == "vllm" and cell.graphs == "on" and ok:
        out["full_decode_graphs"] = check_engine().full_decode_graphs(got.get("info", {}))
        if not out["full_decode_graphs"]:
            ok, why = False, "CUSTOM ran without full decode CUDA graphs"
    if cell.mode == "spec":
        out["spec_decode"] = got.get("info", {}).get("spec_decode", {})
        no_drafts = check_engine().no_drafts(out["spec_decode"])
        if ok and no_drafts:
            ok, why = False, no_drafts
    if cell.engine == "sglang" and "log" in got:
        steps = sglang_check().decode_steps(Path(got["log"]))
        out["decode_steps"] = steps
        want = steps["reported"] if cell.graphs == "on" else 0
        if ok and (steps["reported"] == 0 or steps["graph"] != want):
            ok, why = False, f"decode steps as CUDA graphs: {steps} (graphs {cell.graphs})"
    a, b = out["step_ms_default"], out["step_ms_backend"]
    if a and b:
        out["speedup"] = round(a / b, 3)
    out["status"] = "pass" if ok else "fail"
    out["why"] = why
    return out


def run_cell(cell: Cell, work: Path, models: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    if cell.engine != "custom":
        # The model is written in a process of its own: a process that ran torch's CPU
        # kernels (the random initialisation) and then starts an engine, which forks its
        # workers, can hang in the forked child's first parallel CPU op.
        made = run_subprocess(cell, MAKE_MODEL, work, models, min(180.0, timeout * 0.3))
        if "error" in made:
            return judge(cell, made, {})
    # The reference runs first and may pay one-time JIT work on a fresh machine (vLLM with
    # graphs on: ~95 s after graph capture, cached on disk afterwards): it gets the larger share.
    ref = run_subprocess(cell, default_backend(cell), work, models,
                         (deadline - time.monotonic()) * 0.6)  # fmt: skip
    got = run_subprocess(cell, our_backend(cell), work, models,
                         deadline - time.monotonic())  # fmt: skip
    return judge(cell, ref, got)


# --- report ----------------------------------------------------------------------------------

STATUSES = ("pass", "fail", "timeout", "skip")


def summary(results: list[dict]) -> dict[str, int]:
    return {s: sum(r["status"] == s for r in results) for s in STATUSES}


def _num(x: Any, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, int | float) else "-"


def markdown(results: list[dict], meta: dict) -> str:
    """One row per cell and a summary line."""
    s = summary(results)
    lines = [
        "# Integration matrix",
        "",
        f"Selection `{meta.get('select')}`, "
        + (
            f"merged from runs on {'; '.join(meta['runs'])}"
            if meta.get("runs")
            else f"{meta.get('machine', '?')}, {meta.get('date', '?')}"
        )
        + ". Correctness: greedy tokens and logprobs against the "
        f"engine's default backend (tolerance {meta.get('tol', '?')} nats, rule of "
        f"`tools/vllm/check_engine.py`); step time: decode step, ms.",
        "",
        "| cell | engine | heads | head_dim | workload | graphs | tp | mode | status "
        "| max logprob diff | tokens | step ms prefixattn | step ms default | speedup | why |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        why = str(r.get("why") or "").replace("|", "/").replace("\n", " ")
        lines.append(
            f"| {r['cell']} | {r['engine']} | {r['heads']} | {r['head_dim']} | {r['workload']} "
            f"| {r['graphs']} | {r['tp']} | {r.get('mode', 'plain')} | {r['status']} "
            f"| {_num(r.get('max_logprob_diff'), '.4f')} | {_num(r.get('tokens'), 'd')} "
            f"| {_num(r.get('step_ms_backend'), '.2f')} | {_num(r.get('step_ms_default'), '.2f')} "
            f"| {_num(r.get('speedup'), '.2f')} | {why} |"
        )
    lines += [
        "",
        f"**Summary: {len(results)} cells: {s['pass']} pass, {s['fail']} fail, "
        f"{s['timeout']} timeout, {s['skip']} skip.**",
        "",
    ]
    return "\n".join(lines)


def write_reports(results: list[dict], meta: dict, md: Path, js: Path) -> None:
    md.parent.mkdir(parents=True, exist_ok=True)
    js.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(markdown(results, meta))
    js.write_text(json.dumps({**meta, "summary": summary(results), "cells": results}, indent=1))
    out = os.environ.get("OUT")  # a GPU job's log folder: keep a copy with the logs
    if out and Path(out).is_dir() and Path(out).resolve() != md.parent.resolve():
        (Path(out) / md.name).write_text(md.read_text())
        (Path(out) / js.name).write_text(js.read_text())


def merge_reports(reports: list[dict], notes: dict[str, str]) -> tuple[list[dict], dict]:
    """One report from several runs' JSON reports, in the order given. Per cell, a later
    run's row replaces an earlier one, except that a ``skip`` never replaces a row that ran.
    ``notes`` (cell id -> text) are appended to a row's ``why``: what a log showed."""
    rows: dict[str, dict] = {}
    for rep in reports:
        for row in rep["cells"]:
            old = rows.get(row["cell"])
            if old is None or row["status"] != "skip" or old["status"] == "skip":
                rows[row["cell"]] = dict(row)
    unknown = sorted(set(notes) - set(rows))
    if unknown:
        raise SystemExit(f"--note names cells that are in no report: {', '.join(unknown)}")
    for cell, text in notes.items():
        why = rows[cell].get("why") or ""
        rows[cell]["why"] = f"{why}; {text}" if why else text
    order = {c.id: i for i, c in enumerate(select(reports[-1].get("select") or "smoke"))}
    results = sorted(rows.values(), key=lambda r: order.get(r["cell"], len(order)))
    runs = sorted({run for r in reports
                   for run in r.get("runs") or [f"{r.get('machine', '?')}, {r.get('date', '?')}"]})  # fmt: skip
    meta = {"select": reports[-1].get("select"), "runs": runs, "tol": reports[-1].get("tol")}
    return results, meta


def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return f"{n} x {torch.cuda.get_device_name(0)}"
    except Exception:
        pass
    return "no GPU"


clock = time.monotonic  # the budget's clock (tests replace it)


def run_matrix(cells: list[Cell], args: argparse.Namespace) -> list[dict]:
    deadline = clock() + args.budget
    work = Path(args.work or os.environ.get("OUT") or tempfile.mkdtemp(prefix="matrix-"))
    work.mkdir(parents=True, exist_ok=True)
    models = work / "models"
    models.mkdir(exist_ok=True)
    gpus = probe_gpus()
    meta = {"select": args.select, "machine": machine() if gpus else "no GPU",
            "date": time.strftime("%Y-%m-%d %H:%M"), "budget_s": args.budget,
            "tol": check_engine().TOL}  # fmt: skip
    results: list[dict] = []
    for cell in cells:
        row: dict[str, Any] = {"cell": cell.id, **dataclasses.asdict(cell)}
        why = skip_reason(cell, gpus)
        left = deadline - clock()
        if why is None and left < cell.estimate_s():
            why = f"budget: {left:.0f} s of {args.budget:.0f} s left, cell needs ~{cell.estimate_s()} s"
        print(f"{cell.id}: {'skip: ' + why if why else 'running'}", flush=True)
        if why:
            row.update(status="skip", why=why)
        else:
            timeout = min(left, args.cell_timeout or 2 * cell.estimate_s())
            t0 = time.monotonic()
            row.update(run_cell(cell, work, models, timeout))
            row["cell_s"] = round(time.monotonic() - t0, 1)
            print(f"  {row['status']}: {row.get('why') or ''}", flush=True)
        results.append(row)
        write_reports(results, meta, args.out_md, args.out_json)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Cross-framework integration matrix.")
    ap.add_argument("--select", choices=sorted(SELECTIONS), default="smoke")
    ap.add_argument("--engines", nargs="+", choices=AXES["engine"])
    ap.add_argument("--cells", nargs="+", help="keep cells whose id contains any of these")
    ap.add_argument("--budget", type=float, default=520.0, help="seconds for all cells")
    ap.add_argument("--cell-timeout", type=float, help="seconds per cell (default 2x estimate)")
    ap.add_argument("--sglang-reference", choices=["triton", "flashinfer"], default="triton")
    ap.add_argument("--out-md", type=Path, default=RESULTS / "matrix.md",
                    help=f"Markdown report (default {RESULTS}/matrix.md)")  # fmt: skip
    ap.add_argument("--out-json", type=Path, default=RESULTS / "matrix.json",
                    help=f"JSON report (default {RESULTS}/matrix.json)")  # fmt: skip
    ap.add_argument("--work", help="folder for logs and models (default $OUT or a temp dir)")
    ap.add_argument("--dry-run", action="store_true", help="print the cells and what each runs")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                    help="combine earlier runs' JSON reports (later ones win per cell) into "
                    "--out-md/--out-json instead of running")  # fmt: skip
    ap.add_argument(
        "--note",
        action="append",
        default=[],
        metavar="CELL=TEXT",
        help="with --merge: append TEXT to a cell's 'why' (repeatable)",
    )
    ap.add_argument("--engine-run", nargs=2, metavar=("CELL", "BACKEND"), help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--models", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    _SGLANG_REFERENCE[0] = args.sglang_reference
    if args.engine_run:
        cell = Cell(**json.loads(args.engine_run[0]))
        data = engine_run(cell, args.engine_run[1], args.models)
        args.result.write_text(json.dumps(data))
        return 0

    if args.merge:
        bad = [n for n in args.note if "=" not in n]
        if bad:
            ap.error(f"--note takes CELL=TEXT, got {bad[0]!r}")
        notes = dict(n.split("=", 1) for n in args.note)
        reports = [json.loads(p.read_text()) for p in args.merge]
        results, meta = merge_reports(reports, notes)
        write_reports(results, meta, args.out_md, args.out_json)
        s = summary(results)
        print(f"merged: {len(results)} cells, " + ", ".join(f"{v} {k}" for k, v in s.items()))
        return 0
    cells = select(args.select, args.engines, args.cells)
    if args.dry_run:
        for cell in cells:
            why = unsupported(cell)
            print(f"{cell.id}\n    {'skip: ' + why if why else describe(cell)}")
        print(f"{len(cells)} cells, ~{sum(c.estimate_s() for c in cells)} s if all run")
        return 0
    # On SIGTERM (e.g. from `timeout`) unwind, so the engines' process groups get killed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = run_matrix(cells, args)
    s = summary(results)
    print(f"matrix: {len(results)} cells, " + ", ".join(f"{v} {k}" for k, v in s.items()))
    return 1 if s["fail"] or s["timeout"] else 0


if __name__ == "__main__":
    sys.exit(main())
