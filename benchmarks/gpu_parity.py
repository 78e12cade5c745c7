#!/usr/bin/env python
"""Greedy parity on the device: tokenmill's tokens against transformers' `generate` on the same weights.

The engine's correctness oracle (tests/test_engine_parity.py) runs in float32 on CPU; this runs it where
users run the engine. Two random-weight models with the head geometry of Qwen2.5-0.5B (14 query heads,
2 KV heads, D=64: GQA groups of 7, padded to 8 in the kernel) and Llama-3-8B (32, 8, D=128), fewer layers
and a 32k vocabulary so they build in seconds, weights drawn wide as tests/model_fixtures.py does so greedy
argmax has clear winners. 32 requests of 1-300 prompt tokens and 1-32 new tokens, EOS honoured, a token
budget of 256 (chunked prefill, decode rows and prompt chunks in one step); transformers runs each request
alone (`generate`, SDPA, no padding).

  float32   TF32 off everywhere: tokenmill with the Triton backend and with the torch reference backend
            must equal transformers token for token (exit status 1 if not);
  bfloat16  tokenmill (Triton) against transformers in bf16: kernels round differently, so agreement is
            reported (identical requests, mean common prefix), not required.

Rows are printed as they finish and written to `--json` (default `$OUT/gpu_parity.json` when $OUT is set).

    python benchmarks/gpu_parity.py                  # CUDA
    python benchmarks/gpu_parity.py --quick          # tiny models, 8 requests; CPU too (Triton interpreted)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

sys.path.append(_HERE)
from gpu_throughput import agreement, write_model_dir  # noqa: E402

WIDE_INIT = 0.1
SHAPES = {
    "qwen2.5-0.5b-heads": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=4,
                               num_attention_heads=14, num_key_value_heads=2, vocab_size=32000,
                               max_position_embeddings=4096, rope_theta=1000000.0, tie_word_embeddings=True,
                               use_sliding_window=False, rms_norm_eps=1e-6, initializer_range=WIDE_INIT),
    "llama-3-8b-heads": dict(model_type="llama", hidden_size=1024, head_dim=128, intermediate_size=2048,
                             num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                             max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=False,
                             rms_norm_eps=1e-5, initializer_range=WIDE_INIT),
}
QUICK = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512)
QUICK_SHAPES = {
    "qwen2.5-0.5b-heads": dict(SHAPES["qwen2.5-0.5b-heads"], **QUICK, num_attention_heads=14,
                               num_key_value_heads=2, head_dim=16),
    "llama-3-8b-heads": dict(SHAPES["llama-3-8b-heads"], **QUICK, head_dim=16),
}
RUNS = (("float32", "triton"), ("float32", "torch"), ("bfloat16", "triton"))


@dataclass
class Row:
    model: str
    dtype: str
    backend: str
    requests: int
    identical: int
    agreement: str
    required: bool
    seconds: float

    @property
    def failed(self) -> bool:
        return self.required and self.identical != self.requests


def workload(count: int, vocab: int, max_prompt: int, max_new: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(1, max_prompt))], rng.randint(1, max_new))
            for _ in range(count)]


def build_model(path: str, shape: dict, seed: int) -> None:
    """config.json, a tokenizer over the vocabulary and float32 random weights, as `save_pretrained` writes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    write_model_dir(path, shape)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32).save_pretrained(path)


def hf_greedy(path: str, dtype: torch.dtype, requests: list[tuple[list[int], int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    outputs = []
    with torch.inference_mode():
        for prompt, max_new in requests:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
            outputs.append(out[0, len(prompt):].tolist())
    del model
    return outputs


def tokenmill_greedy(path: str, dtype: str, backend: str, requests: list[tuple[list[int], int]]) -> list[list[int]]:
    from tokenmill import LLM, SamplingParams

    memory = {"gpu_memory_utilization": 0.2} if torch.cuda.is_available() else {"num_kv_blocks": 1024}
    llm = LLM(path, dtype=dtype, attention_backend=backend, max_num_batched_tokens=256, max_model_len=512,
              **memory)
    assert llm.engine.runner.backend.name == backend, llm.engine.runner.backend.name
    params = [SamplingParams(max_tokens=max_new, temperature=0.0) for _, max_new in requests]
    outputs = llm.generate([prompt for prompt, _ in requests], params, use_tqdm=False)
    errors = [o.error for o in outputs if o.finish_reason not in ("stop", "length")]
    if errors:
        raise RuntimeError(f"tokenmill requests failed: {errors[:3]}")
    del llm
    return [o.token_ids for o in outputs]


def emit(row: Row, rows: list[Row], path: str | None) -> None:
    rows.append(row)
    verdict = "FAIL" if row.failed else ("ok" if row.required else "reported")
    print(f"[{row.model:>18}] {row.dtype:>8} {row.backend:>6}: {row.agreement} ({verdict}, {row.seconds:.1f} s)",
          flush=True)
    if path:
        with open(path, "w") as f:
            json.dump([asdict(r) | {"failed": r.failed} for r in rows], f, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models, 8 requests (CPU is fine)")
    parser.add_argument("--requests", type=int, default=None, help="default 32 (8 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    path = args.json or (os.path.join(os.environ["OUT"], "gpu_parity.json") if os.environ.get("OUT") else None)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    import transformers
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"gpu_parity: {device}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"triton {triton.__version__}", flush=True)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    count = args.requests or (8 if args.quick else 32)
    rows: list[Row] = []
    for name, shape in shapes.items():
        requests = workload(count, shape["vocab_size"], 60 if args.quick else 300, 8 if args.quick else 32, args.seed)
        with tempfile.TemporaryDirectory() as model_dir:
            build_model(model_dir, shape, args.seed)
            expected = {dtype: hf_greedy(model_dir, getattr(torch, dtype), requests)
                        for dtype in dict.fromkeys(dtype for dtype, _ in RUNS)}
            for dtype, backend in RUNS:
                start = time.perf_counter()
                actual = tokenmill_greedy(model_dir, dtype, backend, requests)
                identical = sum(a == e for a, e in zip(actual, expected[dtype]))
                emit(Row(name, dtype, backend, count, identical, agreement(expected[dtype], actual),
                         required=dtype == "float32", seconds=time.perf_counter() - start), rows, path)
    print("\n| model | dtype | backend | against transformers |\n|---|---|---|---|")
    for row in rows:
        verdict = " (required: FAIL)" if row.failed else ""
        print(f"| {row.model} | {row.dtype} | {row.backend} | {row.agreement}{verdict} |")
    return 1 if any(row.failed for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
