"""What one optimizer step of GIFT costs against SFT, measured and predicted from matrix FLOPs.

    python bench/train_step.py             # d_model 512, 8 layers, vocab 32k, seq 512, batch 2, float32, CPU
    python bench/train_step.py --smoke     # tiny shapes, one repetition (tests/test_bench.py runs this)
    python bench/train_step.py --device cuda --dtype bfloat16 --d-model 4096 --n-heads 32 --n-layers 32 \
        --mlp 12288 --vocab 126464 --seq 2048 --batch 1 --lora-r 128 --modes lora     # LLaDA-8B on one GPU

A step is gift.train_step itself, the training loop's optimizer step, on one micro-batch: the model from
gift.wrap_model (LoRA or full fine-tuning), gift.objective_batch (the noise; for gift / gift-elbo also the no-grad
entropy pass of Algorithm 1; gift-star reads betas that gift.initial_model_betas computed ONCE, before timing,
from the initial model), gift.diffusion_loss, backward, gradient clipping and the AdamW update. Every row is half
prompt, half answer. The variants run in rounds, ABCD then DCBA, so drift of a shared machine hits all of them
alike; each round gives each variant's ratio to the SFT step of the same round, and the table shows the median.

The FLOP prediction counts matrix multiplications only (multiply-add = 2 FLOPs):
  - N = matmul parameters of the blocks (q, k, v, attn_out, ff_proj, up_proj, ff_out): 2N FLOPs per token forward;
  - attention QK^T and PV: 4 L D per token per layer forward;
  - the LM head (V x D): 2 V D per position where logits are computed, i.e. only at masked answer positions in the
    loss pass and at the answer positions in the entropy pass (what gift.py computes; counted with the masked
    counts of the timed steps themselves);
  - backward = 2x forward for trained matrices (input and weight gradients), 1x for frozen ones (LoRA's base and
    head: input gradient only), 2x for attention; LoRA adapters r (in + out) each, trained;
  - the chunked cross-entropy recomputes the head forward in backward (+1 head forward); activation checkpointing,
    when on, recomputes the blocks (+1 forward).
  So an entropy pass costs ~2N per token against ~4N for a LoRA step and ~6N for a full step: GIFT is predicted at
  ~1.5x SFT with LoRA and ~1.33x with full fine-tuning before the head terms. Not counted: elementwise work (norms,
  RoPE, SiLU, softmax / entropy over V), the embedding gradient, clipping and the optimizer update; they add a
  similar share to every variant, so a ratio is less affected than an absolute time.

Peak memory: on CUDA torch.cuda.max_memory_allocated during the timed steps; on CPU the peak RSS of a fresh
subprocess that builds the same model and runs one step, minus its RSS just before the step (model, optimizer and
batch in place): so "+step" is the memory the step itself adds (activations, logits, gradients, AdamW state).
"""

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's top-level files are plain modules
from gift import MicroBatch, first_pass_betas, initial_model_betas, train_step, wrap_model  # noqa: E402
from longjob import unwrap  # noqa: E402
from model import LLaDA, LLaDAConfig, LoRALinear  # noqa: E402

# gift-reuse: a gift step whose betas come from the BetaCache (--beta-refresh-epochs K: K - 1 of every K epochs):
# no entropy pass. With K = 4 a step costs (gift + 3 gift-reuse) / 4 on average; K = infinity costs gift-reuse
LOSSES = ("sft", "gift", "gift-elbo", "gift-star", "gift-reuse")
MODES = ("lora", "full")
DEFAULTS = dict(d_model=512, n_heads=8, n_layers=8, mlp=1536, vocab=32000, seq=512, batch=2, lora_r=16,
                repeats=7, warmup=1)
SMOKE = dict(d_model=32, n_heads=4, n_layers=2, mlp=96, vocab=512, seq=32, batch=2, lora_r=4, repeats=1, warmup=1)
SHAPE_FLAGS = ("d_model", "n_heads", "n_layers", "mlp", "vocab", "seq", "batch", "lora_r", "prompt_frac", "dtype",
               "device", "seed", "activation_checkpointing", "threads")
GRAD_CLIP, LR = 1.0, 1e-5  # gift.py's defaults

# -----------------------------------------------------------------------------
# The setup: model, batch and step, as gift.py's training loop builds them


def build_config(a):
    # mask / eos at the top of the vocabulary; mlp 1536 = 3 x 512 is LLaDA-8B's ratio (12288 / 4096)
    return LLaDAConfig(d_model=a.d_model, n_heads=a.n_heads, n_kv_heads=a.n_heads, n_layers=a.n_layers,
                       mlp_hidden_size=a.mlp, vocab_size=a.vocab, embedding_size=a.vocab, mask_token_id=a.vocab - 1,
                       eos_token_id=a.vocab - 2, pad_token_id=a.vocab - 2, max_sequence_length=max(a.seq, 4096))


def build_model(a, mode, device, dtype):
    """The model and its AdamW exactly as gift.train sets them up (gift.wrap_model: LoRA r, alpha 2r, dropout 0.05
    on q, k, v with the base in `dtype`; full fine-tuning in float32 master weights)."""
    # built and drawn where it runs: at 8B widths the CPU's one-thread generator takes minutes (on the CPU: the
    # same generator, so the same weights as before)
    with device:
        model = LLaDA(build_config(a)).init_weights(torch.Generator(device).manual_seed(a.seed))
    lora = dict(r=a.lora_r, alpha=2 * a.lora_r, dropout=0.05, targets=("q_proj", "k_proj", "v_proj"))
    model = wrap_model(model, device, dtype, world=1, lora=lora if mode == "lora" else None,
                       activation_checkpointing=a.activation_checkpointing, seed=a.seed).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    return model, optimizer


def build_batch(a, device):
    """B random rows of length L, the first prompt_frac of each row the prompt, the rest the answer."""
    g = torch.Generator().manual_seed(a.seed + 1)
    input_ids = torch.randint(0, a.vocab - 2, (a.batch, a.seq), generator=g)  # no mask / eos inside
    prompt_len = int(a.seq * a.prompt_frac)
    answer_mask = torch.arange(a.seq)[None].expand(a.batch, -1) >= prompt_len  # (B, L)
    return input_ids.to(device), answer_mask.to(device), prompt_len


def cached_reference_betas(model, input_ids, prompt_len, device):
    """gift-star: the betas of the frozen initial model (adapters disabled under LoRA), computed once before
    training by the training loop's own function (gift.initial_model_betas). (B, L) float32."""
    examples = [(row.tolist(), prompt_len) for row in input_ids.cpu()]
    return initial_model_betas(model, examples, model.config.pad_token_id, input_ids.shape[1], len(examples), device)


def make_step(loss_name, model, optimizer, input_ids, answer_mask, ref_betas, autocast):
    """One optimizer step: gift.train_step itself (pass 1: objective_batch; the global counts; pass 2:
    diffusion_loss + backward; clip; AdamW) on one micro-batch. Returns a function of the repetition index (it seeds
    the noise, so every variant sees the same t in the same round) giving the number of masked answer tokens.
    gift-reuse: gift's step with every row's betas fresh in the cache (train_step skips the entropy pass)."""
    stale = torch.zeros(len(input_ids), dtype=torch.bool) if loss_name == "gift-reuse" else None
    objective = "gift" if loss_name == "gift-reuse" else loss_name

    def step(i):
        generator = torch.Generator(input_ids.device).manual_seed(1000 + i)
        batch = MicroBatch(input_ids, answer_mask, generator, ref_betas, stale=stale)
        return int(train_step(model, optimizer, [batch], objective, grad_clip=GRAD_CLIP, autocast=autocast)["n_masked"])
    return step


def cached_betas(loss_name, model, input_ids, answer_mask, ref_betas, device):
    """The betas a variant reads instead of computing them: gift-star's initial-model betas; gift-reuse's from an
    entropy pass before timing (the cache's content, K - 1 of every K epochs); None for the others."""
    if loss_name == "gift-star":
        return ref_betas
    if loss_name == "gift-reuse":
        return first_pass_betas(model, "entropy", input_ids, answer_mask, unwrap(model).config.mask_token_id).to(device)
    return None


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -----------------------------------------------------------------------------
# The FLOP model (see the top of the file)


def matmul_params(cfg):
    """N: matmul parameters of the blocks per token (the head and embedding are counted separately)."""
    D, hd = cfg.d_model, cfg.head_dim
    per_block = D * (cfg.n_heads + 2 * cfg.n_kv_heads) * hd + D * D + 3 * D * cfg.mlp_hidden_size
    return cfg.n_layers * per_block


def lora_params(model):
    return sum(m.lora_A.numel() + m.lora_B.numel() for m in model.modules() if isinstance(m, LoRALinear))


def step_flops(cfg, mode, B, L, n_answer, n_masked, entropy_pass, n_lora=0, checkpointing=False):
    """Matrix FLOPs of one step: the loss pass (forward + backward at n_masked head positions) plus, for GIFT,
    the entropy pass (forward at n_answer head positions). Counts summed over the batch."""
    T, D, V = B * L, cfg.d_model, cfg.embedding_size
    body = 2 * matmul_params(cfg) * T  # forward of the blocks' matrices
    attn = 4 * L * D * cfg.n_layers * T  # forward QK^T and PV
    adapters = 2 * n_lora * T  # forward of the LoRA adapters
    head = 2 * V * D  # per position, forward
    if mode == "full":  # trained: backward = 2 x forward
        loss = 3 * body + 3 * attn + (1 + 1 + 2) * head * n_masked  # head: forward, recompute, backward
    else:  # frozen base and head: backward = input gradients only; adapters trained
        loss = 2 * body + 3 * attn + 3 * adapters + (1 + 1 + 1) * head * n_masked
    if checkpointing:
        loss += body + attn + adapters
    entropy = body + attn + adapters + head * n_answer if entropy_pass else 0
    return loss + entropy


# -----------------------------------------------------------------------------
# Peak memory of one step in a fresh process (CPU)


def rss_bytes():
    """Current resident set size (Linux /proc; elsewhere the peak so far, the best we can do)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes():
    """Peak RSS of this process. Linux: VmHWM, the peak of this program's own address space. getrusage's
    ru_maxrss is not used there: after fork + exec it also counts the parent's RSS at the fork, so a worker
    started by a parent holding a model would report the parent's size."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return r if sys.platform == "darwin" else r * 1024  # bytes on macOS, KiB on Linux


def memory_worker(a, mode, loss_name, betas_file):
    """Build the variant, note the RSS, run one step, print the peak RSS as JSON (parent: memory_in_subprocess)."""
    torch.set_num_threads(a.threads)
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    model, optimizer = build_model(a, mode, device, dtype)
    input_ids, answer_mask, _ = build_batch(a, device)
    ref_betas = torch.load(betas_file).to(device)  # gift-star: as a resumed run does
    with autocast_for(a):
        betas = cached_betas(loss_name, model, input_ids, answer_mask, ref_betas, device)
    step = make_step(loss_name, model, optimizer, input_ids, answer_mask, betas, autocast_for(a))
    before = rss_bytes()
    step(0)
    print(json.dumps({"before": before, "peak": peak_rss_bytes()}))


def memory_in_subprocess(a, mode, loss_name, betas_file):
    argv = [sys.executable, str(Path(__file__).resolve()), "--memory-worker", f"{mode}:{loss_name}",
            "--betas-file", str(betas_file)]
    for name in SHAPE_FLAGS:
        value = getattr(a, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"bench/train_step.py: memory worker {mode}:{loss_name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def autocast_for(a):
    # bf16 as gift.train does on a GPU: autocast over bf16 LoRA base weights / float32 full-FT master weights
    if a.dtype == "bfloat16":
        return torch.autocast(torch.device(a.device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# -----------------------------------------------------------------------------
# The benchmark


def run(a):
    torch.set_num_threads(a.threads)
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    cfg = build_config(a)
    input_ids, answer_mask, prompt_len = build_batch(a, device)
    n_answer = int(answer_mask.sum())
    variants, betas_files, tmp = [], {}, tempfile.TemporaryDirectory()
    for mode in a.modes:
        model, optimizer = build_model(a, mode, device, dtype)
        with autocast_for(a):  # gift-star: once, before the first step, as gift.train does
            ref_betas = cached_reference_betas(model, input_ids, prompt_len, device).to(device)
        betas_files[mode] = Path(tmp.name) / f"ref_betas_{mode}.pt"
        torch.save(ref_betas.cpu(), betas_files[mode])
        for loss_name in a.losses:
            with autocast_for(a):
                betas = cached_betas(loss_name, model, input_ids, answer_mask, ref_betas, device)
            step = make_step(loss_name, model, optimizer, input_ids, answer_mask, betas, autocast_for(a))
            variants.append(dict(mode=mode, loss=loss_name, step=step, times=[], wall=[], n_masked=[], peak=0,
                                 n_lora=lora_params(model)))

    for v in variants:  # warm-up (allocations, AdamW state, kernels)
        for i in range(a.warmup):
            v["step"](i)
    for r in range(a.repeats):  # rounds ABCD, DCBA, ...: drift cancels in the per-round ratios
        for v in (variants if r % 2 == 0 else variants[::-1]):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            n = v["step"](a.warmup + r)  # the same seed for every variant of a round: the same t
            sync(device)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            v["times"].append(cpu if a.clock == "cpu" else wall)
            v["wall"].append(wall)
            v["n_masked"].append(n)
            if device.type == "cuda":
                v["peak"] = max(v["peak"], torch.cuda.max_memory_allocated(device))

    if device.type == "cuda":
        memory = {(v["mode"], v["loss"]): {"peak": v["peak"]} for v in variants}
    elif a.memory:  # --smoke: only the first variant, to keep the path exercised in seconds
        memory = {(v["mode"], v["loss"]): memory_in_subprocess(a, v["mode"], v["loss"], betas_files[v["mode"]])
                  for v in (variants[:1] if a.smoke else variants)}
    else:
        memory = {}
    tmp.cleanup()
    return report(a, cfg, variants, memory, n_answer)


def report(a, cfg, variants, memory, n_answer):
    rows = []
    sft = {v["mode"]: v for v in variants if v["loss"] == "sft"}
    for v in variants:
        n_masked = statistics.mean(v["n_masked"])
        flops = step_flops(cfg, v["mode"], a.batch, a.seq, n_answer, n_masked,
                           entropy_pass=v["loss"] in ("gift", "gift-elbo"), n_lora=v["n_lora"],
                           checkpointing=a.activation_checkpointing)
        row = dict(mode=v["mode"], loss=v["loss"], ms=1e3 * statistics.median(v["times"]),
                   ms_min=1e3 * min(v["times"]), ms_max=1e3 * max(v["times"]),
                   wall_ms=1e3 * statistics.median(v["wall"]), n_masked=n_masked, flops=flops,
                   gflops_per_s=flops / statistics.median(v["times"]) / 1e9)
        base = sft.get(v["mode"])
        if base is not None:
            ratios = [t / s for t, s in zip(v["times"], base["times"])]  # per round
            base_flops = step_flops(cfg, v["mode"], a.batch, a.seq, n_answer, statistics.mean(base["n_masked"]),
                                    entropy_pass=False, n_lora=base["n_lora"],
                                    checkpointing=a.activation_checkpointing)
            row.update(ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                       predicted=flops / base_flops)
        mem = memory.get((v["mode"], v["loss"]))
        if mem:
            row["peak_mb"] = mem["peak"] / 2**20
            if "before" in mem:
                row["step_mb"] = (mem["peak"] - mem["before"]) / 2**20
        rows.append(row)

    print(f"one optimizer step: d_model {a.d_model}, {a.n_layers} layers, {a.n_heads} heads, mlp {a.mlp}, "
          f"vocab {a.vocab}, seq {a.seq} (prompt {int(a.seq * a.prompt_frac)}), batch {a.batch}, {a.dtype} on "
          f"{a.device} ({torch.get_num_threads()} threads), LoRA r {a.lora_r}; N = {matmul_params(cfg) / 1e6:.1f}M "
          f"block matmul params, head {cfg.embedding_size * cfg.d_model / 1e6:.1f}M; {a.repeats} rounds after "
          f"{a.warmup} warm-up; ms/step = {'process CPU' if a.clock == 'cpu' else 'wall-clock'} time")
    header = (f"{'mode':5} {'loss':10} {'ms/step':>9} {'min-max':>13} {'wall ms':>8} {'x SFT':>6} {'min-max':>11} "
              f"{'FLOP x':>7} {'masked':>7} {'GFLOP/s':>8} {'peak MB':>8} {'+step MB':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        ratio = f"{r['ratio']:6.3f} {r['ratio_min']:5.2f}-{r['ratio_max']:<5.2f}" if "ratio" in r else " " * 18
        pred = f"{r['predicted']:7.3f}" if "predicted" in r else " " * 7
        peak = f"{r['peak_mb']:8.0f}" if "peak_mb" in r else f"{'-':>8}"
        step = f"{r['step_mb']:8.0f}" if "step_mb" in r else f"{'-':>8}"
        print(f"{r['mode']:5} {r['loss']:10} {r['ms']:9.1f} {r['ms_min']:6.0f}-{r['ms_max']:<6.0f} "
              f"{r['wall_ms']:8.0f} {ratio} {pred} {r['n_masked']:7.0f} {r['gflops_per_s']:8.1f} {peak} {step}")
    print("x SFT: median over rounds of (this step / the SFT step of the same round); FLOP x: predicted by "
          "counting matrix FLOPs (bench/train_step.py docstring); simple 2N/4N, 2N/6N rule: LoRA 1.50, full 1.33")
    print("targets:")
    for r in rows:
        if r["loss"] in ("gift", "gift-elbo") and "ratio" in r:
            ok = r["ratio"] <= r["predicted"] + 0.10
            print(f"  {r['mode']:4} {r['loss']:9}: measured {r['ratio']:.3f} <= predicted {r['predicted']:.3f} "
                  f"+ 0.10: {'yes' if ok else 'NO'}")
        if r["loss"] == "gift-star" and "ratio" in r:
            ok = r["ratio"] <= 1.05
            print(f"  {r['mode']:4} gift-star: measured {r['ratio']:.3f} <= 1.05: {'yes' if ok else 'NO'}")
    by = {(r["mode"], r["loss"]): r for r in rows}
    for mode in a.modes:
        gift, reuse = by.get((mode, "gift")), by.get((mode, "gift-reuse"))
        if gift and reuse and "ratio" in gift:
            k4 = (gift["ratio"] + 3 * reuse["ratio"]) / 4
            print(f"  {mode:4} gift --beta-refresh-epochs 4: (gift + 3 x gift-reuse) / 4 = {k4:.3f} x SFT <= 1.10: "
                  f"{'yes' if k4 <= 1.10 else 'NO'} (K = 1: {gift['ratio']:.3f}, K = infinity: {reuse['ratio']:.3f})")
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Time one optimizer step of SFT and GIFT (LoRA and full fine-tuning).")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, one repetition, memory of the first variant only (seconds)")
    p.add_argument("--d-model", type=int, help=f"model width (default {DEFAULTS['d_model']})")
    p.add_argument("--n-heads", type=int, help=f"attention heads (default {DEFAULTS['n_heads']})")
    p.add_argument("--n-layers", type=int, help=f"blocks (default {DEFAULTS['n_layers']})")
    p.add_argument("--mlp", type=int, help=f"MLP hidden size (default {DEFAULTS['mlp']})")
    p.add_argument("--vocab", type=int, help=f"vocabulary size (default {DEFAULTS['vocab']})")
    p.add_argument("--seq", type=int, help=f"sequence length (default {DEFAULTS['seq']})")
    p.add_argument("--batch", type=int, help=f"rows per step (default {DEFAULTS['batch']})")
    p.add_argument("--lora-r", type=int, help=f"LoRA rank, alpha = 2r (default {DEFAULTS['lora_r']}: the paper's "
                   "128 scaled by d_model / 4096)")
    p.add_argument("--repeats", type=int, help=f"timed rounds (default {DEFAULTS['repeats']})")
    p.add_argument("--warmup", type=int, help=f"untimed steps per variant first (default {DEFAULTS['warmup']})")
    p.add_argument("--prompt-frac", type=float, default=0.5, help="fraction of each row that is prompt")
    p.add_argument("--losses", default=",".join(LOSSES), help="comma-separated, from " + ",".join(LOSSES))
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from lora,full")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="bfloat16: LoRA base in bf16 and autocast, as gift.py on a GPU")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    p.add_argument("--clock", choices=("cpu", "wall"), default=None,
                   help="cpu: process CPU time, which neighbours on a shared machine do not inflate (default on "
                   "CPU, with --threads 1); wall: wall-clock time (default on CUDA, synchronised)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default 1 with --clock cpu, else torch's default)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute blocks in backward")
    p.add_argument("--no-memory", dest="memory", action="store_false",
                   help="CPU: skip the per-variant memory subprocesses")
    p.add_argument("--seed", type=int, default=0, help="model init and batch seed")
    p.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)  # internal: MODE:LOSS
    p.add_argument("--betas-file", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for k, v in (SMOKE if a.smoke else DEFAULTS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.losses = [x for x in a.losses.split(",") if x]
    a.modes = [x for x in a.modes.split(",") if x]
    for name, chosen, allowed in (("--losses", a.losses, LOSSES), ("--modes", a.modes, MODES)):
        bad = [x for x in chosen if x not in allowed]
        if bad or not chosen:
            p.error(f"{name}: {bad or 'empty'} not in {','.join(allowed)}")
    a.clock = a.clock or ("wall" if a.device.startswith("cuda") else "cpu")
    if a.threads is None:
        a.threads = 1 if a.clock == "cpu" else torch.get_num_threads()
    if "sft" not in a.losses:
        a.losses.insert(0, "sft")  # the ratios are to SFT
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.memory_worker:
        mode, loss_name = a.memory_worker.split(":")
        return memory_worker(a, mode, loss_name, a.betas_file)
    return run(a)


if __name__ == "__main__":
    main()
