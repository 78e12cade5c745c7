"""Device ops per decoder layer in one decode step: what each layer launches on a GPU, counted on the CPU.

    python benchmarks/op_count.py [--seqs 8] [--context 64]

Builds random-weight models of the Qwen2.5-0.5B shape (hidden 896, 14 query heads, 2 KV heads, head_dim 64,
intermediate 4864, tied embeddings; vocabulary cut to 4,096, which no layer sees) with 2 and with 4 decoder layers,
prefills `--seqs` sequences of `--context` tokens, then counts the non-view aten ops of one decode step of all of them
(a `TorchDispatchMode`, inside `ModelRunner.forward`): the difference between the two models over 2 is one layer's
count, whatever the step spends outside the layers. Both implementations (`model_impl` native and transformers) and
both attention backends are counted in one run. The Triton backend's kernels (the KV write, the attention, and the
native model's norms, rotary and SiLU-and-mul) count as one launch each: on a CPU they run through Triton's interpreter, whose own tensor calls are not launches.
The ops a layer runs are listed for the native model.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.in_kernel = False
        self.active = False  # inside the counted step: `kernel` launches outside it are not counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if not func.is_view and not self.in_kernel:
            self.ops[str(func.overloadpacket).removeprefix("aten.")] += 1
        return func(*args, **(kwargs or {}))

    def kernel(self, name: str, call):  # noqa: ANN001, ANN201
        """`call` counted as one launch named `name`, the tensor calls inside it not at all."""
        def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if self.in_kernel or not self.active:
                return call(*args, **kwargs)
            self.ops[name] += 1
            self.in_kernel = True
            try:
                return call(*args, **kwargs)
            finally:
                self.in_kernel = False
        return launch


def count_step(layers: int, impl: str, backend: str, seqs: int, context: int) -> Counter[str]:
    import tokenmill.engine.loader as loader_module
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tokenmill import LLM, SamplingParams

    config = Qwen2Config(vocab_size=4096, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, use_sliding_window=False, architectures=["Qwen2ForCausalLM"])
    tiny_model = loader_module.tiny_model
    loader_module.tiny_config = lambda: config
    loader_module.tiny_model = lambda dtype, device, seed=0: AutoModelForCausalLM.from_config(
        config, attn_implementation="tokenmill", dtype=dtype).to(device)
    try:
        llm = LLM("builtin:tiny", model_impl=impl, attention_backend=backend, max_model_len=context + 8,
                  num_kv_blocks=seqs * (context // 16 + 2))
    finally:
        loader_module.tiny_model = tiny_model
    runner = llm.engine.runner
    counter = OpCounter()
    if backend == "triton":
        runner.backend.write_kv = counter.kernel("triton:write_kv", runner.backend.write_kv)
        runner.backend.paged_attention = counter.kernel("triton:paged_attention", runner.backend.paged_attention)
        for name in ("add_rms_norm", "rotary", "silu_and_mul"):
            setattr(runner.backend, name, counter.kernel(f"triton:{name}", getattr(runner.backend, name)))
    forward = runner.forward
    steps = []

    def counted(inputs):  # noqa: ANN001, ANN202
        if inputs.max_seqlen_q == 1 and not steps:  # the first decode step
            steps.append(1)
            counter.active = True
            try:
                with counter:
                    return forward(inputs)
            finally:
                counter.active = False
        return forward(inputs)

    runner.forward = counted
    prompts = [[(7 * i + j) % 4000 + 3 for j in range(context)] for i in range(seqs)]
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return counter.ops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")
    print(f"Qwen2.5-0.5B shape, a decode step of {args.seqs} sequences at {args.context} tokens, float32, CPU\n")
    print("| implementation | attention backend | non-view aten ops per decoder layer | outside the layers |")
    print("|---|---|---:|---:|")
    per_layer = {}
    for impl in ("native", "transformers"):
        for backend in ("torch", "triton"):
            two, four = (count_step(n, impl, backend, args.seqs, args.context) for n in (2, 4))
            layer = {op: (four[op] - two[op]) / 2 for op in set(four) | set(two) if four[op] != two[op]}
            total = sum(layer.values())
            outside = sum(two.values()) - 2 * total
            per_layer[(impl, backend)] = layer
            print(f"| {impl} | {backend} | {total:g} | {outside:g} |", flush=True)
    for backend in ("torch", "triton"):
        layer = per_layer[("native", backend)]
        listed = ", ".join(f"{op} x{n:g}" for op, n in sorted(layer.items(), key=lambda kv: -kv[1]))
        print(f"\nnative, {backend} backend, one layer: {listed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
