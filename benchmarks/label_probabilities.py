"""Label probabilities against constrained choice decoding: rows/s of rows labelled with
`SamplingParams(choice=labels, temperature=0)` (greedy, grammar-constrained) and with `choice_probabilities=True`
(every label scored, the prompt computed once), side by side in one run, for 3 and 10 labels, and for 10 labels
that share prefixes ("10 nested": "sports/football", "sports/tennis", ...: each shared prefix is computed once).

    python benchmarks/label_probabilities.py [--models tiny,small,small-bpe,small-bpe-words] [--labels 3,10,10 nested]
                                             [--rows 128] [--repeats 3] [--threads 1]

Models: `tiny` is builtin:tiny (byte-level tokenizer: a label of n characters is n tokens); `small` a random-weight
Llama (hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1536, float32, `load_format="dummy"`) with the same
byte-level tokenizer, big enough for the model's compute to count beside Python overhead; `small-bpe` the same Llama
with a byte-level BPE tokenizer trained here on text holding the 3 and 10 labels, so each of those is one token, as
common words are in real vocabularies (the "10 nested" labels' second words are then spelled in sub-word pieces);
`small-bpe-words` the same with a BPE trained on all three label sets, so every word of them and "/" is one token
("sports/football" three), as in a real vocabulary. "tokens per label" is each label's length in tokens; "computed
label tokens" counts the distinct proper prefixes of the labels in tokens: the positions a probabilities request
computes beyond its prompt. Prompts are an instruction naming the labels (the same for every row: served from the
prefix cache after the first) and a review of 60-200 characters; every run labels rows drawn afresh, so no run finds
its rows' prompts in the prefix cache. Each mode runs `--repeats` times, alternating which goes first, after a
warm-up that compiles the grammar; the best of each is kept. Times are the process's CPU time (one torch thread by
default), which a machine shared with other work inflates far less than wall time; wall-clock rows/s are printed
beside them. The ratio is the probabilities' CPU time over constrained decoding's (goal <= 1.3).
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LABELS = {
    "3": ["positive", "negative", "neutral"],
    "10": ["sports", "politics", "science", "business", "health", "travel", "music", "film", "food", "technology"],
    "10 nested": ["sports/football", "sports/tennis", "sports/golf", "science/physics", "science/biology",
                  "politics/elections", "politics/policy", "business/finance", "business/markets", "health/fitness"],
}
BPE_LABELS = {"small-bpe": ("3", "10"), "small-bpe-words": tuple(LABELS)}  # the label sets each BPE is trained on
WORDS = "the film was long and the acting good but plot thin music loud food cold staff kind price fair".split()
_draws = itertools.count(1)


def small_model_dir(path: Path, bpe: tuple[str, ...] | None) -> str:
    from transformers import LlamaConfig

    from tokenmill.engine.tiny import tiny_tokenizer

    tokenizer = bpe_tokenizer(bpe) if bpe else tiny_tokenizer()
    LlamaConfig(vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def bpe_tokenizer(label_sets: tuple[str, ...]):  # noqa: ANN201 - a transformers tokenizer
    """A byte-level BPE (at most 1,024 tokens) trained on reviews and these label sets: each word of them one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<s>", "</s>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    labels = [label for name in label_sets for label in LABELS[name]]
    corpus = prompts(300, labels, seed=0) + [" ".join(labels)] * 50 + labels * 50
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def prompts(count: int, labels: list[str], seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        review, length = "", rng.randint(60, 200)
        while len(review) < length:
            review += rng.choice(WORDS) + " "
        out.append(f"Label the review as one of {', '.join(labels)}.\nReview: {review.strip()}\nLabel:")
    return out


def timed(llm, labels: list[str], rows: int, params) -> tuple[float, float]:  # noqa: ANN001
    """(CPU seconds, wall seconds) of labelling `rows` fresh rows."""
    batch = prompts(rows, labels, seed=next(_draws))
    cpu, wall = time.process_time(), time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert all(o.finish_reason == "stop" for o in outputs), {o.finish_reason for o in outputs}
    return cpu, wall


def compare(llm, labels: list[str], rows: int, repeats: int) -> dict[str, tuple[float, float]]:  # noqa: ANN001
    """Best (CPU, wall) seconds of constrained decoding and of label probabilities."""
    from tokenmill import SamplingParams

    modes = {"constrained": SamplingParams(choice=labels, temperature=0.0),
             "probabilities": SamplingParams(choice=labels, choice_probabilities=True)}
    for params in modes.values():  # warm-up: the grammar compiles, the instruction enters the prefix cache
        timed(llm, labels, 8, params)
    best = {name: (float("inf"), float("inf")) for name in modes}
    for repeat in range(repeats):
        for name in list(modes) if repeat % 2 == 0 else reversed(modes):
            cpu, wall = timed(llm, labels, rows, modes[name])
            best[name] = (min(best[name][0], cpu), min(best[name][1], wall))
    return best


def load(name: str, tmp: Path):  # noqa: ANN201 - an LLM
    from tokenmill import LLM

    if name == "tiny":
        return LLM("builtin:tiny", dtype="float32")
    return LLM(small_model_dir(tmp / name, BPE_LABELS.get(name)), dtype="float32", load_format="dummy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,small,small-bpe,small-bpe-words")
    parser.add_argument("--labels", default=",".join(LABELS), help="label sets, of: " + ", ".join(LABELS))
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    print(f"{args.rows} rows, best of {args.repeats}, {args.threads} torch threads, CPU; load {os.getloadavg()[0]:.1f}")
    print("| model | labels | label tokens | tokens per label | computed label tokens | constrained rows/CPU s | "
          "probabilities rows/CPU s | CPU time ratio | "
          "wall rows/s (constrained, probabilities) |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            llm = load(name, Path(tmp))
            for label_set in args.labels.split(","):
                labels = LABELS[label_set]
                spelled = [llm.tokenizer.encode(label, add_special_tokens=False) for label in labels]
                tokens = sum(map(len, spelled))
                lengths = " ".join(str(len(ids)) for ids in spelled)
                computed = len({tuple(ids[:end]) for ids in spelled for end in range(1, len(ids))})
                best = compare(llm, labels, args.rows, args.repeats)
                (cpu_c, wall_c), (cpu_p, wall_p) = best["constrained"], best["probabilities"]
                print(f"| {name} | {label_set} | {tokens} | {lengths} | {computed} | {args.rows / cpu_c:.1f} | "
                      f"{args.rows / cpu_p:.1f} | "
                      f"{cpu_p / cpu_c:.2f}x | {args.rows / wall_c:.1f}, {args.rows / wall_p:.1f} |", flush=True)
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
