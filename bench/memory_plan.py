"""Per-GPU memory of the paper's two recipes at LLaDA-8B's shapes, term by term, for this code; and a check of the
same accounting against measured peaks of small models on the CPU.

    python bench/memory_plan.py            # the two recipes' tables and verdicts for an 80 GB H100
    python bench/memory_plan.py --check    # measured vs predicted step memory at small shapes (~1 min, CPU)
    python bench/memory_plan.py --smoke    # the tables and one tiny check (seconds; tests/test_memory_plan.py)

What a training step keeps alive, counted from model.py's Block.forward (D model width, F MLP width, per token):
  - a block saves for backward: its input, the two RMSNorm outputs before the weight (float32), the two normed
    inputs of the linears, q and k after RoPE, v, the attention output and its reshaped copy, the residual h:
    11 D values; and the MLP's ff_proj output, SiLU output, up_proj output and their product: 4 F values. Under bf16
    autocast the linears' outputs are bf16 (2 bytes), the two RMSNorm intermediates float32 (4 bytes); in float32
    everything is 4 bytes. LoRA adds, per adapted linear, the float32 dropout output (D) and its mask (1 byte / D).
  - activation checkpointing keeps only each block's input, plus one block's activations while it is recomputed.
  - the loss: the hidden states after ln_f (D), then one chunk of gift.CE_CHUNK = 256 positions of float32 logits
    at a time: the logits, their log-softmax and its gradient, 3 x 256 x V x 4 bytes.
  - GIFT's entropy pass runs BEFORE the loss pass, with no autograd graph: its peak (the weights, one block's
    transients, two (256, V) float32 tensors) is separate from the backward peak and smaller, so it adds nothing.
  - weights, gradients and AdamW states (two per trained parameter): LoRA: a bf16 frozen base, float32 adapters,
    their float32 gradients (and DDP's bucket copy of them), float32 AdamW states. Full fine-tuning under FSDP2 on
    N GPUs: float32 master weights, gradients and AdamW states, each sharded N ways (16 bytes / N per parameter),
    plus the bf16 parameters of the blocks being computed (the current one and the prefetched next) and of the
    root (embedding and head, 1.04B parameters, unsharded while used), and the root's unsharded float32 gradients
    before their reduce-scatter.
  - a fixed 3 GiB for the CUDA context, cuBLAS / NCCL workspaces and allocator fragmentation (an assumption).
The terms are summed: an upper bound, since backward frees activations as gradients appear and AdamW allocates its
states only at the first step, when activations are gone. The CPU check compares that same sum, in float32 for one
process (no sharding: the division by N is exact arithmetic), with the memory a step adds in a fresh process
(bench/memory.py's measurement: peak RSS minus the RSS before the step, AdamW states included since it is the first).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's top-level files are plain modules
import memory  # noqa: E402  (bench/memory.py: the measured side)

from gift import CE_CHUNK  # noqa: E402

GiB = 2**30
LLADA_8B = dict(d_model=4096, n_layers=32, n_heads=32, mlp=12288, vocab=126464)
H100_BYTES = 80 * 10**9  # "80 GB": 74.5 GiB
CUDA_OVERHEAD = 3 * GiB


def params(d_model, n_layers, mlp, vocab, **_):
    block = 4 * d_model * d_model + 3 * d_model * mlp  # q, k, v, attn_out; ff_proj, up_proj, ff_out
    norms = 2 * d_model
    return dict(block=block + norms, root=2 * vocab * d_model + d_model,
                total=n_layers * (block + norms) + 2 * vocab * d_model + d_model)


def activation_bytes_per_token(d_model, mlp, act_bytes, norm_bytes, lora_targets=0):
    """What one block saves for backward per token (see the docstring)."""
    return (9 * d_model + 4 * mlp) * act_bytes + 2 * d_model * norm_bytes + lora_targets * d_model * (4 + 1)


def loss_bytes(tokens, d_model, vocab, act_bytes):
    return tokens * d_model * (act_bytes + 4) + 3 * CE_CHUNK * vocab * 4  # ln_f output (+ float32 norm), one chunk


def lora_plan(s, tokens, r, targets=3, checkpointing=False):
    """LoRA under DDP, one GPU holds the whole model: terms in bytes."""
    P = params(**s)
    adapters = s["n_layers"] * targets * r * 2 * s["d_model"]  # A (r, D) and B (D, r) per adapted linear
    per_block = activation_bytes_per_token(s["d_model"], s["mlp"], 2, 4, targets) * tokens
    acts = (s["n_layers"] * tokens * s["d_model"] * 2 + per_block) if checkpointing else s["n_layers"] * per_block
    return [("base weights (bf16, frozen)", 2 * P["total"]), ("adapters (float32)", 4 * adapters),
            ("adapter gradients + DDP bucket", 8 * adapters), ("AdamW states (2 x float32)", 8 * adapters),
            ("activations" + (" (checkpointed)" if checkpointing else ""), acts),
            ("loss: hidden states + one logits chunk", loss_bytes(tokens, s["d_model"], s["vocab"], 2)),
            ("CUDA context, workspaces, fragmentation", CUDA_OVERHEAD)]


def full_plan(s, tokens, world, checkpointing=True):
    """Full fine-tuning under FSDP2 on `world` GPUs: terms in bytes."""
    P = params(**s)
    per_block = activation_bytes_per_token(s["d_model"], s["mlp"], 2, 4) * tokens
    acts = (s["n_layers"] * tokens * s["d_model"] * 2 + per_block) if checkpointing else s["n_layers"] * per_block
    return [("master weights (float32, sharded)", 4 * P["total"] // world),
            ("gradients (float32, sharded)", 4 * P["total"] // world),
            ("AdamW states (2 x float32, sharded)", 8 * P["total"] // world),
            ("bf16 blocks all-gathered (current + prefetch)", 2 * 2 * P["block"]),
            ("bf16 root all-gathered (embedding + head)", 2 * P["root"]),
            ("root gradients before reduce-scatter (float32)", 4 * P["root"]),
            ("activations" + (" (checkpointed)" if checkpointing else ""), acts),
            ("loss: hidden states + one logits chunk", loss_bytes(tokens, s["d_model"], s["vocab"], 2)),
            ("CUDA context, workspaces, fragmentation", CUDA_OVERHEAD)]


def cpu_step_prediction(s, tokens):
    """What one full fine-tuning step adds on one CPU process in float32: gradients, AdamW states, activations and the
    loss (the weights are there before), the quantity bench/memory.py measures."""
    P = params(**s)
    acts = s["n_layers"] * activation_bytes_per_token(s["d_model"], s["mlp"], 4, 4) * tokens
    return 12 * P["total"] + acts + loss_bytes(tokens, s["d_model"], s["vocab"], 4)


def show(title, terms, budget=H100_BYTES):
    total = sum(b for _, b in terms)
    print(f"\n{title}")
    for name, b in terms:
        print(f"  {name:48} {b / GiB:7.2f} GiB")
    verdict = "fits" if total <= budget else "does NOT fit"
    print(f"  {'total':48} {total / GiB:7.2f} GiB -> {verdict} an 80 GB H100 ({budget / GiB:.1f} GiB), "
          f"margin {(budget - total) / GiB:+.1f} GiB")
    return total


CHECKS = [dict(d_model=256, n_heads=4, n_layers=4, mlp=768, vocab=8192, seq=1024),
          dict(d_model=384, n_heads=6, n_layers=2, mlp=1152, vocab=16384, seq=512)]
SMOKE_CHECK = [dict(d_model=64, n_heads=4, n_layers=2, mlp=192, vocab=2048, seq=256)]


def check(shapes):
    """Predicted vs measured memory of one float32 full fine-tuning step (bench/memory.py, variant sft-ours)."""
    print("\ncheck on the CPU: one full fine-tuning step in float32, one process")
    rows = []
    for s in shapes:
        a = memory.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in s.items()])
        measured = memory.measure(a, "sft-ours")
        step = measured["peak"] - measured["before"]
        predicted = cpu_step_prediction(s, s["seq"])
        rows.append((s, predicted, step))
        print(f"  d_model {s['d_model']}, {s['n_layers']} layers, mlp {s['mlp']}, vocab {s['vocab']}, seq {s['seq']}: "
              f"predicted {predicted / 2**20:.0f} MiB, measured {step / 2**20:.0f} MiB, "
              f"measured / predicted {step / predicted:.2f}")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description="Per-GPU memory of the paper's recipes at LLaDA-8B, and its CPU check.")
    p.add_argument("--check", action="store_true", help="also measure small shapes on the CPU (~1 min)")
    p.add_argument("--smoke", action="store_true", help="the tables and one tiny check (seconds)")
    a = p.parse_args(argv)
    s = LLADA_8B
    print(f"LLaDA-8B: {params(**s)['total'] / 1e9:.2f}B parameters; sequence 4096 tokens")
    totals = {
        "lora": show("LoRA on s1K (DDP): r 128 on q/k/v, batch 1 x 4096, bf16, no activation checkpointing",
                     lora_plan(s, 4096, 128)),
        "lora-ckpt": show("the same with --activation-checkpointing", lora_plan(s, 4096, 128, checkpointing=True)),
        "full": show("full fine-tuning on Tulu 3 (FSDP2, 8 GPUs): batch 4 x 4096 per GPU, bf16, activation "
                     "checkpointing", full_plan(s, 4 * 4096, 8)),
        "full-no-ckpt": show("the same without activation checkpointing", full_plan(s, 4 * 4096, 8, False)),
    }
    if a.check or a.smoke:
        check(SMOKE_CHECK if a.smoke else CHECKS)
    return totals


if __name__ == "__main__":
    main()
