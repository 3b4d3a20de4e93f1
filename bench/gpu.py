"""One command for a GPU: the device tests, a training step at LLaDA-8B widths, the sampler's modes, and FSDP2.

    python bench/gpu.py            # on a CUDA machine (~3 min on one H100); writes bench/results/gpu-<device>.json/.md
    python bench/gpu.py --smoke    # the same code on the CPU at tiny shapes (~15 s; tests/test_gpu_bench.py)

  a. tests: tests/test_device.py with `pytest --device cuda` (float32 and bf16 forward, LoRA, the GIFT loss and its
     gradient, greedy sampling, FSDP2 with bf16 and checkpointing, each against a float64 CPU reference).
  b. train: bench/train_step.py at LLaDA-8B widths (d_model 4096, 32 heads, mlp 12288, vocab 126464), bf16 (a bf16
     LoRA base under autocast, as gift.py on a GPU), LoRA r 128 on q/k/v, batch 1 x 4096 tokens (half answer):
     tokens/s, MFU, GIFT / SFT, the K = 4 average of --beta-refresh-epochs, and the peak memory of the GIFT step
     against bench/memory_plan.py's prediction for the same shapes.
  c. sampler: bench/sampler.py's fast-sampler modes (exact, prefix / dual cache, threshold) at d1's evaluation
     shape (prompt 200, gen 256, block 32, 128 steps), bf16, random weights at 8B widths with 8 of 32 layers.
  d. fsdp: one gift.train_step of full fine-tuning (GIFT loss) under FSDP2 on every GPU present (torchrun), 4 of 32
     layers with activation checkpointing; with one GPU a world of 1, still through fully_shard.

MFU = matrix FLOPs of the step (bench/train_step.py's count: bidirectional attention, 4 L D per token per layer
forward, all of it computed) / time / PEAK_TFLOPS. Timing: wall clock, synchronised, medians.
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]  # the repo's top-level files and the other benchmarks, as modules
import memory_plan  # noqa: E402
import sampler  # noqa: E402
import train_step  # noqa: E402
from gift import MicroBatch, setup_distributed, train_step as gift_train_step, wrap_model  # noqa: E402
from model import LLaDA  # noqa: E402

PEAK_TFLOPS = 989.0  # H100 SXM, bf16 dense (no sparsity), NVIDIA's datasheet; the H200's is the same
DEVICE_TESTS = ("tests/test_device.py",)
FULL = dict(d_model=4096, n_heads=32, mlp=12288, vocab=126464, seq=4096, batch=1, lora_r=128, train_layers=32,
            sampler_layers=8, fsdp_layers=4, repeats=5, warmup=2, sampler_batch=2, sampler_repeats=3)
SMOKE = dict(d_model=64, n_heads=4, mlp=192, vocab=512, seq=64, batch=2, lora_r=4, train_layers=2, sampler_layers=2,
             fsdp_layers=2, repeats=1, warmup=1, sampler_batch=2, sampler_repeats=1)
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
    out = subprocess.run(cmd, cwd=BENCH.parent, capture_output=True, text=True)
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
    rows = sampler.bench_fast("d1", shapes, shape, sa, torch.device(a.device), getattr(torch, dtype))
    return dict(layers=shapes["n_layers"], dtype=dtype, batch=sa.batch, **shape, rows=rows)


# -----------------------------------------------------------------------------
# d. FSDP2: one torchrun, a process per GPU


def run_fsdp(a, argv, tmp):
    world = torch.cuda.device_count() if a.device.startswith("cuda") else 1
    out = Path(tmp) / "fsdp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           str(Path(__file__).resolve()), *argv, "--fsdp-worker", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
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


SECTIONS = dict(tests=md_tests, train=md_train, sampler=md_sampler, fsdp=md_fsdp)


def markdown(r):
    lines = [f"# {r['device']}, {r['date']}", "",
             f"`{r['command']}` (torch {r['torch']}; MFU against {r['peak_tflops']:g} TFLOP/s, bf16 dense)"]
    for name, fmt in SECTIONS.items():
        lines += [""] + (fmt(r[name]) if "error" not in r[name] else [f"{name}: FAILED: {r[name]['error']}"])
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description="Device tests, a LLaDA-8B-width training step, the sampler's modes and "
                                "FSDP2 on this machine's GPU(s), in one JSON and one markdown table.")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one repetition (the CPU, seconds)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--out", default=str(BENCH / "results"), help="folder of gpu-<device>.json and .md")
    p.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS,
                   help=f"the MFU's denominator (default {PEAK_TFLOPS:g}: H100 SXM bf16 dense)")
    p.add_argument("--fsdp-worker", default=None, help=argparse.SUPPRESS)  # internal: one torchrun rank's JSON
    a = p.parse_args(argv)
    a.s = SMOKE if a.smoke else FULL
    return a


def run_section(section, fn, a):
    """fn()'s result dict (or its error) with its wall time."""
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as e:  # the other sections still run and are written; the exit status says it
        traceback.print_exc()
        result = dict(error=f"{type(e).__name__}: {str(e)[-1500:]}")
    result["wall_s"] = time.perf_counter() - t0
    print(f"--- {section}: {result['wall_s']:.0f} s", flush=True)
    gc.collect()
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the next section's peak starts from its own tensors
    return result


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    if a.fsdp_worker:
        return fsdp_worker(a, a.fsdp_worker)
    name = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    results = dict(device=name, date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), torch=torch.__version__,
                   command=" ".join(["python bench/gpu.py", *argv]), peak_tflops=a.peak_tflops)
    with tempfile.TemporaryDirectory() as tmp:
        sections = dict(tests=lambda: run_tests(a, tmp), train=lambda: run_train(a), sampler=lambda: run_sampler(a),
                        fsdp=lambda: run_fsdp(a, argv, tmp))
        # --smoke: the two sections that only wait for a subprocess (pytest, torchrun) run in threads beside the
        # others, so that their interpreter start-ups overlap (smoke figures are not timings); on a GPU, one by one
        with ThreadPoolExecutor(2) as background:
            pending = {s: background.submit(run_section, s, sections[s], a) for s in ("tests", "fsdp") if a.smoke}
            done = {s: run_section(s, fn, a) for s, fn in sections.items() if s not in pending}
            done |= {s: f.result() for s, f in pending.items()}
        results |= {s: done[s] for s in sections}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / ("gpu-" + "-".join(name.split()))
    Path(f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    Path(f"{stem}.md").write_text(markdown(results))
    print(markdown(results))
    print(f"wrote {stem}.json and .md")
    if any("error" in results[name] for name in SECTIONS) or results["tests"]["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
