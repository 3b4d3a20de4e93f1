"""The block samplers' early exit (SamplerOptions.early_exit, eval.py's --early-exit) on the main job's Sudoku model:
each setting with and without it, side by side on the same held-out puzzles, at the longest generation the model's
context allows (whole blocks of 32; d1 uses 512 for Sudoku), steps = length / 2 (d1's protocol), greedy.

    python gift.py                                  # the main job: runs/default/checkpoints/step-N/model
    python bench/early_exit.py --model runs/default # this table (a few minutes on 2 cores); bench/results/early_exit.*
    python bench/early_exit.py --smoke              # a random tiny model, seconds (tests/test_bench.py)

Each row: tokens/s (answer positions per second of one thread's process CPU time, so a neighbour on a shared machine
does not inflate it), x exact (the exact sampler's time over the row's), d1's cell accuracy, the answer tokens the
early exit skipped, and whether every graded text (eval.py's record: the whole generation decoded) is the row's
without the early exit, up to its first turn end. The long-answer models' table: bench/long_sampler.py --early-exit.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo's top-level files are plain modules
sys.path.insert(0, str(REPO / "experiments"))
import eval as E  # noqa: E402
from data import load_tokenizer  # noqa: E402
from embedded import EMBEDDED_EVAL, make_char_tokenizer, tiny_config_for  # noqa: E402
from gift_vs_sft import cpu_name  # noqa: E402
from longjob import find_model  # noqa: E402
from model import LLaDA  # noqa: E402
from sample import SamplerOptions  # noqa: E402

BLOCK = 32
SETTINGS = [  # (name, SamplerOptions fields): exact first (the speed-ups' reference)
    ("exact", {}),
    ("prefix", dict(cache="prefix")),
    ("dual", dict(cache="dual")),
    ("dual, window 32", dict(cache="dual", cache_window=32)),
    ("dual, threshold 0.9", dict(cache="dual", threshold=0.9)),
]


def until_stop(text):
    """The graded text up to its first turn end or EOS (what no later block can change)."""
    cuts = [i for i in (text.find("<|eot_id|>"), text.find("<|endoftext|>")) if i >= 0]
    return text[:min(cuts)] if cuts else text


def run(model, tokenizer, items, gen_length, batch):
    rows, exact, texts = [], None, {}
    for name, setting in SETTINGS:
        for early_exit in (False, True):
            o = SamplerOptions(gen_length=gen_length, steps=gen_length // 2, block_length=BLOCK,
                               early_exit=early_exit, **setting)
            seed_run = E.SeedRun()
            t0 = time.process_time()
            acc, records = E.evaluate(model, tokenizer, items, "sudoku", o, batch, "plain", seed_run)
            seconds = time.process_time() - t0
            exact = exact or seconds
            texts[name, early_exit] = [until_stop(r["generation"]) for r in records]
            rows.append(dict(setting=name + (" + exit" if early_exit else ""), items=len(items), seconds=seconds,
                             tps=len(items) * gen_length / seconds, speedup=exact / seconds, acc=acc,
                             skipped=seed_run.tokens["skipped"] / (len(items) * gen_length),
                             same_text=texts[name, early_exit] == texts[name, False] if early_exit else None))
            r = rows[-1]
            print(f"{r['setting']:28} {r['tps']:8.0f} tok/s {r['speedup']:6.2f}x  cells {acc:5.1f}%  skipped "
                  f"{100 * r['skipped']:5.1f}%" + ("" if r["same_text"] is None else f"  same text: {r['same_text']}"),
                  flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description="The early exit on the main job's Sudoku model, with and without.")
    p.add_argument("--model", default="runs/default", help="the main job's model, checkpoint or run folder")
    p.add_argument("--items", type=int, default=64, help="held-out puzzles (the main job's sudoku_heldout.csv)")
    p.add_argument("--batch", type=int, default=16, help="puzzles per sampler call")
    p.add_argument("--smoke", action="store_true", help="a random tiny model, 4 puzzles: the code path, seconds")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"), help="where the .md and .json go")
    a = p.parse_args(argv)
    torch.set_num_threads(1)  # the process CPU time of one thread is the clock
    if a.smoke:
        tokenizer = make_char_tokenizer()
        model = LLaDA(tiny_config_for(tokenizer, d_model=32, n_heads=2, n_kv_heads=2, n_layers=2, mlp_hidden_size=64,
                                      max_sequence_length=160)).init_weights(torch.Generator().manual_seed(0))
        items = [dict(question=E.SUDOKU_QUESTION.format(puzzle=q), puzzle=q, solution="3142243142131324")
                 for q in ("3102200002100320", "0142243142131320", "3142000042131324", "3100003142001324")]
    else:
        folder, _ = find_model(a.model)
        model, tokenizer = LLaDA.from_pretrained(folder), load_tokenizer(folder)
        items = E.load_sudoku(Path(folder) / EMBEDDED_EVAL["test_data"], subset=False)[:a.items]
    model.eval()
    prompt = max(len(E.encode(tokenizer, E.build_prompt("sudoku", it, "plain"))) for it in items)
    gen_length = (model.config.max_sequence_length - prompt) // BLOCK * BLOCK  # the longest the context allows
    print(f"early exit: {'--smoke' if a.smoke else a.model}; {len(items)} held-out puzzles, prompts of up to {prompt} "
          f"tokens, gen_length {gen_length} (block {BLOCK}, steps {gen_length // 2}), greedy, batches of {a.batch}; "
          "process CPU time of one thread", flush=True)
    t0 = time.time()
    rows = run(model, tokenizer, items, gen_length, a.batch)
    header = (f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {cpu_name()}, torch "
              f"{torch.__version__}, one thread; {len(items)} puzzles, gen_length {gen_length}; {time.time() - t0:.0f} s "
              "wall in all")
    lines = [header, "", "| setting | tokens/s | x exact | cells % | answer tokens skipped | text = without exit |",
             "| --- | ---: | ---: | ---: | ---: | :---: |"]
    lines += [f"| {r['setting']} | {r['tps']:.0f} | {r['speedup']:.2f} | {r['acc']:.1f} | {100 * r['skipped']:.1f}% | "
              f"{'' if r['same_text'] is None else 'yes' if r['same_text'] else 'NO'} |" for r in rows]
    print("\n".join(lines))
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = "smoke" if a.smoke else "cpu"
    (out / f"early_exit-{tag}.md").write_text("\n".join(lines) + "\n")
    (out / f"early_exit-{tag}.json").write_text(json.dumps(dict(header=header, rows=rows), indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
