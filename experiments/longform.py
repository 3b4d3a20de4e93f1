"""A toy task with long answers for the samplers' benchmark at generation lengths 256-1024 (bench/long_sampler.py):
rotate a 6-digit string once more on each of 18-22 numbered lines, ~200-240 tokens, graded exactly, line by line.

The question names the digits and a line count, "rotate 381940, 7 lines"; the answer writes line k as the digits
rotated left by k: "01: 819403", "02: 194038", ..., 11 characters a line with its newline, then <|eot_id|>. Each line
is the line before it shifted by one place (and its number + 1), so the natural way to write it, and the one this
model learnt, copies from the line above: the answer is a chain of dependencies through ~20 lines, as a reasoning
trace is, and it is graded as one, step by step (grade: each line against the line written above it), so a sampler
that fills a block in parallel or reads a stale cache and breaks a link loses that line. Whole answers right are
counted too (this model often miscopies the question's digits into line 1, so they are rare).
The line count in the question says where the answer ends (an <|eot_id|> after line n).
2,100 distinct digit strings, each with a line count; the first 100 are held out (in no training row).

Three models, one per generation length of the benchmark (MODELS), each 0.17M parameters (d_model 64, 3 layers,
float32, 0.7 MB), committed in experiments/longform/, trained by gift.py (SFT loss, full fine-tuning, one process,
every answer padded with EOS to --max-len, as LLaDA's SFT pads). A model writes well only at the total length it was
trained at: the one padded to 1,100 tokens gets 41.3% of the lines right at generation length 1024 and 0% at 256 and
512; the one padded to 320 gets 80.7% at 256 and 25.9% at 512, 0% at 1024. Hence one model per length:
  model       (256): three stages, answers padded to 320, what `python experiments/longform.py` reruns (43 minutes on
              2 busy cores: 29 + 5 + 9): 800 steps on a first, harder trace (Fibonacci mod 10, fib_trace: it learnt
              the line layout, not the sum), 300 more steps on it, then 500 on the rotation (a record of how the
              model came to be, not a recipe);
  model-512   (512): one stage from the random model, `--max-len 560 --steps 2500 --seed 1 --no-warm-up-chars`;
  model-1024 (1024): one stage, `--max-len 1100 --steps 3000 --seed 1`.
The one-stage runs were made on an H200 (179 s and 352 s, the GPU shared by 2 and 4 such runs); on 2 CPU cores they
would take hours (gift.py's ~10k tokens/s there: 2,500 steps of 32 x 585 tokens is ~80 minutes).

    python experiments/longform.py                 # model: the three stages, copied to experiments/longform/model
    python experiments/longform.py --max-len 1100 --steps 3000 --model-out experiments/longform/model-1024 \
        --eval-lengths 1024                        # model-1024 (on a GPU: minutes)
    python experiments/longform.py --smoke         # tiny sizes, seconds
"""

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo's top-level files are plain modules
import gift  # noqa: E402
import longjob  # noqa: E402
from data import chat_format, chat_prompt, encode  # noqa: E402
from embedded import CHAR_VOCAB, make_char_tokenizer, tiny_config_for  # noqa: E402
from model import LLaDA  # noqa: E402
from cached_sample import generate_with_options  # noqa: E402
from sample import SamplerOptions, decode_until_stop, stop_ids  # noqa: E402

VOCAB = CHAR_VOCAB + "+=,"  # the char vocabulary plus "+=" (the warm-up trace, below) and ","
QUESTION = "rotate {s}, {n} lines"
WIDTH = 6  # digits a line
LINES = (18, 22)  # line counts, low and high: answers of 197-241 characters
N_TRAIN, N_HELDOUT = 2000, 100
MODEL_DIR = Path(__file__).resolve().parent / "longform" / "model"  # the committed model for length 256
# the committed model for each generation length of bench/long_sampler.py: trained with its answers padded to it
MODELS = {256: MODEL_DIR, 512: MODEL_DIR.parent / "model-512", 1024: MODEL_DIR.parent / "model-1024"}
MODEL = dict(d_model=64, n_heads=4, n_kv_heads=4, n_layers=3, mlp_hidden_size=192, max_sequence_length=2048)
# gift.py's flags (besides --model, --data, --out): the answer padded with EOS to max_len, as LLaDA's SFT pads, so
# that the model has learnt to write EOS after the answer (generation lengths 256-1024 leave 15-827 positions to it)
TRAIN = dict(loss="sft", batch_size=32, schedule="cosine", weight_decay=0.0, grad_clip=1.0, max_len=320,
             log_every=25, keep_last=5)
# the three stages: (task, the step whose checkpoint goes on, gift.py flags)
STAGES = [("fib", 800, dict(max_steps=800, lr=3e-3, warmup_steps=50, seed=0, save_every=200)),
          ("fib", 300, dict(max_steps=600, lr=2e-3, warmup_steps=20, seed=1, save_every=150)),
          ("rotate", 500, dict(max_steps=500, lr=2e-3, warmup_steps=20, seed=2, save_every=100))]
SMOKE = dict(max_steps=4, batch_size=8, warmup_steps=1, log_every=1, save_every=2)
SMOKE_MODEL = dict(d_model=32, n_heads=2, n_kv_heads=2, n_layers=1, mlp_hidden_size=64, max_sequence_length=2048)


def make_tokenizer(warm_up=True):
    """The char tokenizer: VOCAB, or without the warm-up trace's "+=" for a one-stage run (--max-len)."""
    return make_char_tokenizer(VOCAB if warm_up else VOCAB.replace("+=", ""))


# -----------------------------------------------------------------------------
# The task: its trace and its grader


def trace(s, n):
    """The answer to QUESTION: n lines "kk: r", r the digits s rotated left by k (line k's digits are line k - 1's
    rotated by one more: line WIDTH is s again)."""
    return "\n".join(f"{k:02d}: {s[k % len(s):] + s[:k % len(s)]}" for k in range(1, n + 1))


def fib_trace(a, b, n):
    """Stage 1 and 2's task: n lines "kk: x+y=z", z = (x + y) mod 10, each line's y and z the next line's x and y."""
    lines = []
    for k in range(1, n + 1):
        lines.append(f"{k:02d}: {a}+{b}={(a + b) % 10}")
        a, b = b, (a + b) % 10
    return "\n".join(lines)


def fib_rows():
    """Stage 1 and 2's rows: 80 of the 100 seed pairs (a fixed draw), 20-24 lines each, 400 (prompt, response)."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(0).shuffle(pairs)
    rows = [(f"fibonacci mod 10 of {a} {b}, {n} lines", fib_trace(a, b, n)) for a, b in pairs[20:]
            for n in range(20, 25)]
    random.Random(1).shuffle(rows)
    return rows


def grade(text, s, n):
    """(steps right, n, whole answer right), graded as a trace is, step by step: line k is right when it is "kk: "
    and the digits of the line written above it (line 1: the question's) rotated left by one, so a slip costs its
    own line, not every line after it; lines past n or missing are wrong. The whole answer is right when the text
    (up to the turn end) is the reference exactly, nothing missing, nothing after it."""
    got = text.strip().split("\n")[:n]
    right, above = 0, s
    for k, line in enumerate(got, start=1):
        right += line == f"{k:02d}: {above[1:] + above[:1]}"
        above = line.partition(": ")[2]
    return right, n, text.strip() == trace(s, n)


def items(split):
    """The questions of a split ("train" or "heldout") as dicts s, n, question: N_TRAIN + N_HELDOUT distinct digit
    strings drawn with a fixed seed, the first N_HELDOUT held out (in no training row), each with its line count."""
    rng = random.Random(0)
    strings = []
    while len(strings) < N_TRAIN + N_HELDOUT:
        s = "".join(rng.choice("0123456789") for _ in range(WIDTH))
        if s not in strings:
            strings.append(s)
    chosen = strings[:N_HELDOUT] if split == "heldout" else strings[N_HELDOUT:]
    return [dict(s=s, n=n, question=QUESTION.format(s=s, n=n))
            for s, n in zip(chosen, (rng.randint(*LINES) for _ in chosen))]


def prompt_ids(tokenizer, item):
    """The ids the model answers: the question through the tokenizer's chat format (as gift.py trains on it)."""
    return encode(tokenizer, chat_prompt([{"role": "user", "content": item["question"]}], chat_format(tokenizer)))


@torch.no_grad()
def evaluate(model, tokenizer, heldout, options, batch_size=32):
    """Generate (generate_with_options: the exact sampler, generate_cached or Dream's) and grade every item. Every
    prompt has the same length (one-digit seeds, two-digit counts), so a batch needs no padding. Returns records, one
    per item: lines right, n, exact, generation."""
    records = []
    for start in range(0, len(heldout), batch_size):
        chunk = heldout[start:start + batch_size]
        prompt = torch.tensor([prompt_ids(tokenizer, it) for it in chunk], device=model.head.weight.device)  # (B, P)
        x = generate_with_options(model, prompt, options=options, stop_ids=stop_ids(tokenizer))  # (B, P + gen)
        for it, ids in zip(chunk, x[:, prompt.shape[1]:].tolist()):
            text = decode_until_stop(tokenizer, ids)
            right, n, exact = grade(text, it["s"], it["n"])
            records.append(dict(lines=right, n=n, exact=exact, generation=text))
    return records


def accuracy(records):
    """Step accuracy in % (lines right / lines, grade) with its 95% interval from the items' spread (the lines of one
    answer are not independent, so the interval is over items: the ratio estimator's normal interval), and whole
    answers right in %."""
    r = [x["lines"] for x in records]
    n = [x["n"] for x in records]
    k, mean_n = len(r), sum(n) / len(n)
    acc = sum(r) / sum(n)
    resid = [ri - acc * ni for ri, ni in zip(r, n)]  # the ratio estimator's linearised residuals
    se = math.sqrt(sum(e * e for e in resid) / max(k - 1, 1) / k) / mean_n
    return 100 * acc, 100 * 1.96 * se, 100 * sum(x["exact"] for x in records) / k


# -----------------------------------------------------------------------------
# Training: the data as gift.py's prompt/response JSONL, a random tiny LLaDA, gift.train


def train_argv(model, data, out, flags, smoke=False):
    """gift.py's command line for one stage (printed, so it can be rerun by hand)."""
    argv = ["--model", str(model), "--data", str(data), "--data-format", "prompt-response", "--out", str(out),
            "--epochs", "1000000", "--grad-accum", "1", "--dtype", "float32", "--pad-to-max-len"]
    for k, v in (TRAIN | flags | (SMOKE if smoke else {})).items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    return argv


def build(out, smoke=False, warm_up=True):
    """The two tasks' training data (fib.jsonl, rotate.jsonl) and the random initial model with its tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    rows = dict(fib=fib_rows(), rotate=[(it["question"], trace(it["s"], it["n"])) for it in items("train")])
    for name, pairs in rows.items():
        with open(out / f"{name}.jsonl", "w") as f:
            for prompt, response in pairs:
                f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    tokenizer = make_tokenizer(warm_up)
    config = tiny_config_for(tokenizer, **(SMOKE_MODEL if smoke else MODEL))
    init = LLaDA(config).init_weights(torch.Generator().manual_seed(0))
    init.save_pretrained(out / "init")
    tokenizer.save(str(out / "init" / "tokenizer.json"))
    return out / "init"


def main(argv=None):
    p = argparse.ArgumentParser(description="Train the long-answer toy model (the rotation trace) with gift.py.")
    p.add_argument("--out", default="runs/longform", help="the run's folder (data, initial model, gift.py's run)")
    p.add_argument("--model-out", default=str(MODEL_DIR), help="where the trained model is copied")
    p.add_argument("--eval-items", type=int, default=100, help="held-out items graded at the end (exact sampler)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    p.add_argument("--eval-lengths", default="256", help="generation lengths graded at the end, comma-separated")
    p.add_argument("--max-len", type=int, default=None, help="one stage on the rotation from the random model, "
                   "answers padded with EOS to this many tokens (a model for generation lengths up to it)")
    p.add_argument("--steps", type=int, default=3000, help="--max-len: optimizer steps")
    p.add_argument("--lr", type=float, default=2e-3, help="--max-len: peak learning rate")
    p.add_argument("--seed", type=int, default=1, help="--max-len: gift.py's seed")
    p.add_argument("--no-warm-up-chars", action="store_true", help="a tokenizer without the warm-up trace's \"+=\" "
                   "(unused by the rotation; model-512 was trained so, the others with them)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    model_dir = build(out, a.smoke, warm_up=not a.no_warm_up_chars)
    stages = STAGES if a.max_len is None else [  # one stage on the rotation, answers padded to --max-len
        ("rotate", a.steps, dict(max_steps=a.steps, lr=a.lr, warmup_steps=100, seed=a.seed, save_every=500,
                                 max_len=a.max_len))]
    t0 = time.time()
    for k, (task, keep, flags) in enumerate(stages, start=1):
        argv = train_argv(model_dir, out / f"{task}.jsonl", out / f"stage{k}", flags, a.smoke)
        print("python gift.py " + " ".join(argv), flush=True)
        with longjob.run_folder(out / f"stage{k}", False, True) as preemption:
            model, inputs, _ = gift.train(gift.parse_options(argv), preemption)
        model_dir = out / f"stage{k}" / "checkpoints" / f"step-{(4 if a.smoke else keep):07d}" / "model"
    train_s = time.time() - t0
    shutil.rmtree(a.model_out, ignore_errors=True)
    shutil.copytree(model_dir, a.model_out)
    model = LLaDA.from_pretrained(model_dir, device="cuda" if torch.cuda.is_available() else "cpu").eval()
    for length in map(int, a.eval_lengths.split(",")):
        t0 = time.time()
        options = SamplerOptions(gen_length=length, steps=length // 2, block_length=32)  # d1's protocol
        records = evaluate(model, inputs.tokenizer, items("heldout")[:a.eval_items], options)
        acc, half, exact = accuracy(records)
        print(f"trained in {train_s:.0f} s; model {a.model_out}; held-out ({len(records)} items, gen {length}, block "
              f"32, {length // 2} steps, exact sampler): lines {acc:.1f} +- {half:.1f}%, whole answers {exact:.1f}% "
              f"({time.time() - t0:.0f} s)", flush=True)
    return dict(train_s=train_s, lines=acc, exact=exact)


if __name__ == "__main__":
    main()
