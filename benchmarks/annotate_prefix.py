"""Annotate benchmark, shared prefixes: 64 rows whose prompts share a 400-token instruction, prefix caching
on vs off, one run each.

    python benchmarks/annotate_prefix.py [--rows 64] [--instruction-tokens 400] [--max-tokens 8]

The model is a random-weight Llama (hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1536, float32,
`load_format="dummy"`) with the built-in byte-level tokenizer, so one character of the instruction is one token
and the instruction is exactly `--instruction-tokens` tokens (plus BOS). builtin:tiny itself is too small for
prefill to matter next to Python overhead. Both runs use `tokenmill.annotate` end to end from a JSONL file with
a fresh checkpoint; the ratio is the wall time without prefix caching over the wall time with it (goal >= 2x).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def model_dir(path: Path) -> str:
    from transformers import LlamaConfig

    from tokenmill.engine.tiny import tiny_tokenizer

    LlamaConfig(vocab_size=320, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=4096, bos_token_id=256, eos_token_id=257,
                pad_token_id=258).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--instruction-tokens", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    import tokenmill
    from tokenmill import LLM

    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    words = "classify the sentiment of the following customer review as positive negative or neutral and explain".split()
    instruction = ""
    while len(instruction) < args.instruction_tokens:
        instruction += rng.choice(words) + " "
    instruction = instruction[: args.instruction_tokens]
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        path = model_dir(directory / "model")
        data = directory / "rows.jsonl"
        data.write_text("".join(json.dumps({"review": f"review {i}: " + " ".join(rng.choice(words) for _ in range(3))}) + "\n"
                                for i in range(args.rows)))
        template = instruction + "\n\nReview: {{ review }}\nLabel:"
        load = os.getloadavg()
        results = {}
        for caching in (True, False):
            llm = LLM(path, load_format="dummy", dtype="float32", enable_prefix_caching=caching)
            llm.generate(["warm up"], tokenmill.SamplingParams(max_tokens=2), use_tqdm=False)
            started = time.perf_counter()
            summary = tokenmill.annotate(str(data), str(directory / f"out-{caching}.jsonl"), template, llm=llm,
                                         max_tokens=args.max_tokens, ignore_eos=True, quiet=True)
            results[caching] = (time.perf_counter() - started, summary)
            del llm
        same = (directory / "out-True.jsonl").read_text() == (directory / "out-False.jsonl").read_text()
    on, off = results[True], results[False]
    prompt_tokens = on[1].prompt_tokens
    print(f"\n{args.rows} rows, {args.instruction_tokens}-token shared instruction, {prompt_tokens / args.rows:.0f} prompt "
          f"tokens per row, max_tokens {args.max_tokens}, random Llama 512x8 float32, {args.threads} torch threads")
    print("| prefix caching | wall s | rows / s | prefix-cache hit rate |\n|---|---:|---:|---:|")
    for name, (wall, summary) in (("on", on), ("off", off)):
        rate = "-" if summary.prefix_hit_rate is None else f"{summary.prefix_hit_rate:.1%}"
        print(f"| {name} | {wall:.2f} | {args.rows / wall:.1f} | {rate} |")
    print(f"\nspeed-up from prefix caching: {off[0] / on[0]:.2f}x (goal >= 2x); outputs identical: {same}")
    print(f"load average before: {load[0]:.2f}, after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
