"""The samplers on long answers: tokens/s, speed-up over the exact sampler and held-out accuracy at generation lengths
256, 512 and 1024 (block 32, steps = length / 2, d1's protocol), on the committed toy models that write ~200-240
token answers (experiments/longform.py: a rotation trace, graded exactly, line by line), one per length: each was
trained with its answers padded to its length (longform.MODELS), as a model only writes well at the lengths it saw.

    python bench/long_sampler.py            # the table, CPU (~15 min on a 2-core CPU); bench/results/long_sampler-cpu.*
    python bench/long_sampler.py --smoke    # a random tiny model, two short lengths, seconds (tests/test_long_sampler.py)
    python bench/long_sampler.py --gpu      # LLaDA-8B widths, random bf16 weights, one GPU: tokens/s only (< 3 min)
    python bench/long_sampler.py --gpu --smoke   # the same code on the CPU at tiny shapes

Each setting samples the same held-out items at each length; every row's time is the process CPU time of one thread
(which a neighbour on a shared machine does not inflate), and its speed-up is the exact sampler's time in the same run
over its own. Accuracy = lines right / lines (experiments/longform.accuracy), its 95% interval over items; "d" is
the paired difference to the exact sampler on the same items, in points. A row is on the Pareto front (*) when no
other row of its length is both at least as fast and at least as accurate, and strictly one of the two.

--gpu: the model is built on the GPU from the meta device (to_empty, then random normal weights: accuracy means
nothing there), and each setting is timed on the last `--gpu-blocks` blocks of a generation: the prompt is the
answer's first blocks already written, so every step sees the full sequence length of the whole generation and costs
what it costs there (a block's cost does not depend on where it is, except the very first, which every cache rebuilds
whole: a windowed row pays that one full forward in each timed run, so its figure is pessimistic).
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo's top-level files are plain modules
sys.path.insert(0, str(REPO / "experiments"))
import longform  # noqa: E402
from gift_vs_sft import cpu_name  # noqa: E402
from model import LLaDA, LLaDAConfig  # noqa: E402
from cached_sample import generate_with_options  # noqa: E402
from sample import SamplerOptions  # noqa: E402

LENGTHS = (256, 512, 1024)
BLOCK = 32
# held-out items per length (of 100): the exact sampler's cost grows as length^2 (steps x sequence), so longer
# lengths get fewer items to keep the whole table near 15 minutes on 2 cores
ITEMS = {256: 50, 512: 50, 1024: 10}
# (name, SamplerOptions fields): exact first (the speed-ups' reference)
SETTINGS = [
    ("exact", {}),
    ("prefix", dict(cache="prefix")),
    ("dual", dict(cache="dual")),
    ("dual, drift 0.9", dict(cache="dual", cache_drift=0.9)),
    ("dual, window 32", dict(cache="dual", cache_window=32)),
    ("threshold 0.9", dict(threshold=0.9)),
    ("dual, threshold 0.9", dict(cache="dual", threshold=0.9)),
    ("dual, refresh 2, threshold 0.995", dict(cache="dual", cache_refresh=2, threshold=0.995)),
    ("dual, threshold 0.99", dict(cache="dual", threshold=0.99)),
    ("dual, window 32, threshold 0.9", dict(cache="dual", cache_window=32, threshold=0.9)),
    ("dual, window 32, threshold 0.99", dict(cache="dual", cache_window=32, threshold=0.99)),
    ("prefix, window 32, threshold 0.9", dict(cache="prefix", cache_window=32, threshold=0.9)),
    ("dual, refresh 1, window 32", dict(cache="dual", cache_refresh=1, cache_window=32)),
    ("dual, refresh 1, window 32, threshold 0.99", dict(cache="dual", cache_refresh=1, cache_window=32, threshold=0.99)),
    ("dual, refresh 2, window 32, threshold 0.995", dict(cache="dual", cache_refresh=2, cache_window=32,
                                                         threshold=0.995)),
]
SMOKE = dict(lengths=(64, 128), items=4, settings=("exact", "dual", "dual, window 32", "dual, window 32, threshold 0.9"))
# --gpu: LLaDA-8B's widths (all 32 layers), the rows it times, and the exact sampler's batch sweep
LLADA_8B = dict(d_model=4096, n_heads=32, n_kv_heads=32, n_layers=32, mlp_hidden_size=12288, vocab_size=126464,
                embedding_size=126464, mask_token_id=126336, eos_token_id=126081, pad_token_id=126081)
GPU_SMOKE = dict(d_model=64, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=128, vocab_size=512,
                 embedding_size=512, mask_token_id=511, eos_token_id=510, pad_token_id=510)
GPU_SETTINGS = ("exact", "dual", "dual, window 32", "dual, threshold 0.9", "dual, window 32, threshold 0.9")
GPU_PROMPT = 64


# -----------------------------------------------------------------------------
# The table on the toy model (CPU)


EXIT = " + exit"  # a row's name with the sampler's early exit (--early-exit), beside the row without it


def options(name, gen_length):
    setting = dict(SETTINGS)[name.removesuffix(EXIT)]
    return SamplerOptions(gen_length=gen_length, steps=gen_length // 2, block_length=BLOCK,
                          early_exit=name.endswith(EXIT), **setting)


def pareto(rows):
    """Mark rows[i]["front"]: no other row is at least as fast and as accurate, and better in one."""
    for r in rows:
        r["front"] = not any(o is not r and o["speedup"] >= r["speedup"] and o["acc"] >= r["acc"]
                             and (o["speedup"] > r["speedup"] or o["acc"] > r["acc"]) for o in rows)


def paired_diff(records, exact):
    """Points of line accuracy gained over the exact sampler on the same items, with its 95% half-width (paired)."""
    n = sum(e["n"] for e in exact)
    d = [(r["lines"] - e["lines"]) for r, e in zip(records, exact)]
    k, mean = len(d), sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / max(k - 1, 1)
    return 100 * sum(d) / n, 100 * 1.96 * math.sqrt(var / k) * k / n


def run_length(model, tokenizer, gen_length, heldout, names, batch):
    rows, exact, texts = [], None, {}
    for name in names:
        o = options(name, gen_length)
        t0 = time.process_time()
        records = longform.evaluate(model, tokenizer, heldout, o, batch)
        seconds = time.process_time() - t0
        exact = exact or dict(records=records, seconds=seconds)
        texts[name] = [r["generation"] for r in records]  # the graded text: the same with the early exit as without
        same = texts[name] == texts.get(name.removesuffix(EXIT)) if name.endswith(EXIT) else None
        acc, half, whole = longform.accuracy(records)
        d, d_half = paired_diff(records, exact["records"])
        rows.append(dict(length=gen_length, setting=name, items=len(records), seconds=seconds,
                         tps=len(records) * gen_length / seconds, speedup=exact["seconds"] / seconds, acc=acc,
                         acc_half=half, whole=whole, diff=d, diff_half=d_half, same_text=same))
        r = rows[-1]
        print(f"{gen_length:6} {name:34} {r['tps']:8.0f} {r['speedup']:7.2f} {acc:6.1f} +- {half:4.1f} "
              f"{d:+6.1f} +- {d_half:4.1f} {whole:6.1f}" + ("" if same is None else f"  same text: {same}"), flush=True)
    pareto(rows)
    return rows


def markdown(rows, header):
    lines = [header, "", "| length | setting | items | tokens/s | x exact | lines right % (95%) | d vs exact (95%) | "
             "answers right % | front | text = without exit |",
             "| ---: | --- | ---: | ---: | ---: | --- | --- | ---: | :---: | :---: |"]
    for r in rows:
        lines.append(f"| {r['length']} | {r['setting']} | {r['items']} | {r['tps']:.0f} | {r['speedup']:.2f} | "
                     f"{r['acc']:.1f} +- {r['acc_half']:.1f} | {r['diff']:+.1f} +- {r['diff_half']:.1f} | "
                     f"{r['whole']:.1f} | {'*' if r['front'] else ''} | "
                     f"{'' if r.get('same_text') is None else 'yes' if r['same_text'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def run_table(a):
    torch.set_num_threads(1)  # the process CPU time of one thread is the clock
    if a.smoke:  # a random tiny model with the task's tokenizer: the code path, not the numbers
        tokenizer = longform.make_tokenizer()
        from embedded import tiny_config_for
        config = tiny_config_for(tokenizer, **longform.SMOKE_MODEL)
        model = LLaDA(config).init_weights(torch.Generator().manual_seed(0)).eval()
        lengths, names = SMOKE["lengths"], SMOKE["settings"]
        counts = {n: SMOKE["items"] for n in lengths}
    else:
        lengths, names = a.lengths, ["exact"] + [n for n, _ in SETTINGS if n in a.settings and n != "exact"]
        names = [m for n in names for m in ((n, n + EXIT) if a.early_exit else (n,))]
        counts = {n: a.items or ITEMS.get(n, 25) for n in lengths}
    heldout = longform.items("heldout")
    which = a.model or "each length's model (longform.MODELS)" if not a.smoke else "a random tiny model (--smoke)"
    print(f"long answers: {which}; block {BLOCK}, steps = "
          "length / 2, greedy; process CPU time of one thread; d = paired difference to exact, points")
    print(f"{'length':>6} {'setting':34} {'tok/s':>8} {'x exact':>7} {'lines % (95%)':>14} {'d (95%)':>14} "
          f"{'whole%':>6}")
    rows = []
    t0 = time.time()
    for n in lengths:
        if not a.smoke:  # the model trained at this length, or --model's
            from data import load_tokenizer
            folder = a.model or longform.MODELS[n]
            model, tokenizer = LLaDA.from_pretrained(folder).eval(), load_tokenizer(folder)
        rows += run_length(model, tokenizer, n, heldout[:counts[n]], names, a.batch)
    wall = time.time() - t0
    header = (f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {cpu_name()} "
              f"({'--smoke' if a.smoke else a.model or 'longform.MODELS'}), torch {torch.__version__}, one thread; "
              f"{wall:.0f} s wall in all")
    md = markdown(rows, header)
    print(md)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = "smoke" if a.smoke else a.tag
    (out / f"long_sampler-{tag}.md").write_text(md)
    (out / f"long_sampler-{tag}.json").write_text(json.dumps(dict(header=header, rows=rows), indent=1) + "\n")
    return rows


# -----------------------------------------------------------------------------
# --gpu: LLaDA-8B widths, random weights, tokens/s only


def build_gpu_model(shapes, device, dtype):
    """LLaDA built on the meta device, given storage on `device` (to_empty: no host copy of 8B weights) and random
    normal weights drawn there."""
    with torch.device("meta"):
        model = LLaDA(LLaDAConfig(**shapes, max_sequence_length=4096))
    model = model.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # the norms' weights
            else:
                p.normal_(0.0, 0.02, generator=generator)
    return model.to(dtype).eval()


def time_blocks(model, name, batch, gen_length, blocks, device):
    """Seconds of the last `blocks` blocks of a gen_length generation (the earlier ones given as prompt), and the
    generated tokens they stand for."""
    V = model.config.vocab_size
    P = GPU_PROMPT + gen_length - blocks * BLOCK
    prompt = torch.randint(0, V - 2, (batch, P), generator=torch.Generator().manual_seed(1)).to(device)
    o = SamplerOptions(gen_length=blocks * BLOCK, steps=blocks * BLOCK // 2, block_length=BLOCK, **dict(SETTINGS)[name])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    generate_with_options(model, prompt, options=o)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, batch * blocks * BLOCK


def run_gpu(a):
    device = torch.device("cpu" if a.smoke else "cuda")
    if a.smoke:
        torch.set_num_threads(1)  # more threads than free cores only waits on a shared machine
    shapes, dtype = (GPU_SMOKE, torch.float32) if a.smoke else (LLADA_8B, torch.bfloat16)
    gen, blocks = (64, 1) if a.smoke else (512, a.gpu_blocks)
    sweep_gen, sweep = (64, (1, 2)) if a.smoke else (256, (1, 8, 32, 64))
    t_start = time.time()
    model = build_gpu_model(shapes, device, dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(f"--gpu: {name}; d_model {shapes['d_model']}, {shapes['n_layers']} layers, vocab {shapes['vocab_size']}, "
          f"{str(dtype).replace('torch.', '')}, random weights; prompt {GPU_PROMPT}; the last {blocks} block(s) of "
          f"each generation timed (wall clock); built in {time.time() - t_start:.0f} s", flush=True)
    time_blocks(model, "exact", 1, 2 * BLOCK, 1, device)  # warm-up (kernels, allocator)
    rows = []
    for batch in (1, 2) if a.smoke else (1, 32):
        exact = None
        for setting in GPU_SETTINGS:
            s, tokens = time_blocks(model, setting, batch, gen, blocks, device)
            exact = exact or s
            rows.append(dict(table="settings", gen_length=gen, batch=batch, setting=setting, tps=tokens / s,
                             speedup=exact / s))
            print(f"gen {gen} batch {batch:3} {setting:34} {tokens / s:9.1f} tok/s  {exact / s:5.2f}x exact", flush=True)
    for batch in sweep:
        s, tokens = time_blocks(model, "exact", batch, sweep_gen, blocks, device)
        rows.append(dict(table="exact sweep", gen_length=sweep_gen, batch=batch, setting="exact", tps=tokens / s,
                         speedup=1.0))
        print(f"gen {sweep_gen} batch {batch:3} exact {tokens / s:9.1f} tok/s", flush=True)
    lines = [f"--gpu on {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
             f"{time.time() - t_start:.0f} s in all", "", "| table | gen | batch | setting | tokens/s | x exact |",
             "| --- | ---: | ---: | --- | ---: | ---: |"]
    lines += [f"| {r['table']} | {r['gen_length']} | {r['batch']} | {r['setting']} | {r['tps']:.1f} | "
              f"{r['speedup']:.2f} |" for r in rows]
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = "gpu-smoke" if a.smoke else "gpu-" + name.replace(" ", "-")
    (out / f"long_sampler-{tag}.md").write_text("\n".join(lines) + "\n")
    (out / f"long_sampler-{tag}.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="The samplers on long answers: tokens/s, speed-up and accuracy.")
    p.add_argument("--model", default=None, help="a toy model folder for every length (default: each length's own, "
                   "experiments/longform.MODELS)")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="generation lengths, comma-separated")
    p.add_argument("--items", type=int, default=None, help="held-out items per length (default: 50 / 50 / 10)")
    p.add_argument("--batch", type=int, default=25, help="items per sampler call")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"), help="where the .md and .json go")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, seconds")
    p.add_argument("--settings", default=None, help="the rows to run, names joined by ';' (default: all; exact "
                                                   "always runs first, the speed-ups' reference)")
    p.add_argument("--tag", default="cpu", help="the results' file name: long_sampler-<tag>.md / .json")
    p.add_argument("--early-exit", action="store_true", help="each row also with the sampler's early exit (the row "
                   "'<setting> + exit' after it: a row stops once a finished block holds its turn end)")
    p.add_argument("--gpu", action="store_true", help="LLaDA-8B widths with random weights on one GPU: tokens/s")
    p.add_argument("--gpu-blocks", type=int, default=2, help="--gpu: blocks timed per generation")
    a = p.parse_args(argv)
    a.lengths = tuple(int(x) for x in a.lengths.split(","))
    a.settings = [n for n, _ in SETTINGS] if a.settings is None else [n.strip() for n in a.settings.split(";")]
    unknown = set(a.settings) - {n for n, _ in SETTINGS}
    if unknown:
        p.error(f"--settings: unknown {sorted(unknown)}; the rows are {[n for n, _ in SETTINGS]}")
    if any(n % BLOCK or n < BLOCK for n in a.lengths):
        p.error(f"--lengths {a.lengths}: each a multiple of the block length {BLOCK}")
    if not (a.smoke or a.gpu or a.model) and set(a.lengths) - set(longform.MODELS):
        p.error(f"--lengths {a.lengths}: no model trained at {sorted(set(a.lengths) - set(longform.MODELS))}; "
                f"give one with --model (the committed ones: {sorted(longform.MODELS)})")
    return a


def main(argv=None):
    a = parse_args(argv)
    return run_gpu(a) if a.gpu else run_table(a)


if __name__ == "__main__":
    main()
