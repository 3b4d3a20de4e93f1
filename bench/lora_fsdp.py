"""LoRA on a base sharded by FSDP2 (gift.py --lora --parallel fsdp) against DDP's layout, on one GPU at LLaDA-8B's
widths: the peak memory and the time of a step, and bench/memory_plan.py's prediction for each layout.

    python bench/lora_fsdp.py             # one GPU, LLaDA-8B's shapes (32 layers, bf16 base: 16 GiB), < 3 minutes
    python bench/lora_fsdp.py --smoke     # tiny shapes on the CPU, seconds (tests/test_lora_fsdp.py runs it)

One process (world 1, a process group of one). Both layouts build the model on the meta device, give it empty bf16
storage on the GPU and fill it with random weights (normal(0, 0.02): the memory and the time do not depend on the
values; no checkpoint is read), add the adapters (gift.wrap_model: the paper's r 128, alpha 256, dropout 0.05 on
q_proj, k_proj, v_proj), then wrap it as gift.py does on W GPUs: DDP (the whole base on every GPU, gradient buckets),
or FSDP2 one group per block, then the root (gift.fsdp_shard; at world 1 each group is gathered into buffers of its
own, as on W GPUs). The step is gift.train_step with the gift loss (its entropy pass included), batch 1 x --seq,
half answer, accumulation 2, bf16 autocast: one warm-up step (AdamW creates its states), then --steps measured steps.
Peak: torch.cuda.max_memory_allocated over the measured steps (the tensors) and max_memory_reserved (what the
caching allocator held), against the plan's tensors and its total (its assumed CUDA overhead and fragmentation
included). Writes bench/results/lora_fsdp.json and .md (--out).
"""

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's top-level files are plain modules
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gift import MicroBatch, fsdp_shard, train_step, wrap_model  # noqa: E402
from memory_plan import GiB, Setup, llada_8b, plan  # noqa: E402
from model import LLaDA, LLaDAConfig  # noqa: E402

LORA = dict(r=128, alpha=256.0, dropout=0.05, targets=("q_proj", "k_proj", "v_proj"))  # the paper's recipe
SMOKE = dict(d_model=64, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=192, vocab_size=512,
             embedding_size=512, mask_token_id=511, eos_token_id=510, pad_token_id=510)


def build(cfg, layout, device, checkpointing, r, seed=0):
    """The model of one layout: meta -> empty bf16 storage on `device` -> random weights -> adapters -> DDP or
    FSDP2."""
    with torch.device("meta"):
        model = LLaDA(cfg).to(torch.bfloat16)
    model.to_empty(device=device)  # 16 GiB at LLaDA-8B's shapes, never float32
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    lora = dict(LORA, r=r, alpha=2.0 * r)
    model = wrap_model(model, device, torch.bfloat16, 1, lora, checkpointing, seed)
    if layout == "fsdp":
        return fsdp_shard(model, device, None, one_group_max=0)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def measure(cfg, layout, device, seq, steps, checkpointing, r):
    """Peak memory and seconds of `steps` LoRA steps after a warm-up step; returns a dict."""
    model = build(cfg, layout, device, checkpointing, r)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    micro = []
    for i in range(2):  # accumulation 2, as the recipe
        ids = torch.randint(0, cfg.vocab_size - 2, (1, seq), generator=gen).to(device)
        answer = (torch.arange(seq, device=device) >= seq // 2)[None]  # (1, L) half answer
        micro.append(MicroBatch(ids, answer, [torch.Generator().manual_seed(10 + i)]))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    cuda = device.type == "cuda"
    train_step(model, optimizer, micro, "gift", autocast=autocast)  # warm-up: AdamW's states are made here
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    for _ in range(steps):
        result = train_step(model, optimizer, micro, "gift", autocast=autocast)
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.time() - t0) / steps
    out = dict(layout=layout, step_s=round(seconds, 3), n_masked=result["n_masked"] / len(micro), lora_r=r,
               peak_allocated_gib=torch.cuda.max_memory_allocated() / GiB if cuda else None,
               peak_reserved_gib=torch.cuda.max_memory_reserved() / GiB if cuda else None)
    s = Setup(layout, cfg, batch=1, seq=seq, lora_r=r, a=2, sharding="fsdp2" if layout == "fsdp" else "ddp",
              world=1, checkpointing=checkpointing, grad_accum=len(micro), device="cuda", n_answer=seq // 2,
              n_masked=round(out["n_masked"]))
    p = plan(s)
    out.update(planned_tensors_gib=p["tensors"] / GiB, planned_total_gib=p["total"] / GiB, planned_peak=p["peak"])
    del model, optimizer, micro
    if cuda:
        torch.cuda.empty_cache()
    return out


def report(rows, args, device):
    lines = [f"# LoRA: FSDP2-sharded base vs DDP, one {device} (world 1)", "",
             f"LLaDA-8B widths{' (smoke: tiny shapes)' if args.smoke else ''}, {args.layers} layers, bf16 base, "
             f"LoRA r {rows[0]['lora_r']} on q/k/v, batch 1 x {args.seq}, half answer, accumulation 2, loss gift, "
             f"activation checkpointing {'on' if args.checkpointing else 'off'}; {args.steps} measured steps after "
             "a warm-up step.", "",
             "| layout | step (s) | peak allocated (GiB) | planned tensors (GiB) | ratio | peak reserved (GiB) | "
             "planned total (GiB) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        alloc, res = r["peak_allocated_gib"], r["peak_reserved_gib"]
        ratio = f"{alloc / r['planned_tensors_gib']:.2f}" if alloc else "-"
        lines.append(f"| {r['layout']} | {r['step_s']:.3f} | {alloc or 0:.2f} | {r['planned_tensors_gib']:.2f} | "
                     f"{ratio} | {res or 0:.2f} | {r['planned_total_gib']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description="LoRA step on an FSDP2-sharded base vs DDP on one GPU at LLaDA-8B's "
                                "widths: peak memory, step time, and bench/memory_plan.py's prediction")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (seconds): the code runs")
    p.add_argument("--layers", type=int, default=32, help="blocks (LLaDA-8B: 32)")
    p.add_argument("--seq", type=int, default=4096, help="sequence length")
    p.add_argument("--steps", type=int, default=3, help="measured steps after the warm-up step")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="folder for the results")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.seq, args.steps = 2, 64, 1
        cfg, device = LLaDAConfig(**SMOKE), torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            p.error("no GPU: run it on one, or give --smoke")
        cfg, device = llada_8b(), torch.device("cuda", 0)
        cfg.n_layers = args.layers
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1, **(dict(device_id=device) if device.type == "cuda" else {}))
    try:
        rows = []
        for layout in ("ddp", "fsdp"):
            rows.append(measure(cfg, layout, device, args.seq, args.steps, args.checkpointing,
                                4 if args.smoke else LORA["r"]))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "lora_fsdp_smoke" if args.smoke else "lora_fsdp"
    result = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", args=vars(args),
                  rows=rows)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(report(rows, args, result["device"]))
    print(report(rows, args, result["device"]))
    return result


if __name__ == "__main__":
    main()
