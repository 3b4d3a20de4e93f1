"""Peak memory of one training step at LLaDA's vocabulary: gift.py's loss against full (B, L, V) logits.

    python bench/memory.py                  # vocab 126464, seq 2048, d_model 128, 2 layers, batch 1, full FT, CPU
    python bench/memory.py --lora           # LoRA (no gradients or AdamW state for the big matrices)
    python bench/memory.py --chunk-size 1024 # what a larger gift.CE_CHUNK would cost
    python bench/memory.py --smoke          # tiny shapes (tests/test_bench.py runs this)
    python bench/memory.py --device cuda --dtype bfloat16

At vocabulary V = 126464 one float32 logit row costs 0.5 MB, so a (1, 2048, V) logits tensor is 1 GB before its
log-softmax and gradient. gift.py never builds it: diffusion_loss runs the head on the hidden states of the masked
answer positions only, a chunk of positions at a time, recomputing each chunk in backward; the entropy pass of
GIFT (Algorithm 1) runs the head on the answer positions only, a chunk at a time, with no autograd graph. The naive
versions below do what common trainers do (LLaDA's SFT guidelines, most GIFT-style code): logits = model(x) over
every position in float32, then index.

Each variant runs in a fresh subprocess, so that one variant's peak cannot hide another's: the process builds the
model, its AdamW and the batch, notes its memory ("before"), runs the variant once and reports its peak (CPU: peak
RSS, /proc VmHWM on Linux, getrusage elsewhere; CUDA: torch.cuda.max_memory_allocated). "idle" runs nothing: the
baseline of a process with the model loaded. "+step" = peak - before is the memory the step itself adds
(activations, logits, gradients, AdamW state), and the ratio ours / naive is given for the whole process and for
the step's own memory.
  sft-*:      objective_batch("sft") + the loss + backward + AdamW step
  gift-*:     the entropy pass (ours / naive), then the GIFT mask and weights from those betas
              (objective_batch("gift", beta=betas), as train_step does), then the loss + backward + AdamW step
  entropy-*:  the entropy pass alone
"""

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's top-level files are plain modules
from gift import BETA_POWER, CE_CHUNK, diffusion_loss, first_pass_betas, objective_batch  # noqa: E402
from model import LLaDA, LLaDAConfig, add_lora  # noqa: E402

VARIANTS = ("idle", "sft-ours", "sft-naive", "gift-ours", "gift-naive", "entropy-ours", "entropy-naive")
DEFAULTS = dict(vocab=126464, seq=2048, d_model=128, n_heads=4, n_layers=2, mlp=384, batch=1)
SMOKE = dict(vocab=2048, seq=64, d_model=32, n_heads=4, n_layers=2, mlp=96, batch=1)
FLAGS = ("vocab", "seq", "d_model", "n_heads", "n_layers", "mlp", "batch", "lora", "chunk_size", "dtype", "device",
         "seed")

# -----------------------------------------------------------------------------
# The naive versions: full (B, L, V) float32 logits


def naive_diffusion_loss(model, input_ids, noisy_ids, weight, answer_mask, norm="answer"):
    """gift.diffusion_loss computed as common trainers do (LLaDA's SFT guidelines): logits over every position,
    then cross-entropy at the masked rows. Returns (loss, logits): a training loop holds the model output until
    backward is done (`logits = model(x).logits; loss = ...; loss.backward()` in one scope), and so does ours."""
    masked = (noisy_ids == model.config.mask_token_id) & answer_mask  # (B, L)
    logits = model(noisy_ids).float()  # (B, L, V): the tensor gift.py never builds
    token_loss = F.cross_entropy(logits[masked], input_ids[masked], reduction="none") * weight[masked]  # (N,)
    if norm == "answer":
        n_answer = answer_mask.sum(1, keepdim=True).clamp_min(1).expand_as(masked)  # (B, L)
        return (token_loss / n_answer[masked]).sum() / len(input_ids), logits
    return token_loss.sum() / masked.sum().clamp_min(1), logits


@torch.no_grad()
def naive_entropy_betas(model, input_ids, answer_mask, power=BETA_POWER):
    """gift.entropy_betas computed over every position of the fully masked answer, then selected."""
    x = input_ids.masked_fill(answer_mask, model.config.mask_token_id)
    was_training = model.training
    model.eval()
    logits = model(x).float()  # (B, L, V)
    model.train(was_training)
    logp = F.log_softmax(logits, dim=-1)  # (B, L, V)
    H = -(logp.exp() * logp).sum(-1)  # (B, L)
    return torch.where(answer_mask, H.clamp_min(0) ** power, 0.0)


# -----------------------------------------------------------------------------
# One variant, in this process


def build(a, device):
    cfg = LLaDAConfig(d_model=a.d_model, n_heads=a.n_heads, n_kv_heads=a.n_heads, n_layers=a.n_layers,
                      mlp_hidden_size=a.mlp, vocab_size=a.vocab, embedding_size=a.vocab, mask_token_id=a.vocab - 1,
                      eos_token_id=a.vocab - 2, pad_token_id=a.vocab - 2, max_sequence_length=max(a.seq, 4096))
    model = LLaDA(cfg).init_weights(torch.Generator().manual_seed(a.seed))
    if a.lora:
        add_lora(model, r=16, alpha=32, dropout=0.05, generator=torch.Generator().manual_seed(a.seed))
    model.to(device=device, dtype=getattr(torch, a.dtype) if a.lora else torch.float32).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.1)
    g = torch.Generator().manual_seed(a.seed + 1)
    input_ids = torch.randint(0, a.vocab - 2, (a.batch, a.seq), generator=g).to(device)
    answer_mask = (torch.arange(a.seq)[None] >= a.seq // 2).expand(a.batch, -1).to(device)  # half prompt, half answer
    return model, optimizer, input_ids, answer_mask


def run_variant(a, variant, model, optimizer, input_ids, answer_mask):
    if variant == "idle":
        return
    ours = variant.endswith("-ours")
    mask_id = model.config.mask_token_id
    entropy = ((lambda m, x, am: first_pass_betas(m, "entropy", x, am, mask_id, chunk_size=a.chunk_size)) if ours
               else naive_entropy_betas)
    if variant.startswith("entropy"):
        entropy(model, input_ids, answer_mask)
        return
    generator = torch.Generator(input_ids.device).manual_seed(a.seed + 2)
    if variant.startswith("sft"):
        noisy_ids, weight = objective_batch("sft", input_ids, answer_mask, generator, mask_id)
        norm = "answer"
    else:  # GIFT: betas from the entropy pass, then exactly objective_batch("gift")'s mask and weights
        betas = entropy(model, input_ids, answer_mask)
        noisy_ids, weight = objective_batch("gift", input_ids, answer_mask, generator, mask_id, betas)
        norm = "masked"
    if ours:
        hidden = model(noisy_ids, return_hidden=True)  # (B, L, D)
        loss = diffusion_loss(hidden, model.head, input_ids, noisy_ids, weight, answer_mask, mask_id, norm,
                              chunk_size=a.chunk_size)
    else:
        loss, logits = naive_diffusion_loss(model, input_ids, noisy_ids, weight, answer_mask, norm)  # noqa: F841
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def current_bytes(device):
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    try:  # resident set size, Linux
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_bytes(device)


def peak_bytes(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:  # Linux: VmHWM, not ru_maxrss, which after fork + exec also counts the parent's RSS at the fork
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return r if sys.platform == "darwin" else r * 1024  # bytes on macOS, KiB on Linux


def worker(a):
    device = torch.device(a.device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.dtype == "bfloat16")
    model, optimizer, input_ids, answer_mask = build(a, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = current_bytes(device)
    with autocast:
        run_variant(a, a.worker, model, optimizer, input_ids, answer_mask)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(json.dumps({"before": before, "peak": peak_bytes(device)}))


# -----------------------------------------------------------------------------
# The comparison, one subprocess per variant


def measure(a, variant):
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", variant]
    for name in FLAGS:
        value, flag = getattr(a, name), "--" + name.replace("_", "-")
        argv += ([flag] if value else []) if isinstance(value, bool) else [flag, str(value)]
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"bench/memory.py: variant {variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(a):
    mb = 2**20
    logits_mb = a.batch * a.seq * a.vocab * 4 / mb
    print(f"peak memory of one step: vocab {a.vocab}, seq {a.seq} (answer {a.seq - a.seq // 2}), batch {a.batch}, "
          f"d_model {a.d_model}, {a.n_layers} layers, {'LoRA r 16' if a.lora else 'full fine-tuning'}, {a.dtype} on "
          f"{a.device}, chunk {a.chunk_size} positions; one (B, L, V) float32 logits tensor = {logits_mb:.0f} MB")
    unit = "RSS" if a.device == "cpu" else "allocated"
    results = {v: measure(a, v) for v in a.variants}
    if "idle" in results:
        print(f"idle process with the model, optimizer and batch: peak {unit} {results['idle']['peak'] / mb:.0f} MB")
    rows = {v: dict(peak=r["peak"] / mb, step=(r["peak"] - r["before"]) / mb) for v, r in results.items()}
    print(f"{'variant':14} {'peak MB':>8} {'+step MB':>9} {'ours/naive':>11} {'+step ours/naive':>17}")
    for v, r in rows.items():
        naive = rows.get(v.replace("-ours", "-naive")) if v.endswith("-ours") else None
        if naive:
            r.update(ratio=r["peak"] / naive["peak"], step_ratio=r["step"] / max(naive["step"], 1e-9))
        ratio = f"{r['ratio']:11.3f} {r['step_ratio']:17.3f}" if naive else ""
        print(f"{v:14} {r['peak']:8.0f} {r['step']:9.0f} {ratio}")
    print("targets: peak training-step memory of ours <= 1/4 of naive")
    for v in ("sft-ours", "gift-ours"):
        if "ratio" in rows.get(v, {}):
            r = rows[v]
            print(f"  {v:9}: whole process {r['ratio']:.3f} ({'yes' if r['ratio'] <= 0.25 else 'NO'}), "
                  f"the step's own memory {r['step_ratio']:.3f} ({'yes' if r['step_ratio'] <= 0.25 else 'NO'})")
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Peak memory of a training step: chunked loss vs full-vocabulary logits.")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, only the gift-* variants (they run every function here), in seconds")
    p.add_argument("--variants", default=None, help="comma-separated, from " + ",".join(VARIANTS) + " (default all)")
    for name, default in DEFAULTS.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"default {default}")
    p.add_argument("--lora", action="store_true", help="LoRA r 16 on q, k, v instead of full fine-tuning")
    p.add_argument("--chunk-size", type=int, default=CE_CHUNK,
                   help=f"positions per logits chunk in ours (default gift.CE_CHUNK = {CE_CHUNK})")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="bfloat16: autocast (and a bf16 LoRA base), as gift.py on a GPU")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", choices=VARIANTS, default=None, help=argparse.SUPPRESS)  # internal
    a = p.parse_args(argv)
    for k, v in (SMOKE if a.smoke else DEFAULTS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.variants = (a.variants or ("gift-ours,gift-naive" if a.smoke else ",".join(VARIANTS))).split(",")
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: {bad} not in {','.join(VARIANTS)}")
    return a


def main(argv=None):
    a = parse_args(argv)
    return worker(a) if a.worker else run(a)


if __name__ == "__main__":
    main()
