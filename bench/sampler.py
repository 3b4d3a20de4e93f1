"""Tokens per second of sample.generate against the official LLaDA sampler, same model, same tokens; then the
opt-in fast sampler cached_sample.generate_cached (Fast-dLLM's prefix / dual key-value cache and confidence-threshold
parallel decoding) against the exact one, with the share of tokens that agree and, on a trained Sudoku model, what
the speed costs in accuracy.

    python bench/sampler.py             # head-heavy (vocab 126464, d_model 128) and body-heavy configs, CPU
    python bench/sampler.py --sudoku-model runs/sudoku-tiny/checkpoints/step-0003750/model   # + held-out accuracy
    python bench/sampler.py --smoke     # tiny shapes, one repetition (tests/test_bench.py runs this)
    python bench/sampler.py --device cuda --dtype bfloat16

The reference below is ML-GSAI/LLaDA's generate.py transcribed line for line (as in tests/test_sample.py): every
step it computes the logits of the WHOLE sequence (prompt, finished blocks and later blocks included), a softmax
over all of them, and picks each row's top-k in a Python loop. sample.generate runs the LM head only where a token
can be unmasked at this step (the masks of the current block, and any left before it) and handles the batch at
once. Both run on the same model and prompts with greedy decoding (d1's evaluation setting: gen_length 256,
block_length 32, steps 128), and the outputs are asserted identical.

Timing: the two samplers alternate (reference, ours, reference, ...), the median of the repeats is reported. On a
CPU the default clock is the process CPU time of one thread, which neighbours on a shared machine do not inflate.

FLOP projection (matrix FLOPs, multiply-add = 2): a step costs 2 N per token for the blocks (N = block matmul
parameters), 4 L D per token per layer for attention, and 2 V D per position where the head runs: all B L positions
in the reference, the eligible ones in ours (on average about half a block per row: the block's masks shrink from
block_length to block_length / steps_per_block over its steps). The softmax over V that the reference also does at
every position is not counted (it is memory-bound work that makes the reference slower still).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo's top-level files are plain modules
sys.path.insert(0, str(REPO / "tests"))  # the official sampler's transcription lives with the tests (the oracle)
from model import LLaDA, LLaDAConfig  # noqa: E402
from official_sampler import official_generate  # noqa: E402
from sample import SamplerOptions, generate
from cached_sample import generate_cached  # noqa: E402

CONFIGS = {  # name: model shapes
    "head-heavy": dict(vocab=126464, d_model=128, n_heads=4, n_layers=2, mlp=384),
    "body-heavy": dict(vocab=4096, d_model=256, n_heads=4, n_layers=4, mlp=768),
}
SMOKE_CONFIGS = {
    "head-heavy": dict(vocab=4096, d_model=32, n_heads=4, n_layers=1, mlp=96),
    "body-heavy": dict(vocab=256, d_model=64, n_heads=4, n_layers=2, mlp=192),
}
LLADA_8B = dict(vocab=126464, d_model=4096, n_heads=32, n_layers=32, mlp=12288)  # projected, not run
DEFAULTS = dict(batch=2, prompt_len=64, gen_length=256, block_length=32, steps=128, repeats=3)
# the fast sampler: its modes (name, cache, threshold; 0.9 is Fast-dLLM's default threshold) and the shapes it is
# timed at, on the body-heavy model: the body-heavy bench shape, and d1's evaluation shape (prompt ~200, gen 256)
THRESHOLD = 0.9
# (name, cache, threshold, cache_refresh: rebuild the cache every N steps of a block, None = at its first only,
# cache_drift: Elastic-Cache's drift test's gamma, None = off)
FAST_MODES = [("exact", None, None, None, None), ("prefix", "prefix", None, None, None), ("dual", "dual", None, None, None),
              ("dual+refresh8", "dual", None, 8, None), ("dual+refresh4", "dual", None, 4, None),
              ("dual+refresh2", "dual", None, 2, None), ("dual+drift0.9", "dual", None, None, 0.9),
              ("dual+drift0.99", "dual", None, None, 0.99), ("exact+threshold", None, THRESHOLD, None, None),
              ("exact+threshold0.95", None, 0.95, None, None), ("exact+threshold0.99", None, 0.99, None, None),
              ("prefix+threshold", "prefix", THRESHOLD, None, None), ("dual+threshold", "dual", THRESHOLD, None, None),
              ("dual+threshold0.99", "dual", 0.99, None, None), ("dual+refresh4+threshold0.99", "dual", 0.99, 4, None),
              ("dual+refresh2+threshold0.99", "dual", 0.99, 2, None),
              ("dual+drift0.9+threshold0.99", "dual", 0.99, None, 0.9),
              ("dual+drift0.99+threshold0.99", "dual", 0.99, None, 0.99),
              ("dual+refresh2+drift0.99+threshold0.99", "dual", 0.99, 2, 0.99),
              ("dual+refresh2+threshold0.995", "dual", 0.995, 2, None)]
FAST_SHAPES = {"body-heavy": dict(prompt_len=64, gen_length=256, block_length=32, steps=128),
               "d1 eval shape": dict(prompt_len=200, gen_length=256, block_length=32, steps=128)}
SMOKE_FAST_SHAPES = {"body-heavy": dict(prompt_len=8, gen_length=32, block_length=8, steps=16)}
SMOKE = dict(batch=2, prompt_len=8, gen_length=32, block_length=8, steps=16, repeats=1)

# -----------------------------------------------------------------------------
# FLOP model


def sampler_flops(shapes, B, prompt_len, gen_length, block_length, steps):
    """Matrix FLOPs of one generate() call: (reference, ours). Greedy, no CFG; each step unmasks
    block_length / steps_per_block tokens per row, so the eligible positions of ours shrink over a block."""
    D, V, layers, mlp = shapes["d_model"], shapes["vocab"], shapes["n_layers"], shapes["mlp"]
    L = prompt_len + gen_length
    N = layers * (4 * D * D + 3 * D * mlp)  # q, k, v, attn_out, ff_proj, up_proj, ff_out
    per_forward = B * L * (2 * N + 4 * L * D * layers)  # blocks and attention, over the whole sequence
    head = 2 * V * D
    num_blocks = gen_length // block_length
    spb = steps // num_blocks
    eligible = 0  # positions per row summed over all steps (the masks left in the current block)
    for _ in range(num_blocks):
        left = block_length
        for i in range(spb):
            eligible += left
            left -= block_length // spb + (i < block_length % spb)
    reference = steps * (per_forward + head * B * L)
    ours = steps * per_forward + head * B * eligible
    return reference, ours


# -----------------------------------------------------------------------------
# The benchmark


def build_model(shapes, seed, device, dtype):
    V = shapes["vocab"]
    cfg = LLaDAConfig(d_model=shapes["d_model"], n_heads=shapes["n_heads"], n_kv_heads=shapes["n_heads"],
                      n_layers=shapes["n_layers"], mlp_hidden_size=shapes["mlp"], vocab_size=V, embedding_size=V,
                      mask_token_id=V - 1, eos_token_id=V - 2, pad_token_id=V - 2)
    model = LLaDA(cfg).init_weights(torch.Generator().manual_seed(seed))
    return model.to(device=device, dtype=dtype).eval()


def timed(fn, clock, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.process_time() if clock == "cpu" else time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, (time.process_time() if clock == "cpu" else time.perf_counter()) - t0


def bench_config(name, shapes, a, device, dtype):
    model = build_model(shapes, a.seed, device, dtype)
    mask_id = model.config.mask_token_id
    prompt = torch.randint(0, shapes["vocab"] - 2, (a.batch, a.prompt_len),
                           generator=torch.Generator().manual_seed(a.seed + 1)).to(device)
    kw = dict(steps=a.steps, gen_length=a.gen_length, block_length=a.block_length)
    run_ref = lambda: official_generate(model, prompt, mask_id=mask_id, **kw)  # noqa: E731
    run_ours = lambda: generate(model, prompt, **kw)  # noqa: E731
    warm = dict(steps=a.steps // (a.gen_length // a.block_length), gen_length=a.block_length,
                block_length=a.block_length)  # one block each, untimed
    official_generate(model, prompt, mask_id=mask_id, **warm)
    generate(model, prompt, **warm)
    times = {"reference": [], "ours": []}
    for r in range(a.repeats):
        for which, fn in (("reference", run_ref), ("ours", run_ours)) if r % 2 == 0 else \
                (("ours", run_ours), ("reference", run_ref)):
            out, t = timed(fn, a.clock, device)
            times[which].append(t)
            if which == "reference":
                ref_out = out
            else:
                ours_out = out
        if not torch.equal(ref_out, ours_out):
            n = int((ref_out != ours_out).sum())
            raise AssertionError(f"bench/sampler.py {name}: sample.generate differs from the official sampler in "
                                 f"{n} of {ours_out[:, a.prompt_len:].numel()} generated tokens")
    tokens = a.batch * a.gen_length
    ref_f, ours_f = sampler_flops(shapes, a.batch, a.prompt_len, a.gen_length, a.block_length, a.steps)
    ratios = [r / o for r, o in zip(times["reference"], times["ours"])]
    return dict(name=name, ref_tps=tokens / statistics.median(times["reference"]),
                ours_tps=tokens / statistics.median(times["ours"]), speedup=statistics.median(ratios),
                speedup_min=min(ratios), speedup_max=max(ratios), predicted=ref_f / ours_f)


def bench_fast(name, shapes, shape, a, device, dtype):
    """Every FAST_MODES mode on one model and prompt batch, interleaved (the order rotates each round): tokens/s,
    speed-up over the exact sampler (median of the per-round ratios), and the share of generated tokens equal to
    the exact sampler's."""
    model = build_model(shapes, a.seed, device, dtype)
    prompt = torch.randint(0, shapes["vocab"] - 2, (a.batch, shape["prompt_len"]),
                           generator=torch.Generator().manual_seed(a.seed + 1)).to(device)
    kw = dict(steps=shape["steps"], gen_length=shape["gen_length"], block_length=shape["block_length"])
    times, outs = {m: [] for m, *_ in FAST_MODES}, {}
    for r in range(a.repeats):
        order = FAST_MODES[r % len(FAST_MODES):] + FAST_MODES[:r % len(FAST_MODES)]
        for mode, cache, threshold, refresh, drift in order:
            if cache is None and threshold is None:  # the exact sampler
                run_mode = lambda: generate(model, prompt, **kw)  # noqa: E731
            else:
                options = SamplerOptions(cache=cache, threshold=threshold, cache_refresh=refresh, cache_drift=drift,
                                         **kw)
                run_mode = lambda: generate_cached(model, prompt, options=options)  # noqa: E731
            outs[mode], t = timed(run_mode, a.clock, device)
            times[mode].append(t)
    P, tokens = shape["prompt_len"], a.batch * shape["gen_length"]
    rows = []
    for mode, *_ in FAST_MODES:
        ratios = [e / t for e, t in zip(times["exact"], times[mode])]
        agree = float((outs[mode][:, P:] == outs["exact"][:, P:]).float().mean())
        rows.append(dict(shape=name, mode=mode, tps=tokens / statistics.median(times[mode]),
                         speedup=statistics.median(ratios), agreement=agree))
    return rows


def bench_sudoku(model_dir, a, device, dtype):
    """Held-out Sudoku with every FAST_MODES mode: the model folder's own held-out puzzles (sudoku_heldout.csv, which
    gift.py's embedded run saves with it; else embedded.embedded_task's for gift.py's default --seed 42) and the
    embedded task's generation settings (embedded.EMBEDDED_EVAL), graded by eval.py."""
    from data import load_tokenizer
    from embedded import EMBEDDED_EVAL, embedded_task
    from eval import SUDOKU_QUESTION, evaluate, load_sudoku
    if (Path(model_dir) / "sudoku_heldout.csv").is_file():
        items = load_sudoku(Path(model_dir) / "sudoku_heldout.csv", subset=False)[:a.sudoku_puzzles]
    else:
        _, _, heldout = embedded_task(42, a.sudoku_puzzles)  # (tokenizer, training examples, held-out pairs)
        items = [dict(question=SUDOKU_QUESTION.format(puzzle=p), puzzle=p, solution=s) for p, s in heldout]
    model = LLaDA.from_pretrained(model_dir, dtype=dtype, device=device).eval()
    tokenizer = load_tokenizer(model_dir)
    rows, exact = [], None
    embedded = EMBEDDED_EVAL
    for mode, cache, threshold, refresh, drift in FAST_MODES:
        options = SamplerOptions(gen_length=embedded["gen_length"], steps=embedded["steps"],
                                 block_length=embedded["block_length"], cache=cache, threshold=threshold,
                                 cache_refresh=refresh, cache_drift=drift)
        (acc, records), t = timed(lambda: evaluate(model, tokenizer, items, "sudoku", options, batch_size=64,
                                                   prompt_style=embedded["prompt_style"]), a.clock, device)
        exact = exact or records
        solved = sum(r["correct_cells"] == r["empty_cells"] for r in records) / len(records)
        same = sum(r["generation"] == e["generation"] for r, e in zip(records, exact)) / len(records)
        rows.append(dict(mode=mode, seconds=t, cell_acc=acc, puzzle_acc=100 * solved, same=same,
                         tps=len(items) * embedded["gen_length"] / t))
    return rows


def run_fast(a, device, dtype):
    print(f"\nfast sampler (cached_sample.generate_cached cache= / threshold={THRESHOLD}) vs the exact sampler, body-heavy "
          f"model, batch {a.batch}, greedy, random weights; agreement = share of generated tokens equal to the exact "
          "sampler's")
    header = f"{'shape':14} {'P':>4} {'gen':>4} {'mode':17} {'tok/s':>8} {'speedup':>8} {'agreement':>9}"
    print(header)
    print("-" * len(header))
    rows = []
    for name, shape in (SMOKE_FAST_SHAPES if a.smoke else FAST_SHAPES).items():
        for r in bench_fast(name, (SMOKE_CONFIGS if a.smoke else CONFIGS)["body-heavy"], shape, a, device, dtype):
            rows.append(r)
            print(f"{name:14} {shape['prompt_len']:4} {shape['gen_length']:4} {r['mode']:17} {r['tps']:8.1f} "
                  f"{r['speedup']:8.2f} {r['agreement']:9.3f}")
    best = max((r for r in rows if r["shape"] == "body-heavy"), key=lambda r: r["speedup"])
    print(f"targets: fast sampler >= 3x the exact one at the body-heavy shape: {best['speedup']:.2f} ({best['mode']}): "
          f"{'yes' if best['speedup'] >= 3 else 'NO'}")
    if a.sudoku_model:
        print(f"\nheld-out Sudoku ({a.sudoku_puzzles} puzzles of the embedded task, 8 blanks), {a.sudoku_model}; "
              "same = share of answers identical to the exact sampler's")
        header = f"{'mode':17} {'seconds':>8} {'tok/s':>8} {'speedup':>8} {'cells %':>8} {'puzzles %':>9} {'same':>6}"
        print(header)
        print("-" * len(header))
        sudoku = bench_sudoku(a.sudoku_model, a, device, dtype)
        for r in sudoku:
            print(f"{r['mode']:17} {r['seconds']:8.1f} {r['tps']:8.1f} {sudoku[0]['seconds'] / r['seconds']:8.2f} "
                  f"{r['cell_acc']:8.1f} {r['puzzle_acc']:9.1f} {r['same']:6.3f}")
        rows += [dict(r, shape="sudoku") for r in sudoku]
    return rows


def run(a):
    torch.set_num_threads(a.threads)
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    print(f"sampler: batch {a.batch}, prompt {a.prompt_len}, gen_length {a.gen_length}, block_length "
          f"{a.block_length}, steps {a.steps}, greedy; {a.dtype} on {a.device} ({torch.get_num_threads()} threads); "
          f"median of {a.repeats}, {'process CPU' if a.clock == 'cpu' else 'wall-clock'} time; outputs identical")
    header = (f"{'config':11} {'V':>7} {'D':>5} {'layers':>6} {'ref tok/s':>10} {'ours tok/s':>11} {'speedup':>8} "
              f"{'min-max':>11} {'FLOP x':>7}")
    print(header)
    print("-" * len(header))
    rows = []
    for name, shapes in (SMOKE_CONFIGS if a.smoke else CONFIGS).items():
        r = bench_config(name, shapes, a, device, dtype)
        rows.append(r)
        print(f"{name:11} {shapes['vocab']:7} {shapes['d_model']:5} {shapes['n_layers']:6} {r['ref_tps']:10.1f} "
              f"{r['ours_tps']:11.1f} {r['speedup']:8.2f} {r['speedup_min']:5.2f}-{r['speedup_max']:<5.2f} "
              f"{r['predicted']:7.2f}")
    P, G, blk, steps = 200, 256, 32, 128
    ref_f, ours_f = sampler_flops(LLADA_8B, 1, P, G, blk, steps)
    ref_head = steps * 2 * LLADA_8B["vocab"] * LLADA_8B["d_model"] * (P + G)
    print(f"projection for LLaDA-8B (d_model 4096, 32 layers, mlp 12288, vocab 126464; prompt {P}, gen_length {G}, "
          f"block_length {blk}, steps {steps}, batch 1): {ref_f / 1e12:.0f} vs {ours_f / 1e12:.0f} TFLOP per answer, "
          f"{100 * (1 - ours_f / ref_f):.1f}% saved, {ref_f / ours_f:.3f}x (the head is "
          f"{100 * ref_head / ref_f:.1f}% of the reference's matrix FLOPs)")
    head = next((r for r in rows if r["name"] == "head-heavy"), None)
    if head:
        print(f"targets: head-heavy speedup {head['speedup']:.2f} >= 3: "
              f"{'yes' if head['speedup'] >= 3 else 'NO'}")
    return rows + run_fast(a, device, dtype)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Tokens per second of sample.generate vs the official LLaDA sampler.")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one repetition (seconds)")
    for name, default in DEFAULTS.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"default {default}")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model weights dtype")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    p.add_argument("--clock", choices=("cpu", "wall"), default=None,
                   help="cpu: process CPU time (default on CPU, with --threads 1); wall: wall-clock (CUDA default)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1 with --clock cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sudoku-model", default=None, help="a trained embedded-task model folder (gift.py's default run): "
                                                        "held-out Sudoku accuracy of every fast-sampler mode")
    p.add_argument("--sudoku-puzzles", type=int, default=256, help="held-out puzzles for --sudoku-model")
    a = p.parse_args(argv)
    for k, v in (SMOKE if a.smoke else DEFAULTS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.clock = a.clock or ("wall" if a.device.startswith("cuda") else "cpu")
    if a.threads is None:
        a.threads = 1 if a.clock == "cpu" else torch.get_num_threads()
    return a


def main(argv=None):
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
