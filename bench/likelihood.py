"""GiftLM's likelihood estimates (harness.py, lm-eval's model "gift") on a local multiple-choice task, on the
main job's Sudoku model: each held-out puzzle's prompt (eval.build_prompt, the plain style, in the model's chat format)
with 4 choices, the answer "<answer>SOLUTION</answer>" and three one-cell corruptions of it (a blank cell given another
digit); the model's pick is the choice of the highest ELBO estimate.

    python gift.py                                   # the main job: runs/default/checkpoints/step-N/model
    python bench/likelihood.py --model runs/default  # the tables (minutes on 2 cores); bench/results/likelihood-cpu.*
    python bench/likelihood.py --smoke               # a random tiny model, seconds (tests/test_harness_paired.py)

First table: accuracy against mc_num, LLaDA's unpaired draws (the default) and paired draws (--paired-draws: the
choices of a question share their l and masks), the mean over --seeds, and forward passes per question. Second:
requests/s (requests per second of one thread's process CPU time), each request alone (its own ceil(mc_num /
batch_size) passes: the estimates before requests shared passes) against the requests' draws sharing passes of
batch_size rows, side by side on the same requests, and the largest difference between their estimates.
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo's top-level files are plain modules
sys.path.insert(0, str(REPO / "experiments"))
import eval as E  # noqa: E402
import harness as H  # noqa: E402
from data import chat_format, load_tokenizer  # noqa: E402
from embedded import EMBEDDED_EVAL, SUDOKU_ANSWER, make_char_tokenizer, tiny_config_for  # noqa: E402
from gift_vs_sft import cpu_name  # noqa: E402
from longjob import find_model  # noqa: E402
from model import LLaDA  # noqa: E402


def questions(items, fmt, seed=0):
    """[(context, [4 answer texts], index of the right one)]: three blank cells of each puzzle, each given another
    digit, in a shuffled order (a seeded random.Random)."""
    rng, out = random.Random(seed), []
    for item in items:
        s = item["solution"]
        cells = rng.sample([i for i, c in enumerate(item["puzzle"]) if c == "0"], 3)
        wrong = [s[:i] + rng.choice([d for d in "1234" if d != s[i]]) + s[i + 1:] for i in cells]
        choices = [s] + wrong
        rng.shuffle(choices)
        answers = [SUDOKU_ANSWER.format(solution=c) for c in choices]
        out.append((E.build_prompt("sudoku", item, "plain", fmt=fmt), answers, choices.index(s)))
    return out


def requests(qs):
    from lm_eval.api.instance import Instance
    return [Instance("loglikelihood", {}, (context, choice), i, ("sudoku_mc", q, 1))
            for q, (context, choices, _) in enumerate(qs) for i, choice in enumerate(choices)]


def giftlm(folder, passes, **model_args):
    """GiftLM on the folder, float32, no is_greedy; each forward pass appends its rows to `passes`."""
    lm = H.GiftLM(model=str(folder), dtype="float32", check_greedy=False, **model_args)
    forward = lm.model.forward
    lm.model.forward = lambda x, *a, **k: passes.append(len(x)) or forward(x, *a, **k)
    return lm


def accuracy(folder, qs, reqs, mc_nums, batch, seeds):
    rows = []
    for mc in mc_nums:
        for paired in (False, True):
            acc, passes = [], []
            for seed in seeds:
                lm = giftlm(folder, passes, mc_num=mc, batch_size=batch, paired=paired, seed=seed)
                elbo = [e for e, _ in lm.loglikelihood(reqs)]
                acc.append(sum(max(range(4), key=lambda i: elbo[4 * q + i]) == right
                               for q, (_, _, right) in enumerate(qs)) / len(qs))
            rows.append(dict(mc_num=mc, paired=paired, acc=sum(acc) / len(acc), acc_per_seed=acc,
                             passes_per_question=len(passes) / len(seeds) / len(qs)))
            r = rows[-1]
            print(f"mc_num {mc:4}  {'paired  ' if paired else 'unpaired'}  accuracy {r['acc']:.3f}  "
                  f"({', '.join(f'{a:.3f}' for a in acc)})  {r['passes_per_question']:.1f} passes per question",
                  flush=True)
    return rows


def throughput(folder, reqs, mc_nums, batches):
    rows = []
    for batch in batches:
        for mc in mc_nums:
            lm = giftlm(folder, [], mc_num=mc, batch_size=batch)
            t0 = time.process_time()
            alone = [lm.loglikelihood([r])[0][0] for r in reqs]
            t1 = time.process_time()
            shared = [e for e, _ in lm.loglikelihood(reqs)]
            t2 = time.process_time()
            rows.append(dict(batch_size=batch, mc_num=mc, alone=len(reqs) / (t1 - t0), shared=len(reqs) / (t2 - t1),
                             max_diff=max(abs(a - b) for a, b in zip(alone, shared))))
            r = rows[-1]
            print(f"batch_size {batch:3}  mc_num {mc:4}  requests/s alone {r['alone']:8.1f}  shared "
                  f"{r['shared']:8.1f}  ({r['shared'] / r['alone']:.2f}x)  largest difference {r['max_diff']:.1e}",
                  flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description="GiftLM's likelihoods on Sudoku multiple choice: paired draws, shared "
                                            "passes.")
    p.add_argument("--model", default="runs/default", help="the main job's model, checkpoint or run folder")
    p.add_argument("--items", type=int, default=32, help="held-out puzzles (the main job's sudoku_heldout.csv)")
    p.add_argument("--mc-num", type=int, nargs="+", default=[1, 4, 16, 128], help="likelihood draws per request")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="the draws' seeds the accuracy averages")
    p.add_argument("--batch-size", type=int, default=8, help="rows per forward pass of the accuracy table")
    p.add_argument("--throughput-batch-sizes", type=int, nargs="+", default=[8, 32], help="those of requests/s")
    p.add_argument("--smoke", action="store_true", help="a random tiny model, 4 puzzles: the code path, seconds")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"), help="where the .md and .json go")
    a = p.parse_args(argv)
    torch.set_num_threads(1)  # the process CPU time of one thread is the clock
    H.PROGRESS_SECONDS = float("inf")  # GiftLM's progress lines: the tables say it
    if a.smoke:
        folder, tokenizer = Path(tempfile.mkdtemp(prefix="bench-likelihood-")), make_char_tokenizer()
        LLaDA(tiny_config_for(tokenizer, d_model=32, n_heads=2, n_kv_heads=2, n_layers=2, mlp_hidden_size=64,
                              max_sequence_length=160)).init_weights(torch.Generator().manual_seed(0)).save_pretrained(
            folder)
        tokenizer.save(str(folder / "tokenizer.json"))
        items = [dict(question=E.SUDOKU_QUESTION.format(puzzle=q), puzzle=q, solution="3142243142131324")
                 for q in ("3102200002100320", "0142243102131320", "3142000042131324", "3100003142001324")]
        a.mc_num, a.seeds, a.throughput_batch_sizes = [1, 4], [0], [8]
    else:
        folder, _ = find_model(a.model)
        tokenizer = load_tokenizer(folder)
        items = E.load_sudoku(Path(folder) / EMBEDDED_EVAL["test_data"], subset=False)[:a.items]
    qs = questions(items, chat_format(tokenizer))
    reqs = requests(qs)
    print(f"likelihood: {'--smoke' if a.smoke else a.model}; {len(qs)} held-out puzzles, 4 choices each; float32, "
          "process CPU time of one thread", flush=True)
    t0 = time.time()
    acc = accuracy(folder, qs, reqs, a.mc_num, a.batch_size, a.seeds)
    speed = throughput(folder, reqs, a.mc_num, a.throughput_batch_sizes)
    header = (f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {cpu_name()}, torch "
              f"{torch.__version__}, one thread; {len(qs)} puzzles x 4 choices; {time.time() - t0:.0f} s wall in all")
    lines = [header, "", f"Accuracy (mean over seeds {', '.join(map(str, a.seeds))}; batch_size {a.batch_size}):", "",
             "| mc_num | unpaired | paired | forward passes per question |", "| ---: | ---: | ---: | ---: |"]
    lines += [f"| {u['mc_num']} | {u['acc']:.3f} | {q['acc']:.3f} | {u['passes_per_question']:.1f} |"
              for u, q in zip(acc[::2], acc[1::2])]
    lines += ["", "Requests/s, each request alone against shared passes:", "",
              "| batch_size | mc_num | alone | shared | x | largest difference |",
              "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['batch_size']} | {r['mc_num']} | {r['alone']:.1f} | {r['shared']:.1f} | "
              f"{r['shared'] / r['alone']:.2f} | {r['max_diff']:.1e} |" for r in speed]
    print("\n".join(lines))
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = "smoke" if a.smoke else "cpu"
    (out / f"likelihood-{tag}.md").write_text("\n".join(lines) + "\n")
    (out / f"likelihood-{tag}.json").write_text(json.dumps(dict(header=header, accuracy=acc, throughput=speed),
                                                           indent=1) + "\n")
    return acc, speed


if __name__ == "__main__":
    main()
