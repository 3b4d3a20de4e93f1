"""One command for a GPU: the device tests, training steps at LLaDA-8B and Dream-7B widths, where a step's time goes,
the sampler at 8B, and FSDP2.

    python bench/gpu.py            # a CUDA machine (~4-5 min on one H100); writes bench/results/gpu-<device>.json/.md
    python bench/gpu.py --sections e,f,g       # some sections only (letters or names, see below)
    python bench/gpu.py --smoke    # the same code on the CPU at tiny shapes (~20 s; tests/test_gpu_bench.py)

Sections run in this order (the ones not measured before first), each on its own: one that fails is recorded with
its traceback and the others still run; the JSON and markdown are rewritten after every section, so a run cut short
keeps what it measured; a section not started --deadline-s seconds after the start is skipped (recorded).

  e. sampler_8b: the exact sampler and the dual cache (refresh every 2 steps, threshold 0.995) with ALL 32 layers at
     LLaDA-8B widths, bf16, random weights (built on the GPU), d1's shape (prompt 200, gen 256, block 32, 128 steps),
     at batch 1, 8, 32 and 64: tokens/s, ms per forward, TFLOP/s, MFU, peak memory. Timed: the LAST k blocks of the
     answer (prompt 456 - 32k, gen 32k, 16k steps): the sequence stays 456 tokens and every block of d1's shape does
     the same work (each step runs the whole sequence, or the cache's block), so tokens/s is the full shape's; k per
     batch in FULL["e_blocks"].
  f. profile: where one GIFT LoRA step at LLaDA-8B widths goes (the e model, LoRA r 128 on q/k/v, 1 x 4096 tokens):
     its phases timed by CUDA events (entropy pass: blocks and head; noise; loss pass: blocks and chunked CE forward;
     backward: the CE chunks, then the blocks; clipping; AdamW), with each phase's matrix FLOPs and TFLOP/s; then
     torch.profiler over one gift.train_step: GPU time by kernel category (matmul, attention, softmax/CE,
     elementwise, reductions, copies, optimizer), the top kernels and the top operators by self GPU time.
  g. dream: one LoRA step (r 128 on q/k/v, 1 x 4096 tokens, bf16, GIFT and SFT) at Dream-v0-7B's widths (d_model
     3584, 28 layers, 28 query / 4 key-value heads, mlp 18944, vocab 152064, q/k/v biases, untied head, shifted
     predictions; bench/memory_plan.dream_7b): ms/step, tokens/s, MFU, GIFT / SFT, and the GIFT step's peak memory
     against bench/memory_plan.py's prediction. (Full fine-tuning of 7.6B with AdamW, ~122 GB, needs FSDP2.)
  b. train: bench/train_step.py at LLaDA-8B widths (d_model 4096, 32 heads, mlp 12288, vocab 126464), bf16 (a bf16
     LoRA base under autocast, as gift.py on a GPU), LoRA r 128 on q/k/v, batch 1 x 4096 tokens (half answer):
     tokens/s, MFU, GIFT / SFT, the K = 4 average of --beta-refresh-epochs, and the peak memory of the GIFT step
     against bench/memory_plan.py's prediction for the same shapes.
  a. tests: tests/test_device.py with `pytest --device cuda` (float32 and bf16 forward, LoRA, the GIFT loss and its
     gradient, greedy sampling, FSDP2 with bf16 and checkpointing, each against a float64 CPU reference).
  d. fsdp: one gift.train_step of full fine-tuning (GIFT loss) under FSDP2 on every GPU present (torchrun), 4 of 32
     layers with activation checkpointing; with one GPU a world of 1, still through fully_shard.
  c. sampler: bench/sampler.py's fast-sampler modes (exact, prefix / dual cache, threshold) at d1's evaluation
     shape (prompt 200, gen 256, block 32, 128 steps), bf16, random weights at 8B widths with 8 of 32 layers, batch 2;
     2 rounds (3 before 2026-11-27), the model now drawn on the GPU (on the CPU it took most of the section's 85 s).

MFU = matrix FLOPs of the step (bench/train_step.py's count: bidirectional attention, 4 L D per token per layer
forward, all of it computed) / time / PEAK_TFLOPS. Timing: wall clock, synchronised, medians.
"""

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]  # the repo's top-level files and the other benchmarks, as modules
import memory_plan  # noqa: E402
import sampler  # noqa: E402
import train_step  # noqa: E402
from gift import (COUNTS, DEFAULT_NORM, MicroBatch, answer_entropy_and_nll, diffusion_loss,  # noqa: E402
                  entropy_betas, mask_answer, objective_batch, predicting_hidden, step_counts,
                  train_step as gift_train_step, wrap_model)
from longjob import setup_distributed  # noqa: E402
from model import LLaDA, LLaDAConfig  # noqa: E402
from sample import SamplerOptions, generate
from cached_sample import generate_cached  # noqa: E402

PEAK_TFLOPS = 989.0  # H100 SXM, bf16 dense (no sparsity), NVIDIA's datasheet; the H200's is the same
DEVICE_TESTS = ("tests/test_device.py",)
FULL = dict(d_model=4096, n_heads=32, mlp=12288, vocab=126464, seq=4096, batch=1, lora_r=128, train_layers=32,
            sampler_layers=8, fsdp_layers=4, repeats=5, warmup=2, sampler_batch=2, sampler_repeats=2,
            # e: batches, answer blocks timed per batch (of d1's 8) and timed repeats per batch; the section stops
            # starting new batches after e_budget_s. f: phase-timed steps (after one warm-up); g: rounds
            llada_layers=32, e_batches=(1, 8, 32, 64), e_blocks={1: 4, 8: 2, 32: 1, 64: 1},
            e_repeats={1: 2, 8: 2, 32: 1, 64: 1}, e_budget_s=150, f_steps=3, g_repeats=3, deadline_s=270)
SMOKE = dict(d_model=64, n_heads=4, mlp=192, vocab=512, seq=64, batch=2, lora_r=4, train_layers=2, sampler_layers=2,
             fsdp_layers=2, repeats=1, warmup=1, sampler_batch=2, sampler_repeats=1,
             llada_layers=2, e_batches=(1, 2), e_blocks={1: 2, 2: 1}, e_repeats={1: 1, 2: 1}, e_budget_s=60,
             f_steps=1, g_repeats=1, deadline_s=0)
# Dream-v0-7B's shape at smoke size (bench/memory_plan.check_config's family "dream": GQA, q/k/v biases, an untied head)
DREAM_SMOKE = dict(d_model=64, n_heads=4, n_layers=2, mlp=192, vocab=512, seq=64, dream_kv_heads=2)
# sections in the order they run (the ones not measured before first), and their letters
ORDER = ("sampler_8b", "profile", "dream", "train", "tests", "fsdp", "sampler")
LETTERS = dict(a="tests", b="train", c="sampler", d="fsdp", e="sampler_8b", f="profile", g="dream")
GiB = 2**30


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(device):
    """Peak of the tensors since the last reset (CUDA), or the process's peak RSS (CPU: smoke only)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else train_step.peak_rss_bytes()


def shape_flags(s, layers):
    return ["--d-model", str(s["d_model"]), "--n-heads", str(s["n_heads"]), "--n-layers", str(layers),
            "--mlp", str(s["mlp"]), "--vocab", str(s["vocab"]), "--seq", str(s["seq"]), "--batch", str(s["batch"]),
            "--lora-r", str(s["lora_r"])]


# -----------------------------------------------------------------------------
# a. the device tests


def run_tests(a, tmp):
    xml = Path(tmp) / "tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *DEVICE_TESTS, "--device", a.device,
           "--junitxml", str(xml)]
    out = subprocess.run(cmd, cwd=BENCH.parent, capture_output=True, text=True, timeout=a.subprocess_timeout_s)
    print(out.stdout[-2000:], out.stderr[-2000:], sep="\n")
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    failed = n["failures"] + n["errors"]
    return dict(files=list(DEVICE_TESTS), device=a.device, passed=n["tests"] - failed - n["skipped"], failed=failed,
                skipped=n["skipped"], seconds=float(suite.get("time")))


# -----------------------------------------------------------------------------
# b. one optimizer step at LLaDA-8B widths (bench/train_step.py), and its memory against the plan


def run_train(a):
    # --smoke: bench/train_step.py's own smoke path, its CPU memory subprocess for the first variant only (one
    # interpreter start instead of five); the memory figure below then falls back to that variant's peak RSS
    ta = train_step.parse_args([*shape_flags(a.s, a.s["train_layers"]), "--device", a.device, "--dtype", "bfloat16",
                                "--modes", "lora", "--repeats", str(a.s["repeats"]), "--warmup", str(a.s["warmup"]),
                                *(["--smoke"] if a.smoke else [])])
    rows = train_step.run(ta)
    tokens = ta.batch * ta.seq
    by = {r["loss"]: dict(r, tokens_per_s=tokens / (r["ms"] / 1e3), mfu=r["gflops_per_s"] / (a.peak_tflops * 1e3))
          for r in rows}
    gift = by["gift"]
    setup = memory_plan.Setup("gpu.py train", train_step.build_config(ta), batch=ta.batch, seq=ta.seq,
                              lora_r=ta.lora_r, a=2, device=torch.device(a.device).type, n_answer=tokens // 2,
                              n_masked=round(gift["n_masked"]))
    plan = memory_plan.plan(setup)
    # CUDA: the GIFT step's peak of allocated tensors; CPU (smoke): a step process's peak RSS, not comparable
    measured = gift.get("peak_mb", next(r["peak_mb"] for r in rows if "peak_mb" in r)) * 2**20
    return dict(layers=ta.n_layers, tokens_per_step=tokens, rows=list(by.values()),
                gift_over_sft=gift["ratio"], gift_predicted=gift["predicted"],
                k4=(gift["ratio"] + 3 * by["gift-reuse"]["ratio"]) / 4,
                memory=dict(kind="allocated" if ta.device.startswith("cuda") else "peak RSS, CPU: not comparable",
                            measured_gib=measured / GiB, plan_gib=plan["tensors"] / GiB,
                            plan_with_overhead_gib=plan["total"] / GiB, ratio=measured / plan["tensors"]))


# -----------------------------------------------------------------------------
# c. the sampler's modes (bench/sampler.py) at d1's evaluation shape


def run_sampler(a):
    dtype = "bfloat16" if a.device.startswith("cuda") else "float32"
    sa = sampler.parse_args(["--device", a.device, "--dtype", dtype, "--batch", str(a.s["sampler_batch"]),
                             "--repeats", str(a.s["sampler_repeats"])])
    shapes = dict(vocab=a.s["vocab"], d_model=a.s["d_model"], n_heads=a.s["n_heads"], n_layers=a.s["sampler_layers"],
                  mlp=a.s["mlp"])
    shape = sampler.SMOKE_FAST_SHAPES["body-heavy"] if a.smoke else sampler.FAST_SHAPES["d1 eval shape"]
    build, sampler.build_model = sampler.build_model, gpu_build_sampler_model  # drawn on the GPU, not the CPU
    try:
        rows = sampler.bench_fast("d1", shapes, shape, sa, torch.device(a.device), getattr(torch, dtype))
    finally:
        sampler.build_model = build
    return dict(layers=shapes["n_layers"], dtype=dtype, batch=sa.batch, **shape, rows=rows)


# -----------------------------------------------------------------------------
# d. FSDP2: one torchrun, a process per GPU


def run_fsdp(a, argv, tmp):
    world = torch.cuda.device_count() if a.device.startswith("cuda") else 1
    out = Path(tmp) / "fsdp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           str(Path(__file__).resolve()), *argv, "--fsdp-worker", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            timeout=a.subprocess_timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"bench/gpu.py: the FSDP2 workers failed:\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def fsdp_worker(a, out):
    """One rank: full fine-tuning of a model built on its device, sharded by gift.wrap_model, gift's step timed."""
    rank, world, device = setup_distributed()  # gift's, from torchrun's environment
    if not dist.is_initialized():  # a world of 1: FSDP2 still needs a process group for its mesh
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    ta = train_step.parse_args([*shape_flags(a.s, a.s["fsdp_layers"]), "--device", str(device), "--dtype",
                                "bfloat16", "--activation-checkpointing"])
    cfg = train_step.build_config(ta)
    with device:  # every rank draws the same weights, on its device
        model = LLaDA(cfg).init_weights(torch.Generator(device).manual_seed(0))
    # gift.wrap_model shards when world > 1; asking for 2 shards a world of 1 too, so FSDP2's path runs on one GPU
    model = wrap_model(model, device, torch.bfloat16, world=max(world, 2), activation_checkpointing=True).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=train_step.LR, weight_decay=0.1)
    input_ids, answer_mask, _ = train_step.build_batch(ta, device)
    times, n_masked = [], []
    for i in range(a.s["warmup"] + a.s["repeats"]):
        if i == a.s["warmup"] and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        t0 = time.perf_counter()
        batch = MicroBatch(input_ids, answer_mask, torch.Generator(device).manual_seed(1000 * rank + i))
        counts = gift_train_step(model, optimizer, [batch], "gift", autocast=train_step.autocast_for(ta))
        sync(device)
        if i >= a.s["warmup"]:
            times.append(time.perf_counter() - t0)
            n_masked.append(counts["n_masked"] / world)
    t, tokens = statistics.median(times), ta.batch * ta.seq
    flops = train_step.step_flops(cfg, "full", ta.batch, ta.seq, tokens // 2, statistics.mean(n_masked),
                                  entropy_pass=True, checkpointing=True)
    plan = memory_plan.plan(memory_plan.Setup("gpu.py fsdp", cfg, batch=ta.batch, seq=ta.seq, a=2, sharding="fsdp2",
                                              world=world, checkpointing=True, device=device.type,
                                              n_answer=tokens // 2, n_masked=round(statistics.mean(n_masked))))
    peaks = [None] * world
    dist.all_gather_object(peaks, peak_bytes(device))
    if rank == 0:
        Path(out).write_text(json.dumps(dict(
            world=world, layers=ta.n_layers, tokens_per_gpu=tokens, ms=1e3 * t, tokens_per_s=world * tokens / t,
            mfu=flops / t / (a.peak_tflops * 1e12), peak_gib=max(peaks) / GiB, plan_gib=plan["tensors"] / GiB,
            ratio=max(peaks) / plan["tensors"])))
    dist.barrier()
    time.sleep(0.2)  # gloo's threads release their last tensors first (gift.main says why)
    dist.destroy_process_group()


# -----------------------------------------------------------------------------
# Models drawn where they run: the meta device, empty storage on the device in the model's dtype, then
# LLaDA.init_weights's normal(0, 0.02) from a generator on that device (8B on a GPU: seconds; on the CPU's one
# generator thread it took minutes). On the CPU in float32: the same weights as LLaDA(cfg).init_weights(Generator())


def model_dtype(a):
    return torch.bfloat16 if a.device.startswith("cuda") else torch.float32


def build_on_device(cfg, device, dtype, seed=0):
    with torch.device("meta"):
        model = LLaDA(cfg).to(dtype)
    model.to_empty(device=device)
    return model.init_weights(torch.Generator(device).manual_seed(seed))


def llada_config(a):
    """LLaDA-8B's widths (FULL) with all its layers, as bench/train_step.py builds them (mask and eos at the top)."""
    return train_step.build_config(SimpleNamespace(d_model=a.s["d_model"], n_heads=a.s["n_heads"],
                                                   n_layers=a.s["llada_layers"], mlp=a.s["mlp"], vocab=a.s["vocab"],
                                                   seq=a.s["seq"]))


def llada_model(a, keep):
    """The model of sections e and f, built once: e samples with it and keeps it when f follows; f takes it (and
    adds LoRA to it in place). Returns (model, seconds spent building it)."""
    t0 = time.perf_counter()
    model = a.shared.pop("llada", None)
    if model is None:
        model = build_on_device(llada_config(a), torch.device(a.device), model_dtype(a))
        sync(torch.device(a.device))
    if keep:
        a.shared["llada"] = model
    return model, time.perf_counter() - t0


def gpu_build_sampler_model(shapes, seed, device, dtype):
    """bench/sampler.build_model's model (same config), drawn on its device (section c; it took 85 s on the CPU)."""
    V = shapes["vocab"]
    cfg = LLaDAConfig(d_model=shapes["d_model"], n_heads=shapes["n_heads"], n_kv_heads=shapes["n_heads"],
                      n_layers=shapes["n_layers"], mlp_hidden_size=shapes["mlp"], vocab_size=V, embedding_size=V,
                      mask_token_id=V - 1, eos_token_id=V - 2, pad_token_id=V - 2)
    return build_on_device(cfg, torch.device(device), dtype, seed).eval()


class Timer:
    """Marks in stream order: CUDA events on a GPU (no sync between marks), synchronised wall clock on the CPU.
    mark(name) ends the phase `name`; phases() gives {name: ms} once the step is done."""

    def __init__(self, device):
        self.cuda, self.marks = device.type == "cuda", []
        self.mark(None)

    def mark(self, name):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append((name, e))
        else:
            self.marks.append((name, time.perf_counter()))

    def phases(self):
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for (_, t0), (name, t1) in zip(self.marks, self.marks[1:]):
            ms = t0.elapsed_time(t1) if self.cuda else 1e3 * (t1 - t0)
            out[name] = out.get(name, 0.0) + ms
        return out


# -----------------------------------------------------------------------------
# e. the sampler at LLaDA-8B with all 32 layers, batch 1 to 64


E_MODES = (("exact", None, None, None), ("dual+refresh2+threshold0.995", "dual", 0.995, 2))  # name, cache, thr, refresh


def run_sampler_8b(a):
    device, dtype = torch.device(a.device), model_dtype(a)
    model, build_s = llada_model(a, keep="profile" in a.sections)
    model.eval()
    cfg = model.config
    shape = sampler.SMOKE_FAST_SHAPES["body-heavy"] if a.smoke else sampler.FAST_SHAPES["d1 eval shape"]
    P, G, blk, steps = shape["prompt_len"], shape["gen_length"], shape["block_length"], shape["steps"]
    L, spb = P + G, steps // (G // blk)  # the sequence (prompt + answer) and the steps per block
    N, D, V, layers = train_step.matmul_params(cfg), cfg.d_model, cfg.embedding_size, cfg.n_layers
    count = dict(forwards=0, flops=0)

    def on_forward(module, args, kwargs):  # S positions run, each attending to all L keys (the cache's or fresh)
        ids = args[0] if args else kwargs["input_ids"]
        count["forwards"] += 1
        count["flops"] += ids.numel() * (2 * N + 4 * L * D * layers)

    def on_head(module, args):  # the head runs at the eligible positions only
        count["flops"] += 2 * V * D * args[0].shape[:-1].numel()

    hooks = [model.register_forward_pre_hook(on_forward, with_kwargs=True),
             model.head.register_forward_pre_hook(on_head)]
    rows, t_start = [], time.perf_counter()
    result = dict(layers=layers, d_model=D, dtype=str(dtype).removeprefix("torch."), build_s=build_s, prompt_len=P,
                  gen_length=G, block_length=blk, steps=steps, steps_per_block=spb, seq=L, rows=rows,
                  note="Random weights predict nearly flat distributions: no confidence reaches 0.995, so the "
                       "threshold mode unmasks one token a step (block_length steps a block against the exact "
                       "sampler's steps / blocks; forwards / block shows it), its worst case.")
    try:
        for B in a.s["e_batches"]:
            k = a.s["e_blocks"][B]
            gen, n_steps = k * blk, k * spb  # the last k blocks of d1's answer: the same 456-token sequence
            if time.perf_counter() - t_start > a.s["e_budget_s"]:
                rows += [dict(batch=B, mode=m, not_run=f"e's budget of {a.s['e_budget_s']} s spent")
                         for m, *_ in E_MODES]
                continue
            try:
                rows += sampler_8b_batch(a, model, B, L, gen, blk, n_steps, count, device, dtype)
            except Exception as e:  # e.g. out of memory at batch 64: the other batches still run
                traceback.print_exc()
                rows += [dict(batch=B, mode=m, error=f"{type(e).__name__}: {str(e)[-800:]}") for m, *_ in E_MODES]
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            a.progress(dict(result, partial=True))  # the JSON keeps the batches done if the run is cut short
    finally:
        for h in hooks:
            h.remove()
    return result


def sampler_8b_batch(a, model, B, L, gen, blk, n_steps, count, device, dtype):
    """Both E_MODES at batch B over the last gen / blk blocks: one untimed warm-up of each mode's forwards (a block
    of 2 steps), then e_repeats timed runs each, alternating."""
    V = model.config.vocab_size
    prompt = torch.randint(0, V - 2, (B, L - gen), generator=torch.Generator().manual_seed(B)).to(device)
    warm_prompt = torch.randint(0, V - 2, (B, L - blk), generator=torch.Generator().manual_seed(B)).to(device)

    def runner(mode, p, g, s):
        _, cache, threshold, refresh = next(m for m in E_MODES if m[0] == mode)
        if cache is None and threshold is None:
            return lambda: generate(model, p, steps=s, gen_length=g, block_length=blk)
        opts = SamplerOptions(cache=cache, threshold=threshold, cache_refresh=refresh, steps=s, gen_length=g,
                              block_length=blk)
        return lambda: generate_cached(model, p, options=opts)

    for mode, cache, *_ in E_MODES:  # warm-up: the full forward and (dual) the block's forward of this batch
        generate_cached(model, warm_prompt, options=SamplerOptions(cache=cache, cache_refresh=2 if cache else None,
                                                                   steps=2, gen_length=blk, block_length=blk))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stats = {m: dict(t=[], forwards=0, flops=0) for m, *_ in E_MODES}
    for r in range(a.s["e_repeats"][B]):
        for mode, *_ in (E_MODES if r % 2 == 0 else E_MODES[::-1]):
            f0, c0 = count["forwards"], count["flops"]
            _, t = sampler.timed(runner(mode, prompt, gen, n_steps), "wall", device)
            stats[mode]["t"].append(t)
            stats[mode]["forwards"], stats[mode]["flops"] = count["forwards"] - f0, count["flops"] - c0
    peak = peak_bytes(device) / GiB
    exact_t = statistics.median(stats["exact"]["t"])
    rows = []
    for mode, st in stats.items():
        t = statistics.median(st["t"])
        rows.append(dict(batch=B, mode=mode, blocks_timed=gen // blk, gen_timed=gen, steps_timed=n_steps,
                         repeats=len(st["t"]), seconds=t, tps=B * gen / t, x_exact=exact_t / t,
                         forwards=st["forwards"], forwards_per_block=st["forwards"] / (gen // blk),
                         ms_per_forward=1e3 * t / max(st["forwards"], 1), tflops=st["flops"] / t / 1e12,
                         mfu=st["flops"] / t / (a.peak_tflops * 1e12), peak_gib=peak))
        print(f"e. batch {B:3} {mode:30} {rows[-1]['tps']:9.1f} tokens/s  {rows[-1]['ms_per_forward']:7.1f} "
              f"ms/forward  MFU {100 * rows[-1]['mfu']:5.1f}%  ({len(st['t'])} x {t:.1f} s)", flush=True)
    return rows


# -----------------------------------------------------------------------------
# f. where one GIFT LoRA step's time goes: its phases (CUDA events), then torch.profiler's kernels


# first match wins; names lower-cased (CUDA kernels on a GPU, aten operators on the CPU)
KERNEL_CATEGORIES = (
    ("attention (SDPA)", ("flash", "fmha", "attention", "sdpa", "scaled_dot_product")),
    ("optimizer / clip (foreach)", ("multi_tensor", "foreach", "adam", "lerp", "norm_stack")),
    ("matmul (GEMM)", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "gemv", "splitk", "aten::mm", "aten::addmm",
                       "aten::bmm", "aten::_addmm")),
    ("softmax / log-softmax / CE", ("softmax", "nll_loss", "cross_entropy", "logsumexp")),
    ("reductions (norms, sums)", ("reduce_kernel", "aten::mean", "aten::sum", "aten::norm", "aten::max", "argmax")),
    ("copies, casts, cat, indexing", ("copy", "catarray", "aten::cat", "index", "gather", "scatter", "memcpy",
                                      "memset", "fill", "nonzero", "masked", "where", "aten::to", "clone",
                                      "contiguous")),
    ("elementwise (RoPE, SiLU, mul, add, rsqrt, dropout)", ("elementwise", "vectorized", "unrolled", "silu", "mul",
                                                            "add", "rsqrt", "pow", "neg", "exp", "dropout",
                                                            "bernoulli", "aten::")),
)


def short_name(name, n=240):
    """A kernel's name without the namespaces that every ATen kernel repeats, so the functor shows."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::", "c10::", "at::"):
        name = name.replace(noise, "")
    return name.replace("|", "/")[:n]


def category(name):
    n = name.lower()
    return next((c for c, keys in KERNEL_CATEGORIES if any(k in n for k in keys)), "other")


def profile_tables(prof, cuda, top=15):
    """GPU time by category, the top kernels, and the top operators by self GPU time (CPU: operators' self CPU time
    throughout, as the smoke run has no kernels)."""
    from torch.autograd import DeviceType
    events = prof.key_averages()
    if cuda:
        kernels = [(e.key, e.count, e.device_time_total) for e in events if e.device_type == DeviceType.CUDA]
        ops = [(e.key, e.count, e.self_device_time_total) for e in events
               if e.device_type == DeviceType.CPU and e.self_device_time_total > 0]
    else:
        kernels = ops = [(e.key, e.count, e.self_cpu_time_total) for e in events if e.key.startswith("aten::")]
    total = sum(t for _, _, t in kernels) or 1
    by = {}
    for name, _, t in kernels:
        by[category(name)] = by.get(category(name), 0.0) + t
    ms = lambda us: us / 1e3  # noqa: E731  (the profiler's unit is microseconds)
    return dict(
        kernel_ms=ms(total), source="CUDA kernels" if cuda else "aten operators' self CPU time (smoke)",
        op_time="self GPU time" if cuda else "self CPU time",
        categories=[dict(category=c, ms=ms(t), share=t / total) for c, t in sorted(by.items(), key=lambda x: -x[1])],
        top_kernels=[dict(name=short_name(n), calls=c, ms=ms(t), share=t / total, category=category(n))
                     for n, c, t in sorted(kernels, key=lambda x: -x[2])[:top]],
        top_ops=[dict(name=n[:100], calls=c, ms=ms(t), share=t / total)
                 for n, c, t in sorted(ops, key=lambda x: -x[2])[:top]])


def run_profile(a):
    device, dtype = torch.device(a.device), model_dtype(a)
    model, build_s = llada_model(a, keep=False)
    r = a.s["lora_r"]
    model = wrap_model(model, device, dtype, world=1, lora=dict(r=r, alpha=2 * r, dropout=0.05,
                                                                targets=("q_proj", "k_proj", "v_proj"))).train()
    core, cfg = model, model.config  # one process: no DDP wrapper
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=train_step.LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    B, L = a.s["batch"], a.s["seq"]
    input_ids, answer_mask, _ = train_step.build_batch(SimpleNamespace(seed=0, vocab=cfg.vocab_size, batch=B, seq=L,
                                                                       prompt_frac=0.5), device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == torch.bfloat16 else \
        contextlib.nullcontext()
    mask_id, norm = cfg.mask_token_id, DEFAULT_NORM["gift"]

    def real_step(i):  # gift.train_step itself
        batch = MicroBatch(input_ids, answer_mask, torch.Generator(device).manual_seed(1000 + i))
        return gift_train_step(model, optimizer, [batch], "gift", grad_clip=train_step.GRAD_CLIP, autocast=autocast)

    def phased_step(i):
        """gift.train_step's body for one micro-batch on one process, a mark after each part."""
        T = Timer(device)
        model.eval()
        with torch.no_grad(), autocast:
            hidden = predicting_hidden(model, mask_answer(input_ids, answer_mask, mask_id))
            T.mark("entropy pass: blocks (no grad)")
            H, _ = answer_entropy_and_nll(hidden, core.head, input_ids, answer_mask)
            beta = entropy_betas(H, answer_mask)
            T.mark("entropy pass: head, log-softmax, entropy")
        model.train()
        del hidden
        mb = MicroBatch(input_ids, answer_mask, torch.Generator(device).manual_seed(1000 + i))
        with autocast:
            mb.beta = beta
            mb.noisy_ids, mb.weight = objective_batch("gift", input_ids, answer_mask, mb.generators, mask_id, beta)
        counts = dict(zip(COUNTS, step_counts([mb], mask_id)))
        T.mark("noise, weights, counts")
        denominator = max(counts["n_masked"], 1.0) if norm == "masked" else counts["n_rows"]
        with autocast:
            hidden = predicting_hidden(model, mb.noisy_ids)
            T.mark("loss pass: blocks forward")
            loss = diffusion_loss(hidden, core.head, input_ids, mb.noisy_ids, mb.weight, answer_mask, mask_id, norm,
                                  denominator)
            T.mark("loss pass: chunked CE forward")
            hidden.register_hook(lambda g: T.mark("backward: CE chunks (head recompute, grad)"))
            loss.backward()
            T.mark("backward: blocks (LoRA)")
        float(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(params, train_step.GRAD_CLIP)
        float(grad_norm)
        T.mark("clip grad norm")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        T.mark("AdamW step")
        return T.phases(), counts

    real_step(0)  # warm-up: allocations, AdamW state, kernels
    phased_step(1)
    phases, n_masked = {}, []
    for i in range(a.s["f_steps"]):
        p, counts = phased_step(2 + i)
        n_masked.append(counts["n_masked"])
        for k, v in p.items():
            phases.setdefault(k, []).append(v)
    real = []
    for i in range(2):
        sync(device)
        t0 = time.perf_counter()
        real_step(10 + i)
        sync(device)
        real.append(time.perf_counter() - t0)
    real_ms = 1e3 * statistics.median(real)

    # matrix FLOPs of each phase (bench/train_step.step_flops's terms; LoRA: the base and head frozen)
    T_, n_answer, nm = B * L, int(answer_mask.sum()), statistics.mean(n_masked)
    body, attn = 2 * train_step.matmul_params(cfg) * T_, 4 * L * cfg.d_model * cfg.n_layers * T_
    adapters, head = 2 * train_step.lora_params(model) * T_, 2 * cfg.embedding_size * cfg.d_model
    flops = {"entropy pass: blocks (no grad)": body + attn + adapters,
             "entropy pass: head, log-softmax, entropy": head * n_answer,
             "loss pass: blocks forward": body + attn + adapters, "loss pass: chunked CE forward": head * nm,
             "backward: CE chunks (head recompute, grad)": 2 * head * nm,
             "backward: blocks (LoRA)": body + 2 * attn + 2 * adapters}
    rows = []
    for name, v in phases.items():
        ms = statistics.median(v)
        f = flops.get(name, 0)
        rows.append(dict(phase=name, ms=ms, tflop=f / 1e12, tflops=f / ms / 1e9 if f else None,
                         mfu=f / ms / 1e9 / a.peak_tflops if f else None))
    total_ms = sum(r["ms"] for r in rows)
    for r_ in rows:
        r_["share"] = r_["ms"] / total_ms

    # torch.profiler over one gift.train_step
    step_flops = sum(flops.values())
    result = dict(layers=cfg.n_layers, d_model=cfg.d_model, tokens=T_, lora_r=r, build_s=build_s,
                  clock="CUDA events" if device.type == "cuda" else "wall clock", steps_timed=len(n_masked),
                  n_masked=nm, phases=rows, phases_ms=total_ms, train_step_ms=real_ms, step_tflop=step_flops / 1e12,
                  mfu=step_flops / (real_ms / 1e3) / (a.peak_tflops * 1e12))
    try:  # the phases above stand without the profiler (CUPTI missing, say)
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        sync(device)
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            real_step(20)
            sync(device)
        profiled_ms = 1e3 * (time.perf_counter() - t0)
        tables = profile_tables(prof, device.type == "cuda")
        if not tables["top_kernels"]:
            raise RuntimeError("the profiler recorded no kernels (CUPTI unavailable?)")
        result.update(profiled_step_ms=profiled_ms, busy_share=tables["kernel_ms"] / profiled_ms, **tables)
        if a.profile_trace:
            prof.export_chrome_trace(str(Path(a.out) / "gift-step-trace.json"))
    except Exception as e:
        traceback.print_exc()
        result["profiler_error"] = f"{type(e).__name__}: {str(e)[-800:]}"
    return result


# -----------------------------------------------------------------------------
# g. one LoRA step at Dream-v0-7B's widths, GIFT and SFT


def run_dream(a):
    device, dtype = torch.device(a.device), model_dtype(a)
    cfg = memory_plan.check_config(DREAM_SMOKE, "dream") if a.smoke else memory_plan.dream_7b()
    B, L, r = a.s["batch"], a.s["seq"], a.s["lora_r"]
    t0 = time.perf_counter()
    model = build_on_device(cfg, device, dtype)
    model = wrap_model(model, device, dtype, world=1, lora=dict(r=r, alpha=2 * r, dropout=0.05,
                                                                targets=("q_proj", "k_proj", "v_proj"))).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=train_step.LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    sync(device)
    build_s = time.perf_counter() - t0
    # tokens below every special id (Dream's mask 151666 and pad / eos 151643 sit inside its vocabulary)
    top = min(cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, top, (B, L), generator=g).to(device)
    answer_mask = (torch.arange(L)[None].expand(B, -1) >= L // 2).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == torch.bfloat16 else \
        contextlib.nullcontext()
    steps = {loss: train_step.make_step(loss, model, optimizer, input_ids, answer_mask, None, autocast)
             for loss in ("sft", "gift")}
    times, n_masked, peak = {k: [] for k in steps}, {k: [] for k in steps}, 0
    for loss, step in steps.items():  # warm-up
        step(0)
    for i in range(a.s["g_repeats"]):
        for loss in (("sft", "gift") if i % 2 == 0 else ("gift", "sft")):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync(device)
            t0 = time.perf_counter()
            n = steps[loss](1 + i)
            sync(device)
            times[loss].append(time.perf_counter() - t0)
            n_masked[loss].append(n)
            if loss == "gift":
                peak = max(peak, peak_bytes(device))
    tokens, n_lora = B * L, train_step.lora_params(model)
    rows = []
    for loss in steps:
        t = statistics.median(times[loss])
        f = train_step.step_flops(cfg, "lora", B, L, tokens // 2, statistics.mean(n_masked[loss]),
                                  entropy_pass=loss == "gift", n_lora=n_lora)
        rows.append(dict(loss=loss, ms=1e3 * t, tokens_per_s=tokens / t, tflops=f / t / 1e12,
                         mfu=f / t / (a.peak_tflops * 1e12), flops=f, n_masked=statistics.mean(n_masked[loss])))
    sft, gift_row = rows
    ratios = [g_ / s_ for g_, s_ in zip(times["gift"], times["sft"])]
    plan = memory_plan.plan(memory_plan.Setup("gpu.py dream", cfg, batch=B, seq=L, lora_r=r, a=2,
                                              device=device.type, n_answer=tokens // 2,
                                              n_masked=round(gift_row["n_masked"])))
    counts = memory_plan.param_counts(cfg)
    return dict(params=counts["total"], layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
                n_kv_heads=cfg.n_kv_heads, mlp=cfg.mlp_hidden_size, vocab=cfg.embedding_size, tokens_per_step=tokens,
                lora_r=r, dtype=str(dtype).removeprefix("torch."), build_s=build_s, rows=rows,
                gift_over_sft=statistics.median(ratios),
                gift_predicted=gift_row["flops"] / sft["flops"],
                memory=dict(kind="allocated" if device.type == "cuda" else "peak RSS, CPU: not comparable",
                            measured_gib=peak / GiB, plan_gib=plan["tensors"] / GiB,
                            plan_with_overhead_gib=plan["total"] / GiB, ratio=peak / plan["tensors"]))


# -----------------------------------------------------------------------------
# The report: one JSON and one markdown table, named after the device


def md_tests(x):
    return [f"a. tests ({', '.join(x['files'])}, --device {x['device']}): {x['passed']} passed, {x['failed']} failed, "
            f"{x['skipped']} skipped"]


def md_train(t):
    m = t["memory"]
    return ([f"b. one LoRA step, {t['layers']} of 32 layers, {t['tokens_per_step']} tokens, bf16:", "",
             "| loss | ms/step | tokens/s | TFLOP/s | MFU | x SFT | FLOP-predicted x |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"] +
            [f"| {x['loss']} | {x['ms']:.1f} | {x['tokens_per_s']:.0f} | {x['gflops_per_s'] / 1e3:.0f} | "
             f"{100 * x['mfu']:.1f}% | {x['ratio']:.3f} | {x['predicted']:.3f} |" for x in t["rows"]] +
            ["", f"GIFT / SFT {t['gift_over_sft']:.3f} (predicted {t['gift_predicted']:.3f}); K = 4 (gift + 3 "
             f"gift-reuse) / 4 = {t['k4']:.3f}; peak memory of the GIFT step ({m['kind']}) {m['measured_gib']:.2f} GiB "
             f"vs bench/memory_plan.py's {m['plan_gib']:.2f} GiB of tensors ({m['ratio']:.2f}x; "
             f"{m['plan_with_overhead_gib']:.2f} GiB with its assumed overhead)"])


def md_sampler(x):
    return ([f"c. sampler, {x['layers']} of 32 layers, {x['dtype']}, batch {x['batch']}, prompt {x['prompt_len']}, "
             f"gen {x['gen_length']}, block {x['block_length']}, {x['steps']} steps:", "",
             "| mode | tokens/s | x exact | tokens as exact |", "| --- | ---: | ---: | ---: |"] +
            [f"| {r['mode']} | {r['tps']:.1f} | {r['speedup']:.2f} | {r['agreement']:.3f} |" for r in x["rows"]])


def md_fsdp(f):
    return [f"d. FSDP2, world {f['world']}, {f['layers']} of 32 layers, full fine-tuning, GIFT, checkpointing: "
            f"{f['ms']:.0f} ms/step, {f['tokens_per_s']:.0f} tokens/s, MFU {100 * f['mfu']:.1f}%, peak "
            f"{f['peak_gib']:.2f} GiB vs plan {f['plan_gib']:.2f} GiB ({f['ratio']:.2f}x)"]


def md_sampler_8b(x):
    lines = [f"e. sampler, {x['layers']} layers, d_model {x['d_model']}, {x['dtype']}, random weights (model built "
             f"in {x['build_s']:.0f} s), d1's shape: prompt {x['prompt_len']}, gen {x['gen_length']}, block "
             f"{x['block_length']}, {x['steps']} steps ({x['steps_per_block']} a block); timed: the last k blocks of "
             f"the answer (prompt {x['seq']} - k x {x['block_length']}: the same {x['seq']}-token sequence, the same "
             f"work per block), tokens/s = generated tokens / wall time; TFLOP/s counts the blocks, attention and "
             "head run:", "",
             "| batch | mode | blocks timed x runs | tokens/s | x exact | forwards / block | ms / forward | TFLOP/s "
             "| MFU | peak GiB |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in x["rows"]:
        if "tps" not in r:
            lines.append(f"| {r['batch']} | {r['mode']} | {r.get('error') or r.get('not_run')} | | | | | | | |")
            continue
        lines.append(f"| {r['batch']} | {r['mode']} | {r['blocks_timed']} x {r['repeats']} | {r['tps']:.1f} | "
                     f"{r['x_exact']:.2f} | {r['forwards_per_block']:.0f} | {r['ms_per_forward']:.1f} | "
                     f"{r['tflops']:.0f} | {100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} |")
    return lines + ["", x["note"]]


def md_profile(x):
    fmt = lambda v, f: "" if v is None else f.format(v)  # noqa: E731
    lines = [f"f. one GIFT LoRA step, {x['layers']} layers, d_model {x['d_model']}, {x['tokens']} tokens, r "
             f"{x['lora_r']} on q/k/v: gift.train_step {x['train_step_ms']:.0f} ms ({x['step_tflop']:.1f} TFLOP, MFU "
             f"{100 * x['mfu']:.1f}%); its phases (median of {x['steps_timed']}, {x['clock']}) sum to "
             f"{x['phases_ms']:.0f} ms:", "", "| phase | ms | share | TFLOP | TFLOP/s | MFU |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['phase']} | {r['ms']:.1f} | {100 * r['share']:.1f}% | {r['tflop']:.1f} | "
              f"{fmt(r['tflops'], '{:.0f}')} | {fmt(r['mfu'] and 100 * r['mfu'], '{:.1f}%')} |" for r in x["phases"]]
    if "profiler_error" in x:
        return lines + ["", f"torch.profiler: FAILED: {x['profiler_error']}"]
    lines += ["", f"torch.profiler, one step ({x['profiled_step_ms']:.0f} ms under the profiler): {x['source']} "
              f"{x['kernel_ms']:.0f} ms ({100 * x['busy_share']:.0f}% of the step), by category:", "",
              "| category | ms | share |", "| --- | ---: | ---: |"]
    lines += [f"| {c['category']} | {c['ms']:.1f} | {100 * c['share']:.1f}% |" for c in x["categories"]]
    lines += ["", "Top kernels:", "", "| kernel | calls | ms | share | category |",
              "| --- | ---: | ---: | ---: | --- |"]
    lines += [f"| `{k['name'][:110]}` | {k['calls']} | {k['ms']:.1f} | {100 * k['share']:.1f}% | {k['category']} |"
              for k in x["top_kernels"]]
    lines += ["", f"Top operators by {x['op_time']}:", "", "| operator | calls | ms | share |",
              "| --- | ---: | ---: | ---: |"]
    lines += [f"| `{o['name']}` | {o['calls']} | {o['ms']:.1f} | {100 * o['share']:.1f}% |" for o in x["top_ops"]]
    return lines


def md_dream(d):
    m = d["memory"]
    return ([f"g. one LoRA step at Dream-v0-7B widths ({d['params'] / 1e9:.2f}B parameters: {d['layers']} layers, "
             f"d_model {d['d_model']}, {d['n_heads']} query / {d['n_kv_heads']} key-value heads, mlp {d['mlp']}, vocab "
             f"{d['vocab']}, q/k/v biases, untied head, shifted), r {d['lora_r']} on q/k/v, {d['tokens_per_step']} "
             f"tokens, {d['dtype']} (model built in {d['build_s']:.0f} s):", "",
             "| loss | ms/step | tokens/s | TFLOP/s | MFU |", "| --- | ---: | ---: | ---: | ---: |"] +
            [f"| {x['loss']} | {x['ms']:.1f} | {x['tokens_per_s']:.0f} | {x['tflops']:.0f} | {100 * x['mfu']:.1f}% |"
             for x in d["rows"]] +
            ["", f"GIFT / SFT {d['gift_over_sft']:.3f} (FLOP-predicted {d['gift_predicted']:.3f}); peak memory of the "
             f"GIFT step ({m['kind']}) {m['measured_gib']:.2f} GiB vs bench/memory_plan.py's {m['plan_gib']:.2f} GiB "
             f"of tensors ({m['ratio']:.2f}x; {m['plan_with_overhead_gib']:.2f} GiB with its assumed overhead). Full "
             "fine-tuning (float32 weights, gradients and AdamW: ~16 bytes a parameter) does not fit one GPU."])


SECTIONS = dict(tests=md_tests, train=md_train, sampler=md_sampler, fsdp=md_fsdp, sampler_8b=md_sampler_8b,
                profile=md_profile, dream=md_dream)


def markdown(r):
    lines = [f"# {r['device']}, {r['date']}", "",
             f"`{r['command']}` (torch {r['torch']}; MFU against {r['peak_tflops']:g} TFLOP/s, bf16 dense)"]
    for name in ORDER:
        if name not in r:
            continue
        x, letter = r[name], next(k for k, v in LETTERS.items() if v == name)
        if "error" in x:
            body = [f"{letter}. {name}: FAILED after {x['wall_s']:.0f} s: {x['error']}"]
        elif "not_run" in x:
            body = [f"{letter}. {name}: skipped ({x['not_run']})"]
        elif "wall_s" not in x and "partial" not in x:
            body = [f"{letter}. {name}: not finished (started {x.get('started_s', 0):.0f} s after the start)"]
        else:
            took = f"({letter}. took {x['wall_s']:.0f} s)" if "wall_s" in x else f"({letter}. NOT FINISHED: so far)"
            try:
                body = SECTIONS[name](x) + ["", took]
            except Exception as e:  # a figure missing from a section's result: the JSON still has the rest
                body = [f"{letter}. {name}: could not be formatted ({type(e).__name__}: {e}); see the JSON"]
        lines += [""] + body
    return "\n".join(lines) + "\n"


def parse_sections(text):
    names = [LETTERS.get(x.strip(), x.strip()) for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in ORDER]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{bad or 'none'}: give letters {','.join(LETTERS)} or names "
                                         f"{','.join(ORDER)}")
    return [x for x in ORDER if x in names]  # always in ORDER (e's model is f's)


def parse_args(argv):
    p = argparse.ArgumentParser(description="Device tests, LLaDA-8B- and Dream-7B-width training steps, a LoRA step's "
                                "profile, the sampler at 8B, and FSDP2 on this machine's GPU(s), in one JSON and one "
                                "markdown table.")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one repetition (the CPU, seconds)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--out", default=str(BENCH / "results"), help="folder of gpu-<device>.json and .md")
    p.add_argument("--sections", type=parse_sections, default=list(ORDER),
                   help="comma-separated letters or names, run in the order " + ",".join(
                       next(k for k, v in LETTERS.items() if v == n) for n in ORDER) +
                   " whatever the order given (" + ", ".join(f"{k} {v}" for k, v in sorted(LETTERS.items())) + ")")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="skip a section not started this many seconds after the start (0: never; default 270 on a "
                        "GPU, 0 with --smoke)")
    p.add_argument("--subprocess-timeout-s", type=float, default=None,
                   help="the device tests' and the FSDP2 torchrun's limit each (default 180; --smoke 300)")
    p.add_argument("--profile-trace", action="store_true", help="f: also write the profiled step's chrome trace to "
                   "--out/gift-step-trace.json (tens of MB)")
    p.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS,
                   help=f"the MFU's denominator (default {PEAK_TFLOPS:g}: H100 SXM bf16 dense)")
    p.add_argument("--fsdp-worker", default=None, help=argparse.SUPPRESS)  # internal: one torchrun rank's JSON
    a = p.parse_args(argv)
    a.s = SMOKE if a.smoke else FULL
    a.deadline_s = a.s["deadline_s"] if a.deadline_s is None else a.deadline_s
    a.subprocess_timeout_s = a.subprocess_timeout_s or (300 if a.smoke else 180)
    a.shared = {}  # the model sections e and f share
    a.progress = lambda partial: None  # main: writes a section's partial result
    return a


def run_section(section, fn, a):
    """fn()'s result dict (or its error, with its traceback) with its wall time."""
    t0 = time.perf_counter()
    print(f"--- {section}: starting, {t0 - a.t_start:.0f} s after the start", flush=True)
    try:
        result = fn()
    except Exception as e:  # the other sections still run and are written; the exit status says it
        traceback.print_exc()
        result = dict(error=f"{type(e).__name__}: {str(e)[-1500:]}", traceback=traceback.format_exc()[-6000:])
    result["wall_s"] = time.perf_counter() - t0
    print(f"--- {section}: {result['wall_s']:.0f} s ({time.perf_counter() - a.t_start:.0f} s in all)", flush=True)
    gc.collect()
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the next section's peak starts from its own tensors
    return result


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    if a.fsdp_worker:
        return fsdp_worker(a, a.fsdp_worker)
    a.t_start = time.perf_counter()
    name = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    results = dict(device=name, date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), torch=torch.__version__,
                   command=" ".join(["python bench/gpu.py", *argv]), peak_tflops=a.peak_tflops,
                   sections=a.sections)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / ("gpu-" + "-".join(name.split()))
    lock = threading.Lock()

    def write(section=None, result=None):  # after every section: a run cut short keeps what it measured
        with lock:  # (--smoke: two sections finish in threads)
            if section:
                results[section] = result
            Path(f"{stem}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
            Path(f"{stem}.md").write_text(markdown(results))

    def section(s, fn):
        write(s, dict(started_s=time.perf_counter() - a.t_start))  # "not finished" if the run is cut short
        if a.deadline_s and time.perf_counter() - a.t_start > a.deadline_s:
            result = dict(not_run=f"not started by --deadline-s {a.deadline_s:g}", wall_s=0.0)
            print(f"--- {s}: skipped, past --deadline-s {a.deadline_s:g}", flush=True)
        else:
            if s == "sampler_8b":  # the main thread's section that writes its batches as they finish
                a.progress = lambda partial: write(s, dict(partial, started_s=results[s].get("started_s")))
            result = run_section(s, fn, a)
        write(s, result)

    with tempfile.TemporaryDirectory() as tmp:
        fns = dict(tests=lambda: run_tests(a, tmp), train=lambda: run_train(a), sampler=lambda: run_sampler(a),
                   fsdp=lambda: run_fsdp(a, argv, tmp), sampler_8b=lambda: run_sampler_8b(a),
                   profile=lambda: run_profile(a), dream=lambda: run_dream(a))
        # --smoke: the two sections that only wait for a subprocess (pytest, torchrun) run in threads beside the
        # others, so that their interpreter start-ups overlap (smoke figures are not timings); on a GPU, one by one
        with ThreadPoolExecutor(2) as background:
            pending = [background.submit(section, s, fns[s]) for s in ("tests", "fsdp") if a.smoke and s in a.sections]
            for s in a.sections:
                if not (a.smoke and s in ("tests", "fsdp")):
                    section(s, fns[s])
            for f in pending:
                f.result()
    results["total_s"] = time.perf_counter() - a.t_start
    write()
    print(markdown(results))
    print(f"wrote {stem}.json and .md ({results['total_s']:.0f} s)")
    tests = results.get("tests", {})
    if any("error" in results[s] for s in a.sections) or tests.get("failed"):
        sys.exit(1)


if __name__ == "__main__":
    main()
