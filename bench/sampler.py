"""Tokens per second of sample.generate against the official LLaDA sampler, same model, same tokens.

    python bench/sampler.py             # head-heavy (vocab 126464, d_model 128) and body-heavy configs, CPU
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

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's top-level files are plain modules
from model import LLaDA, LLaDAConfig  # noqa: E402
from sample import generate  # noqa: E402

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
SMOKE = dict(batch=2, prompt_len=8, gen_length=32, block_length=8, steps=16, repeats=1)

# -----------------------------------------------------------------------------
# The reference: the official generate.py, line for line. Changed, marked "# changed": the random draws take a
# generator; CFG without an attention mask passes None (the official code raises a NameError there); the model
# returns logits itself instead of an output object with .logits; tensors go to the prompt's device.


def official_add_gumbel_noise(logits, temperature, generator=None):
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    noise = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)  # changed
    gumbel_noise = (- torch.log(noise)) ** temperature
    return logits.exp() / gumbel_noise


def official_get_num_transfer_tokens(mask_index, steps):
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base = mask_num // steps
    remainder = mask_num % steps
    num_transfer_tokens = torch.zeros(mask_num.size(0), steps, device=mask_index.device, dtype=torch.int64) + base
    for i in range(mask_num.size(0)):
        num_transfer_tokens[i, :remainder[i]] += 1
    return num_transfer_tokens


@torch.no_grad()
def official_generate(model, prompt, attention_mask=None, steps=128, gen_length=128, block_length=128,
                      temperature=0., cfg_scale=0., remasking='low_confidence', mask_id=126336, generator=None):
    device = prompt.device  # changed: model.device
    x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long).to(device)
    x[:, :prompt.shape[1]] = prompt.clone()
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, torch.ones((prompt.shape[0], gen_length),
                                                               dtype=attention_mask.dtype, device=device)], dim=-1)
    prompt_index = (x != mask_id)
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps = steps // num_blocks
    for num_block in range(num_blocks):
        block_mask_index = (x[:, prompt.shape[1] + num_block * block_length:
                              prompt.shape[1] + (num_block + 1) * block_length:] == mask_id)
        num_transfer_tokens = official_get_num_transfer_tokens(block_mask_index, steps)
        for i in range(steps):
            mask_index = (x == mask_id)
            if cfg_scale > 0.:
                un_x = x.clone()
                un_x[prompt_index] = mask_id
                x_ = torch.cat([x, un_x], dim=0)
                attention_mask_ = None  # changed
                if attention_mask is not None:
                    attention_mask_ = torch.cat([attention_mask, attention_mask], dim=0)
                logits = model(x_, attention_mask=attention_mask_)  # changed: no .logits
                logits, un_logits = torch.chunk(logits, 2, dim=0)
                logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
            else:
                logits = model(x, attention_mask=attention_mask)  # changed: no .logits
            logits_with_noise = official_add_gumbel_noise(logits, temperature=temperature, generator=generator)
            x0 = torch.argmax(logits_with_noise, dim=-1)  # b, l
            if remasking == 'low_confidence':
                p = F.softmax(logits, dim=-1)
                x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)  # b, l
            elif remasking == 'random':
                x0_p = torch.rand((x0.shape[0], x0.shape[1]), device=x0.device, generator=generator)  # changed
            else:
                raise NotImplementedError(remasking)
            x0_p[:, prompt.shape[1] + (num_block + 1) * block_length:] = -np.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -np.inf)
            transfer_index = torch.zeros_like(x0, dtype=torch.bool, device=x0.device)
            for j in range(confidence.shape[0]):
                _, select_index = torch.topk(confidence[j], k=num_transfer_tokens[j, i])
                transfer_index[j, select_index] = True
            x[transfer_index] = x0[transfer_index]
    return x


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
    return rows


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
