"""Per-GPU memory plan of the paper's recipes at LLaDA-8B and Dream-v0-7B shapes, for THIS code, term by term.

    python bench/memory_plan.py             # the recipes: a table each and a verdict against an 80 GB H100
    python bench/memory_plan.py --check     # the same formulas against peaks measured at small shapes (CPU, ~2 min)
    python bench/memory_plan.py --smoke     # tiny shapes, seconds (tests/test_memory_plan.py runs this)

The recipes (README.md, "The paper's recipes on 8 x H100"; paper Appendix C):
  lora  LoRA on s1K under DDP: bf16 base, frozen; adapters r 128, alpha 256, dropout 0.05 on q_proj, k_proj,
        v_proj in float32 with float32 gradients and AdamW states; batch 1 x 4096 tokens per GPU, accumulation 2;
        bf16 autocast; activation checkpointing off (also planned with it on).
  full  Full fine-tuning on Tulu 3 under FSDP2 over 8 GPUs: float32 master weights, gradients and AdamW states
        sharded 8 ways; bf16 compute (MixedPrecisionPolicy param_dtype bf16, reduce_dtype float32); batch
        4 x 4096 tokens per GPU; activation checkpointing on.
  dream_full  Dream's recipe (Table 7, "full parameter"; the paper ran it with the dllm framework): Dream-v0-7B-Base
        fully fine-tuned on Tulu3-10k as THIS code runs it, the full recipe's set-up (FSDP2 over 8 GPUs, bf16,
        batch 4 x 4096 per GPU, accumulation 1), with activation checkpointing and without.

Symbols. B rows per micro-batch, L sequence length, T = B L tokens, D d_model, F mlp_hidden_size, H heads,
V embedding rows (vocabulary), NL layers, r LoRA rank, c = gift.CE_CHUNK = 256 logits rows per chunk,
a = bytes of an activation (2 for bf16, 4 for float32), W = GPUs that FSDP2 shards over. Parameters:
P_b = 4 D^2 + 3 D F + 2 D per block, P = NL P_b + 2 V D + D in all (wte and the head are untied),
P_root = 2 V D + D (wte, ln_f, the head: FSDP2's root group), P_l = NL x 3 x 2 r D (LoRA on q, k, v).
N_a, N_m: answer and masked answer positions of a micro-batch (the 8B plans take the bound T for both).
Dream-v0 (Qwen2.5) differs in three places, each a config field: grouped-query attention, k_proj and v_proj of
width K = Hkv hd (Dream-7B: 4 x 128 = 512; K = D for LLaDA-8B); biases on q, k and v; the head tied to wte or not
(weight_tying; Dream-7B's is untied). So P_b = 2 D^2 + 2 D K + 3 D F + (D + 2 K) + 2 D, the head counts 0 when tied
(P_root = V D + D), the saved k and v are a T K each (below), and the vocabulary V is 152064. The formulas below are
written with K = D (LLaDA); the printed ones say T K where it differs. A tied head's gradient is the embedding's too:
the embedding's (V, D) gradient is added into it at the end of backward, before the root's reduce-scatter, smaller
than moment 4 (2 V D against 4 P_root), so no moment changes.

The memory of a step is what persists plus the largest of its MOMENTS: tensors of one moment are alive together,
tensors of two moments are not (the entropy pass is over before the loss pass starts, so its peak is a separate
moment, not added to the backward's).

Persistent: the weights (LoRA: the base in bf16 + the float32 adapters; full: float32 shards, 4 P / W), the AdamW
states (exp_avg, exp_avg_sq: 8 B per trainable parameter, sharded under FSDP2), DDP's gradient buckets (a float32
copy of the trainable gradients, 4 P_l; gradient_as_bucket_view is off), on a GPU a fixed CUDA_FIXED_GIB (CUDA
context, NCCL buffers, cuBLAS / flash-attention workspaces) and the caching allocator's reserved-but-unused blocks,
FRAGMENTATION x the tensors' peak. Those two are assumptions, not measurements: no GPU was available.

Moments, in the order gift.train_step runs them:
  1. entropy pass (answer_entropy_and_nll, Algorithm 1): no autograd graph, so the larger of one block's forward,
     8 a T D (x, n, q, k, v, attention output, h, m: Block.forward's locals) + 3 a T F (silu(g), u, their product),
     and the head over the answer: a N_a D hidden states + 2 (c, V) float32 tensors (a chunk's logits and their
     log-softmax, then the log-softmax and its exp; the bf16 logits are freed once cast, and each chunk's tensors
     before the next chunk's). FSDP2: the unsharded bf16 parameters of the root (not resharded after forward,
     FSDP2's rule for the root) and of two blocks (the current one and the prefetched next).
  2. loss chunks' backward (chunked_cross_entropy): every activation the forward saved, the ln_f input, the masked
     hidden states, and one chunk recomputed: its float32 log-softmax, that log-softmax's gradient and the logits'
     gradient, 12 c V bytes. A trained head adds its weight gradient: autograd sums the chunks' (V, D) gradients in
     one buffer, out of place the first time, so three (V, D) gradients exist at once: max(g V D + 12 c V, 3 g V D)
     with g = 4 (float32 head) or 2 (FSDP2's unsharded bf16 head); one chunk only: max(12 c V, g V D + 4 c V).
  3. block backward (the worst block k; backward runs from the top block down): the activations saved for blocks
     0..k (with checkpointing their inputs, a T D each, plus block k's full set, recomputed), the gradient of the
     residual stream a T D, and the MLP backward's 3 a T F (gradients of silu(g) x u and of both factors; full
     fine-tuning frees the product p at that moment: 2 a T F net), the gradients made so far. FSDP2: the sharded
     gradients of the blocks above, the root's unsharded head gradient, block k's and the prefetched block's
     unsharded bf16 parameters, and the float32 reduce-scatter input of the block above (4 P_b) in flight.
  4. end of backward (FSDP2 only): the root's reduce-scatter: its unsharded bf16 parameters and gradients
     (2 P_root each) and the float32 reduce-scatter input (4 P_root), with every block's sharded gradient.
  5. optimizer step: the gradients, the AdamW states (created here in a process's first step), and AdamW's
     temporary: on a GPU the foreach implementation's sqrt(exp_avg_sq) of every local parameter (4 P_t / W), on
     the CPU the single-tensor implementation's two temporaries of the largest parameter.

What autograd saves per block (listed with torch.autograd.graph.saved_tensors_hooks, op by op; tests/
test_memory_plan.py checks the sum against the hooks):
  - RMSNorm (attn_norm, ff_norm): its float32 input x.float() (pow and the product keep it), 4 T D each, and,
    when the norm weight is trained, the normalised tensor cast back, a T D each. LoRA's block 0 keeps no norm
    input for attn_norm: its input, the frozen embedding, needs no gradient.
  - the inputs of the linears whose weights are trained: n (q, k, v share it), m (ff_proj and up_proj), p (ff_out),
    a T D, a T D, a T F; frozen linears keep no input (they only need their weight to pass the gradient on).
  - attention: q and k after RoPE, v, and SDPA's output (flash kernels on CPU and GPU: no L x L matrix), 4 a T D,
    plus the float32 log-sum-exp, 4 B H L. attn_out's input is a view of that output (not counted twice). RoPE
    keeps only cos and sin, once per forward; Dream's RoPE computes in the activations' dtype (model.apply_rope), so in
    bf16 each block keeps its own bf16 copies of cos and sin for q and for k, 4 x 2 L hd bytes.
  - MLP: silu's input g and output silu(g), and u (the product's factors), 3 a T F.
  - LoRA per adapted linear (q, k, v): the dropout mask (1 B per element on a GPU, a bool; a bytes on the CPU,
    where dropout multiplies by a noise tensor), lora_A's input a T D (bf16: the autocast copy of the float32
    dropout output) and lora_B's input a T r; under bf16 autocast also the bf16 copies of A and B (autocast
    caches one per weight for the step, 4 r D bytes per adapter; block 0 keeps only B's).
  - with activation checkpointing (non-reentrant): only each block's input, a T D.
  Totals per block (block 0 of LoRA: less, see above): full fine-tuning 8 T D + 8 a T D + 4 a T F (bf16: 24 T D +
  8 T F; float32: 40 T D + 16 T F); LoRA 8 T D + 3 (m + a) T D + 4 a T D + 3 a T F + 3 a T r, m the mask bytes
  (GPU bf16: 25 T D + 6 T F + 6 T r). With GQA two of the four attention tensors (k, v) are a T K: full fine-tuning
  in bf16 20 T D + 4 T K + 8 T F (Dream-7B: 4 T K = 0.57 T D, so 20.6 T D + 8 T F).

The check (--check) builds small models with this repo's own code (model.LLaDA, gift.wrap_model, the AdamW that
gift.train_loop builds, gift.MicroBatch, gift.train_step with the gift loss and its entropy pass) and runs ONE step in a
fresh subprocess, one process (world 1, so no sharding: the division by W is exact arithmetic), and compares the
peak memory the step adds (peak RSS minus the RSS before the step: the weights are there before, the gradients,
AdamW states, activations, logits chunks come with the step) with this plan's moments for the same shapes. Peak
RSS is /proc/self/status VmHWM; writing 5 to /proc/self/clear_refs resets it, so hooks (a forward pre-hook, a
gradient hook on the hidden states, an optimizer step pre-hook) split the step into the moments above. Two details
make RSS follow what is allocated: the subprocess runs with MALLOC_MMAP_THRESHOLD_=65536, so that glibc gives
every tensor above 64 KiB its own mapping and returns it when freed (by default it keeps freed blocks of up to
32 MB in its heap, and the RSS would remember them); and it first runs one step of a throwaway model of the same
shapes, so that what a first step leaves behind whatever the model (code pages, oneDNN's kernels compiled for these
shapes, lazy initialisations: ~10 MiB) is not counted as the step's memory. Three of its configurations are
Dream-like (dream-*: GQA with 2 key/value heads of 8, q/k/v biases, Dream's RoPE, the shifted hidden states of
gift.predicting_hidden), so the Dream terms are checked against a real step too.
"""

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's top-level files are plain modules
from gift import CE_CHUNK, MicroBatch, fsdp_shard, train_step, wrap_model  # noqa: E402
from model import LLaDA, LLaDAConfig  # noqa: E402

GiB, MiB = 2**30, 2**20
H100_GIB = 81559 / 1024  # an H100 SXM 80GB: 81,559 MiB as nvidia-smi reports it (79.6 GiB)
CUDA_FIXED_GIB = 2.0  # assumed: CUDA context (~0.6 GiB), NCCL buffers, cuBLAS / flash-attention workspaces
FRAGMENTATION = 0.10  # assumed: the caching allocator's reserved-but-unused blocks, share of the tensors' peak
LORA_TARGETS = ("q_proj", "k_proj", "v_proj")  # the paper's (Appendix C); the formulas assume these

# -----------------------------------------------------------------------------
# Parameter counts, from the config


def kv_width(cfg):
    """K = Hkv hd, the output width of k_proj and v_proj: D for LLaDA-8B, 4 x 128 = 512 for Dream-7B (GQA)."""
    return cfg.n_kv_heads * cfg.head_dim


def param_counts(cfg):
    """Parameters of model.LLaDA(cfg), by group: block (one block), wte, head (0 when tied to wte), ln_f, total."""
    D, hd, F, K = cfg.d_model, cfg.head_dim, cfg.mlp_hidden_size, kv_width(cfg)
    block = (2 * D  # attn_norm, ff_norm
             + D * cfg.n_heads * hd + 2 * D * K  # q_proj, k_proj, v_proj
             + (cfg.n_heads * hd + 2 * K if cfg.include_qkv_bias else 0)  # their biases (Dream)
             + D * D  # attn_out
             + 3 * D * F)  # ff_proj, up_proj, ff_out
    wte = cfg.embedding_size * D
    head = 0 if cfg.weight_tying else wte  # a tied head is wte's matrix: no parameter of its own
    total = cfg.n_layers * block + wte + head + D  # + ln_f
    return dict(block=block, wte=wte, head=head, ln_f=D, total=total)


def lora_count(cfg, r):
    """Parameters of the LoRA adapters on q_proj, k_proj, v_proj of every block: r (in + out) each."""
    D, hd = cfg.d_model, cfg.head_dim
    return cfg.n_layers * r * ((D + cfg.n_heads * hd) + 2 * (D + cfg.n_kv_heads * hd))


# -----------------------------------------------------------------------------
# One setting and its terms


@dataclass
class Setup:
    """What one GPU (or one CPU process) runs: gift.wrap_model's model and gift.train_step's step."""
    name: str
    cfg: LLaDAConfig
    batch: int  # B, rows per micro-batch
    seq: int  # L
    lora_r: int = 0  # 0: full fine-tuning; else LoRA on q_proj, k_proj, v_proj with this rank (dropout > 0)
    a: int = 2  # activation bytes: 2 = bf16 (bf16 LoRA base or FSDP2's bf16 parameters, autocast), 4 = float32
    sharding: str = "none"  # none | ddp (LoRA over world GPUs) | fsdp2 (sharded over world: full fine-tuning, or
    # LoRA's frozen base and its adapters, gift.py --parallel fsdp)
    offload: bool = False  # FSDP2's CPUOffloadPolicy (--cpu-offload): weights, gradients, AdamW states on the host
    world: int = 1
    checkpointing: bool = False
    grad_accum: int = 1  # micro-batches per step: from the second on, the trainable gradients exist in backward
    device: str = "cuda"  # cuda: foreach AdamW, bool dropout masks, CUDA overhead; cpu: as measured by --check
    n_answer: int = 0  # N_a per micro-batch
    n_masked: int = 0  # N_m per micro-batch
    first_step: bool = False  # a fresh process's first step: the AdamW states are created inside it

    @property
    def lora(self):
        return self.lora_r > 0


def term(name, formula, nbytes):
    return (name, formula, float(nbytes))


def block_saved(s, first=False):
    """Bytes autograd keeps for one block's backward (no checkpointing), as (coefficient of T D, of T K, of T F,
    of T r, the rest) with T D etc. element counts: see the docstring's list. k and v are T K each (K = Hkv hd); when
    K = D (LLaDA-8B) their coefficient is folded into T D's."""
    a, T, D, K = s.a, s.batch * s.seq, s.cfg.d_model, kv_width(s.cfg)
    small = 4 * s.batch * s.cfg.n_heads * s.seq + 4 * T * (1 if (s.lora and first) else 2)  # log-sum-exp, rsqrt
    if not s.cfg.family.rope_in_float32 and a == 2:  # Dream: cos and sin rounded to bf16 for q and for k, (L, hd) each
        small += 4 * 2 * s.seq * s.cfg.head_dim
    if not s.lora:  # norm inputs (float32) + normalised (a) x 2, n, m, q, out; k, v; g, silu(g), u, p
        coefs = [8 + 6 * a, 2 * a, 4 * a, 0, small]
    else:
        mask = 1 if s.device == "cuda" else a
        norm_inputs = 4 if first else 8  # block 0: attn_norm's input is the frozen embedding
        masks = 0 if first else 3 * mask  # block 0: dropout of a tensor that needs no gradient keeps no mask
        # autocast's bf16 copies of A (r, D) and B (out, r), out = D for q, K for k and v; block 0 keeps no copy of A
        # (its input needs no gradient)
        casts = ((0 if first else 3 * 2 * s.lora_r * D) + 2 * s.lora_r * (D + 2 * K)) if a == 2 else 0
        coefs = [norm_inputs + masks + 3 * a + 2 * a, 2 * a, 3 * a, 3 * a, small + casts]
    if K == D:
        coefs[0], coefs[1] = coefs[0] + coefs[1], 0
    return tuple(coefs)


def block_bytes(s, coefs):
    T, D, F, r = s.batch * s.seq, s.cfg.d_model, s.cfg.mlp_hidden_size, s.lora_r
    cTD, cTK, cTF, cTr, small = coefs
    return cTD * T * D + cTK * T * kv_width(s.cfg) + cTF * T * F + cTr * T * r + small


def coef_formula(coefs):
    cTD, cTK, cTF, cTr, _ = coefs
    parts = [f"{c:g} {sym}" for c, sym in ((cTD, "T D"), (cTK, "T K"), (cTF, "T F"), (cTr, "T r")) if c]
    return " + ".join(parts)


def saved_activations(s, upto):
    """(formula, bytes) of the activations saved for blocks 0..upto-1 (no checkpointing) or their inputs
    (checkpointing)."""
    T, D = s.batch * s.seq, s.cfg.d_model
    if upto <= 0:
        return "0", 0.0
    if s.checkpointing:
        return f"{upto} x {s.a} T D (block inputs)", upto * s.a * T * D
    rest, first = block_saved(s), block_saved(s, first=True)
    if s.lora:  # block 0 keeps less
        return (f"{upto - 1} x ({coef_formula(rest)}) + ({coef_formula(first)})",
                (upto - 1) * block_bytes(s, rest) + block_bytes(s, first))
    return f"{upto} x ({coef_formula(rest)})", upto * block_bytes(s, rest)


def after_blocks(s):
    """ln_f's saved float32 input (and its normalised tensor when ln_f is trained), rsqrt, the masked hidden
    states the loss chunks keep as their checkpoint inputs."""
    T, D = s.batch * s.seq, s.cfg.d_model
    c_td = 4 + (0 if s.lora else s.a)
    return f"{c_td} T D + {s.a} N_m D", c_td * T * D + 4 * T + s.a * s.n_masked * D


def plan(s):
    """The persistent terms and the moments of one step. Returns dict(persistent=[terms], moments={name: [terms]},
    peak=name of the largest moment, tensors=bytes of tensors at the peak, total=bytes with the GPU overhead)."""
    cfg = s.cfg
    if not s.lora and s.a == 2 and s.sharding != "fsdp2":
        raise ValueError("bench/memory_plan.py: full fine-tuning in bf16 is planned under FSDP2 only (one process "
                         "autocasts float32 weights: other tensors)")
    T, D, F, V, NL = s.batch * s.seq, cfg.d_model, cfg.mlp_hidden_size, cfg.embedding_size, cfg.n_layers
    K = kv_width(cfg)
    c, a = CE_CHUNK, s.a
    counts = param_counts(cfg)
    P, P_b, P_root = counts["total"], counts["block"], counts["wte"] + counts["head"] + counts["ln_f"]
    fsdp = s.sharding == "fsdp2"
    W = s.world if fsdp else 1
    P_t = lora_count(cfg, s.lora_r) if s.lora else P  # trainable
    P_tl = P_t / W  # trainable, local to this GPU
    cV = c * V

    # persistent: there before the step (and after it)
    persistent = []
    if s.lora:
        persistent.append(term(f"base weights ({'bf16' if a == 2 else 'float32'}, frozen)", f"{a} P", a * P))
        persistent.append(term("LoRA adapters (float32)", "4 P_l", 4 * P_t))
    else:
        persistent.append(term("master weights (float32" + (", sharded)" if fsdp else ")"),
                               "4 P / W" if fsdp else "4 P", 4 * P_tl))
    if not s.first_step:
        persistent.append(term("AdamW states exp_avg, exp_avg_sq (float32" + (", sharded)" if fsdp else ")"),
                               "8 P_t / W" if fsdp else "8 P_t", 8 * P_tl))
    if s.sharding == "ddp":
        persistent.append(term("DDP gradient buckets (float32)", "4 P_l", 4 * P_t))
    if s.lora and fsdp:  # the base and the adapters sharded (each keeps its dtype: FSDP2 casts nothing)
        persistent[0] = term(f"base weights ({'bf16' if a == 2 else 'float32'}, frozen, sharded)", f"{a} P / W",
                             a * P / W)
        persistent[1] = term("LoRA adapters (float32, sharded)", "4 P_l / W", 4 * P_tl)
        persistent[2:] = [term("AdamW states exp_avg, exp_avg_sq (float32, sharded)", "8 P_l / W", 8 * P_tl)
                          ] if not s.first_step else []
    host = []
    if s.offload:  # CPUOffloadPolicy: the shards, their gradients and AdamW's states live on the host
        if not fsdp:
            raise ValueError("bench/memory_plan.py: offload is FSDP2's (sharding fsdp2)")
        host, persistent = persistent + [term("gradients (float32, sharded)", "4 P_t / W", 4 * P_tl)], []

    # shared pieces of the moments
    unsharded_root = term("unsharded bf16 root params (wte, ln_f, head; not resharded)", "2 P_root", 2 * P_root)
    unsharded_blocks = term("unsharded bf16 params of 2 blocks (current + prefetched)", "2 x 2 P_b", 4 * P_b)
    if s.lora:  # LoRA's gathered base is in its own dtype, with the block's float32 adapters
        unsharded_root = term(f"unsharded root params (wte, ln_f, head; {a} B each; not resharded)", f"{a} P_root",
                              a * P_root)
        unsharded_blocks = term("unsharded params of 2 blocks (current + prefetched), adapters included",
                                f"2 x ({a} P_b + 4 P_l / NL)", 2 * (a * P_b + 4 * P_t / NL))
    grads_held = []
    # pass 2 runs the micro-batches one after the other; from the second on, gradients exist (offloaded: on the host)
    if s.grad_accum > 1 and not s.offload:
        grads_held = [term("gradients of the earlier micro-batches (float32" + (", sharded)" if fsdp else ")"),
                           "4 P_t / W" if fsdp else "4 P_t", 4 * P_tl)]
    head_trained = not s.lora
    g = 2 if fsdp else 4  # bytes of the head's gradient before any reduction

    moments = {}

    # 1. the entropy pass: no graph
    block_fwd = 6 * a * T * D + 2 * a * T * K + 3 * a * T * F  # k and v: T K each
    head_fwd = a * s.n_answer * D + 8 * cV
    m1 = ([unsharded_root, unsharded_blocks] if fsdp else [])
    if block_fwd >= head_fwd:
        m1.append(term("a block's forward, no graph",
                       f"8 {a} T D + 3 {a} T F" if K == D else f"6 {a} T D + 2 {a} T K + 3 {a} T F", block_fwd))
    else:
        m1.append(term("answer hidden states + logits chunk (no graph)",
                       f"{a} N_a D + 8 c V", head_fwd))
    if s.lora and a == 2:
        m1.append(term("autocast's bf16 copies of the adapters", "2 P_l", 2 * P_t))
    moments["1 entropy pass"] = m1

    # 2. the loss chunks' backward
    n_chunks = max(1, math.ceil(s.n_masked / c))
    saved_f, saved_b = saved_activations(s, NL)
    after_f, after_b = after_blocks(s)
    m2 = ([unsharded_root] if fsdp else []) + grads_held + [
        term("activations saved by the blocks" + (" (checkpointing)" if s.checkpointing else ""), saved_f, saved_b),
        term("ln_f input, masked hidden states", after_f, after_b)]
    if head_trained and n_chunks > 1:
        m2.append(term("loss chunk + the head's weight gradients", f"max({g} V D + 12 c V, 3 x {g} V D)",
                       max(g * V * D + 12 * cV, 3 * g * V * D)))
    elif head_trained:
        m2.append(term("loss chunk + the head's weight gradient", f"max(12 c V, {g} V D + 4 c V)",
                       max(12 * cV, g * V * D + 4 * cV)))
    else:
        m2.append(term("loss chunk: log-softmax, its grad, logits' grad (float32)", "12 c V", 12 * cV))
    if s.lora and a == 2:
        m2.append(term("autocast's bf16 copies of the adapters", "2 P_l", 2 * P_t))
    moments["2 loss chunks' backward"] = m2

    # 3. block backward: the worst block k (the top one, unless gradients pile up faster than activations go)
    best = None
    for k in range(NL - 1, -1, -1):
        terms = ([unsharded_root] if fsdp else []) + grads_held
        if s.checkpointing:
            terms.append(term(f"inputs of blocks 0..{k}", f"{k + 1} x {a} T D", (k + 1) * a * T * D))
            own = block_saved(s, first=(k == 0))
            terms.append(term(f"block {k}'s activations, recomputed", coef_formula(own), block_bytes(s, own)))
        else:
            terms.append(term(f"activations saved by blocks 0..{k}", *saved_activations(s, k + 1)))
        net = 3 if s.lora else 2
        terms.append(term("residual-stream gradient + MLP backward", f"{a} T D + {net} x {a} T F",
                          a * T * D + net * a * T * F))
        if s.lora and a == 2:
            terms.append(term("autocast's bf16 copies of the adapters", "2 P_l", 2 * P_t))
        above = NL - 1 - k
        if head_trained and fsdp:
            terms += [term("head gradient (unsharded bf16, reduced at the end)", "2 V D", 2 * V * D),
                      term(f"sharded gradients of the blocks above ({above})" + (" (on the host)" if s.offload
                                                                                   else ""),
                           f"{above} x 4 P_b / W", 0 if s.offload else above * 4 * P_b / W),
                      unsharded_blocks,
                      term("block's ff_out gradient (unsharded bf16)", "2 D F", 2 * D * F),
                      term("reduce-scatter input of the block above (float32)", "4 P_b",
                           4 * P_b if above else 0)]
        elif fsdp:  # LoRA: the gathered blocks; the adapters' gradients are small
            terms += [unsharded_blocks,
                      term("adapters' reduce-scatter input of the block above (float32)", "4 P_l / NL",
                           4 * P_t / NL if above else 0)]
        elif head_trained:
            terms += [term("head gradient (float32)", "4 V D", 4 * V * D),
                      term(f"gradients of the blocks above ({above}) + ff_out's", f"{above} x 4 P_b + 4 D F",
                           above * 4 * P_b + 4 * D * F)]
        total = sum(t[2] for t in terms)
        if best is None or total > best[0]:
            best = (total, k, terms)
    moments[f"3 block backward (block {best[1]})"] = best[2]

    # 4. end of backward under FSDP2: the root's reduce-scatter
    if fsdp and not s.lora:  # (LoRA's root trains nothing)
        moments["4 end of backward (root reduce-scatter)"] = [
            unsharded_root,
            term("root gradients (unsharded bf16)", "2 P_root", 2 * P_root),
            term("root reduce-scatter input (float32)", "4 P_root", 4 * P_root),
            term("sharded gradients of every block (float32)" + (" (on the host)" if s.offload else ""),
                 "NL x 4 P_b / W", 0 if s.offload else NL * 4 * P_b / W)]

    # 5. the optimizer step
    m5 = [term("gradients (float32" + (", sharded)" if fsdp else ")"), "4 P_t / W" if fsdp else "4 P_t", 4 * P_tl)]
    if s.first_step:
        m5.append(term("AdamW states, created (float32)", "8 P_t / W" if fsdp else "8 P_t", 8 * P_tl))
    if s.device == "cuda":
        m5.append(term("AdamW foreach temporary sqrt(exp_avg_sq)", "4 P_t / W" if fsdp else "4 P_t", 4 * P_tl))
    else:
        largest = s.lora_r * D if s.lora else max(V * D, D * F)  # lora_A / lora_B of one linear; wte / head
        m5.append(term("AdamW single-tensor temporaries (2 x the largest parameter)", "2 x 4 max(numel)",
                       2 * 4 * largest))
    if not s.offload:  # offloaded, AdamW steps on the host
        moments["5 optimizer step"] = m5

    totals = {name: sum(t[2] for t in terms) for name, terms in moments.items()}
    peak = max(totals, key=totals.get)
    tensors = sum(t[2] for t in persistent) + totals[peak]
    total = tensors
    overhead = []
    if s.device == "cuda":
        overhead = [term("caching allocator's unused reserve (assumed)", f"{FRAGMENTATION:g} x tensors",
                         FRAGMENTATION * tensors),
                    term("CUDA context, NCCL, workspaces (assumed)", f"{CUDA_FIXED_GIB:g} GiB", CUDA_FIXED_GIB * GiB)]
        total += sum(t[2] for t in overhead)
    return dict(persistent=persistent, moments=moments, totals=totals, peak=peak, overhead=overhead,
                tensors=tensors, total=total, host=sum(t[2] for t in host))


# -----------------------------------------------------------------------------
# The paper's recipes at LLaDA-8B and Dream-v0-7B


def llada_8b():
    return LLaDAConfig()  # the defaults are LLaDA-8B-Instruct's config.json


def dream_7b():
    """Dream-v0-7B-Base's config.json (Qwen2.5-7B's shapes): 28 query heads, 4 key/value heads of 128, q/k/v biases,
    an untied head, vocabulary 152064."""
    return LLaDAConfig(d_model=3584, n_heads=28, n_kv_heads=4, n_layers=28, mlp_hidden_size=18944, vocab_size=152064,
                       embedding_size=152064, rope_theta=1e6, rms_norm_eps=1e-6, mask_token_id=151666,
                       eos_token_id=151643, pad_token_id=151643, max_sequence_length=131072, model_type="Dream",
                       include_qkv_bias=True, weight_tying=False)


def recipes(cfg=None, seq=4096):
    """The two recipes, per GPU (N_a = N_m = T: every position an answer and masked, the bound)."""
    cfg = cfg or llada_8b()
    lora = Setup("LoRA on s1K (DDP, 8 GPUs): r 128 on q/k/v, batch 1 x 4096, accumulation 2, bf16", cfg, batch=1,
                 seq=seq, lora_r=128, a=2, sharding="ddp", world=8, grad_accum=2, n_answer=seq, n_masked=seq)
    full = Setup("Full fine-tuning on Tulu 3 (FSDP2 over 8 GPUs): batch 4 x 4096, bf16, activation checkpointing",
                 cfg, batch=4, seq=seq, a=2, sharding="fsdp2", world=8, checkpointing=True, n_answer=4 * seq,
                 n_masked=4 * seq)
    return dict(lora=lora, lora_ckpt=replace(lora, name=lora.name.replace("bf16", "bf16, --activation-checkpointing"),
                                             checkpointing=True),
                full=full, full_no_ckpt=replace(full, name=full.name.replace("activation checkpointing",
                                                                             "NO activation checkpointing"),
                                                checkpointing=False))


def dream_recipes(cfg=None, seq=4096):
    """Dream's recipe (paper Appendix C, Table 7, "full parameter"; the paper ran it with the dllm framework), as
    THIS code runs it: full fine-tuning on Tulu3-10k under FSDP2 over 8 GPUs, batch 4 x 4096 per GPU, accumulation
    1, bf16; with activation checkpointing and without."""
    cfg = cfg or dream_7b()
    full = Setup("Dream-v0-7B full fine-tuning on Tulu3-10k (FSDP2 over 8 GPUs): batch 4 x 4096, bf16, activation "
                 "checkpointing", cfg, batch=4, seq=seq, a=2, sharding="fsdp2", world=8, checkpointing=True,
                 n_answer=4 * seq, n_masked=4 * seq)
    return dict(dream_full=full,
                dream_full_no_ckpt=replace(full, name=full.name.replace("activation checkpointing",
                                                                        "NO activation checkpointing"),
                                           checkpointing=False))


def show(s, capacity_gib=H100_GIB):
    """Print one recipe's table (term, formula, GiB) and its verdict; returns plan(s)."""
    p = plan(s)
    cfg, T = s.cfg, s.batch * s.seq
    counts = param_counts(cfg)
    P_root = counts["wte"] + counts["head"] + counts["ln_f"]
    K = kv_width(cfg)
    kv = f", K = Hkv hd = {cfg.n_kv_heads} x {cfg.head_dim} = {K}" if K != cfg.d_model else ""
    symbols = (f"T = {T}, D = {cfg.d_model}{kv}, F = {cfg.mlp_hidden_size}, V = {cfg.embedding_size}, "
               f"NL = {cfg.n_layers}, c = {CE_CHUNK},\n  P = {counts['total'] / 1e9:.3f}B, "
               f"P_b = {counts['block'] / 1e6:.1f}M, P_root = {P_root / 1e9:.3f}B")
    if cfg.include_qkv_bias or cfg.weight_tying:
        symbols += (" (P_b with the q/k/v biases" if cfg.include_qkv_bias else " (") + \
                   (", the head tied to wte)" if cfg.weight_tying else ")")
    if s.lora:
        symbols += f", r = {s.lora_r}, P_l = P_t = {lora_count(cfg, s.lora_r) / 1e6:.1f}M"
    if s.sharding == "fsdp2":
        symbols += f", W = {s.world}"
    print(f"\n{s.name}\n  {symbols}")
    print(f"  {'term':61} {'formula':56} {'GiB':>6}")
    sections = [("persistent", p["persistent"]), (f"moment {p['peak']}: the largest", p["moments"][p["peak"]]),
                ("GPU overhead (assumed)", p["overhead"])]
    for title, terms in sections:
        if terms:
            print(f"  {title}")
        for name, formula, nbytes in terms:
            print(f"    {name:59} {formula:56} {nbytes / GiB:6.2f}")
    print(f"  {'total per GPU':61} {'':56} {p['total'] / GiB:6.2f}")
    persistent = sum(t[2] for t in p["persistent"])
    print("  the other moments, with the persistent terms (GiB):")
    for name, v in p["totals"].items():
        if name != p["peak"]:
            print(f"    {name:59} {'':56} {(persistent + v) / GiB:6.2f}")
    margin = capacity_gib - p["total"] / GiB
    print(f"  verdict: {'fits' if margin >= 0 else 'does NOT fit'} an 80 GB H100 ({capacity_gib:.1f} GiB): "
          f"{p['total'] / GiB:.1f} GiB per GPU, margin {margin:+.1f} GiB")
    return p


# -----------------------------------------------------------------------------
# The table: which flags fit which cards (--table)

CARDS = {"24 GB": 24564 / 1024, "40/48 GB": 40960 / 1024, "80 GB": H100_GIB}  # GiB as nvidia-smi reports: a 4090 /
# 3090 (24,564 MiB), an A100 40GB (40,960 MiB; a 48 GB A6000 / L40S has more), an H100 80GB
GPU_COUNTS = (1, 2, 4, 8)
HEADROOM = 0.10  # a layout fits a card when its plan leaves this share of the card free: the plan's GPU overhead
# and fragmentation are assumptions, not measurements (a desktop card may also drive a display)


def layouts(cfg, lora, world, seq=4096):
    """gift.py's layouts of one method on `world` GPUs, fastest first: [(flags, Setup)]. LoRA: the paper's recipe
    (r 128 on q/k/v, batch 1 x seq, accumulation 2); full fine-tuning: batch 1 x seq, accumulation 1. N_a = N_m = T
    (the bound). FSDP2 without offload on one GPU shards nothing (gift.py wraps nothing there): left out."""
    base = Setup("", cfg, batch=1, seq=seq, lora_r=128 if lora else 0, a=2, world=world, n_answer=seq, n_masked=seq,
                 grad_accum=2 if lora else 1)
    ckpt = "--activation-checkpointing"
    if lora:
        rows = [("--lora", replace(base, sharding="ddp" if world > 1 else "none")),
                (f"--lora {ckpt}", replace(base, sharding="ddp" if world > 1 else "none", checkpointing=True))]
        if world > 1:
            rows += [("--lora --parallel fsdp", replace(base, sharding="fsdp2")),
                     (f"--lora --parallel fsdp {ckpt}", replace(base, sharding="fsdp2", checkpointing=True))]
        return rows + [(f"--lora --parallel fsdp {ckpt} --cpu-offload",
                        replace(base, sharding="fsdp2", checkpointing=True, offload=True))]
    rows = [("(defaults)", replace(base, sharding="fsdp2")),
            (ckpt, replace(base, sharding="fsdp2", checkpointing=True))]
    return rows + [(f"{ckpt} --cpu-offload", replace(base, sharding="fsdp2", checkpointing=True, offload=True))]


def fitting(cfg, lora, world, capacity_gib, seq=4096):
    """The first (fastest) layout whose planned per-GPU total fits `capacity_gib` with HEADROOM to spare: (flags,
    GiB per GPU, host GiB per process), or None."""
    for flags, s in layouts(cfg, lora, world, seq):
        p = plan(s)
        if p["total"] / GiB <= (1 - HEADROOM) * capacity_gib:
            return flags, p["total"] / GiB, p["host"] / GiB
    return None


def table(seq=4096):
    """Print, for LLaDA-8B and Dream-v0-7B, LoRA and full fine-tuning, on 1, 2, 4, 8 GPUs, the fastest flags that
    fit each card, with the planned per-GPU peak (and the host memory per process under --cpu-offload). Returns
    {(model, method, GPUs, card): fitting(...)}."""
    print(f"\nWhat fits (gift.py flags besides --model/--data; bf16; sequence length {seq}; LoRA: r 128 on q/k/v, "
          f"micro-batch 1 x {seq}, accumulation 2; full: micro-batch 1 x {seq}): the fastest layout whose planned peak "
          f"leaves {HEADROOM:.0%} of the card free, with that peak per GPU (the plan's CUDA overhead and "
          f"fragmentation included); --cpu-offload also "
          f"needs the host memory given per process")
    cells = {}
    print(f"  {'model, method':24} {'GPUs':>4}  " + "  ".join(f"{card:44}" for card in CARDS))
    for model, cfg in (("LLaDA-8B", llada_8b()), ("Dream-v0-7B", dream_7b())):
        for method, lora in (("LoRA", True), ("full", False)):
            for world in GPU_COUNTS:
                row = []
                for card, capacity in CARDS.items():
                    fit = cells[model, method, world, card] = fitting(cfg, lora, world, capacity, seq)
                    text = "none" if fit is None else f"{fit[0]} ({fit[1]:.1f} GiB" + (
                        f"; host {fit[2]:.0f} GiB)" if fit[2] else ")")
                    row.append(f"{text:44}")
                print(f"  {model + ', ' + method:24} {world:>4}  " + "  ".join(row))
    return cells


# -----------------------------------------------------------------------------
# The check: one step of this repo's code in a fresh process, measured, against plan() for the same shapes

# dream_kv_heads: the key/value heads of the Dream configurations (GQA; with q/k/v biases), the others have n_heads
CHECK_SHAPES = dict(d_model=512, n_heads=8, n_layers=4, mlp=1536, vocab=16384, seq=1024, batch=2, lora_r=16,
                    dream_kv_heads=2)
SMOKE_SHAPES = dict(d_model=64, n_heads=4, n_layers=2, mlp=192, vocab=2048, seq=128, batch=1, lora_r=4,
                    dream_kv_heads=2)
TOLERANCE = 0.15  # --check fails when a measured / predicted ratio of a step is further than this from 1
CHECKS = {  # name: (LoRA, dtype, activation checkpointing, family); lora-bf16 has the LoRA recipe's dtypes
    "lora-fp32": (True, "float32", False, "llada"),
    "lora-bf16": (True, "bfloat16", False, "llada"),
    "lora-bf16-ckpt": (True, "bfloat16", True, "llada"),
    "full-fp32": (False, "float32", False, "llada"),
    "full-fp32-ckpt": (False, "float32", True, "llada"),
    # Dream-like: GQA (k and v of dream_kv_heads), q/k/v biases, RoPE in the activations' dtype, the shifted hidden
    "dream-lora-bf16": (True, "bfloat16", False, "dream"),
    "dream-full-fp32": (False, "float32", False, "dream"),
    "dream-full-fp32-ckpt": (False, "float32", True, "dream"),
    # LoRA on a base sharded by FSDP2 (gift.py --lora --parallel fsdp), at world 1: one group per block, each
    # gathered into buffers of its own (the unsharded copies the plan counts), as on W GPUs
    "lora-fsdp-bf16": (True, "bfloat16", False, "llada"),
}
FSDP_CHECKS = ("lora-fsdp-bf16",)  # these run FSDP2 over a process group of one
SMOKE_CHECKS = ("lora-bf16", "full-fp32-ckpt", "dream-lora-bf16", "lora-fsdp-bf16")
PHASES = ("1 entropy pass", "2 loss chunks' backward", "3 block backward", "5 optimizer step")


def check_config(shapes, family="llada"):
    """The check's model config: LLaDA's, or family "dream" a Dream-v0 one (dream_kv_heads key/value heads, q/k/v
    biases, Dream's RoPE theta and norm eps, an untied head as Dream-7B's)."""
    V = shapes["vocab"]  # mask and eos at the top of the vocabulary
    dream = dict(model_type="Dream", include_qkv_bias=True, rope_theta=1e6, rms_norm_eps=1e-6)
    return LLaDAConfig(d_model=shapes["d_model"], n_heads=shapes["n_heads"],
                       n_kv_heads=shapes["dream_kv_heads"] if family == "dream" else shapes["n_heads"],
                       n_layers=shapes["n_layers"], mlp_hidden_size=shapes["mlp"], vocab_size=V, embedding_size=V,
                       mask_token_id=V - 1, eos_token_id=V - 2, pad_token_id=V - 2,
                       max_sequence_length=max(shapes["seq"], 4096), **(dream if family == "dream" else {}))


def build_step(shapes, lora, dtype, checkpointing, family="llada", seed=0, fsdp=False):
    """Model, AdamW, one micro-batch (half prompt, half answer) and autocast as gift.train_loop builds them. Returns
    (model, optimizer, step), step() = one gift.train_step with the gift loss (its entropy pass included)."""
    cfg = check_config(shapes, family)
    model = LLaDA(cfg).init_weights(torch.Generator().manual_seed(seed))
    r = shapes["lora_r"]
    lora_opts = dict(r=r, alpha=2 * r, dropout=0.05, targets=LORA_TARGETS) if lora else None
    model = wrap_model(model, torch.device("cpu"), dtype, 1, lora_opts, checkpointing, seed).train()
    if fsdp:  # what wrap_model does for --parallel fsdp on W > 1 processes, one group per block
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
        fsdp_shard(model, torch.device("cpu"), None if lora else dtype, one_group_max=0)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    B, L = shapes["batch"], shapes["seq"]
    input_ids = torch.randint(0, cfg.vocab_size - 2, (B, L), generator=torch.Generator().manual_seed(seed + 1))
    answer_mask = torch.arange(L)[None].expand(B, -1) >= L // 2  # (B, L)
    batch = MicroBatch(input_ids, answer_mask, [torch.Generator().manual_seed(seed + 2 + i) for i in range(B)])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == torch.bfloat16 else contextlib.nullcontext()
    return model, optimizer, lambda: train_step(model, optimizer, [batch], "gift", autocast=autocast)


def proc_status(field):
    """A field of /proc/self/status in bytes: VmRSS (resident now), VmHWM (its peak since the last reset)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")


def worker(spec):
    """In a fresh process: a step of a throwaway model of the same kind and shapes, then the measured step of a
    fresh model (its first: AdamW creates its states inside it). Prints JSON: the RSS before the step, the peak of
    each phase above it, and the step's answer / masked counts."""
    torch.set_num_threads(spec["threads"])
    lora, dtype, checkpointing, family = (spec["lora"], getattr(torch, spec["dtype"]), spec["checkpointing"],
                                          spec["family"])
    fsdp = spec.get("fsdp", False)
    warm_model, warm_optimizer, warm_step = build_step(spec["shapes"], lora, dtype, checkpointing, family, fsdp=fsdp)
    warm_step()
    del warm_model, warm_optimizer, warm_step
    model, optimizer, step = build_step(spec["shapes"], lora, dtype, checkpointing, family, fsdp=fsdp)
    peaks = {}

    def mark(phase):
        peaks[phase] = proc_status("VmHWM")
        reset_peak()

    def loss_forward_starts(module, args):  # the first forward with autograd on: the entropy pass is over
        if torch.is_grad_enabled():
            mark(PHASES[0])

    def hidden_states(module, args, h):  # h's gradient arrives once every loss chunk is through backward
        if torch.is_grad_enabled():
            h.register_hook(lambda grad: mark(PHASES[1]))

    model.register_forward_pre_hook(loss_forward_starts)
    model.register_forward_hook(hidden_states)
    optimizer.register_step_pre_hook(lambda *args: mark(PHASES[2]))
    before = proc_status("VmRSS")
    reset_peak()
    result = step()
    mark(PHASES[3])
    print(json.dumps(dict(before=before, peaks={k: v - before for k, v in peaks.items()},
                          n_answer=int(result["n_answer"]), n_masked=int(result["n_masked"]))))


def measure(name, shapes, threads):
    lora, dtype, checkpointing, family = CHECKS[name]
    spec = dict(shapes=shapes, lora=lora, dtype=dtype, checkpointing=checkpointing, family=family, threads=threads,
                fsdp=name in FSDP_CHECKS)
    # every tensor above 64 KiB in its own mapping, unmapped when freed: the RSS follows what is allocated
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"bench/memory_plan.py: worker {name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def predicted(name, shapes, n_answer, n_masked):
    """plan() for one CPU process running the check's step: its first step, world 1."""
    lora, dtype, checkpointing, family = CHECKS[name]
    s = Setup(name, check_config(shapes, family), batch=shapes["batch"], seq=shapes["seq"],
              lora_r=shapes["lora_r"] if lora else 0, a=2 if dtype == "bfloat16" else 4,
              checkpointing=checkpointing, device="cpu", n_answer=n_answer, n_masked=n_masked, first_step=True,
              sharding="fsdp2" if name in FSDP_CHECKS else "none")
    p = plan(s)
    return {phase: next(v for k, v in p["totals"].items() if k[0] == phase[0]) for phase in PHASES}


def check(names, shapes, threads, together=False):
    """Measured vs predicted memory that one step adds, per phase and for the step (the largest phase). together
    (--smoke): the workers run at once, in threads (each is still a fresh process of its own, so its RSS is its
    own; only the seconds printed are not one worker's alone)."""
    print(f"\ncheck: one gift.train_step (loss gift, its entropy pass included) in a fresh CPU process, world 1; "
          f"d_model {shapes['d_model']}, {shapes['n_layers']} layers, {shapes['n_heads']} heads, mlp {shapes['mlp']}, "
          f"vocab {shapes['vocab']}, batch {shapes['batch']} x seq {shapes['seq']} (half answer), LoRA r "
          f"{shapes['lora_r']} on q/k/v; dream-*: {shapes['dream_kv_heads']} key/value heads, q/k/v biases, Dream's "
          f"RoPE and shifted hidden states; MiB above the RSS before the step, predicted / measured")
    print(f"  {'config':20}" + "".join(f" {p[2:]:>26}" for p in PHASES) + f" {'step':>17} {'ratio':>6}")
    rows = {}
    background = ThreadPoolExecutor(len(names))
    pending = {name: background.submit(measure, name, shapes, threads) for name in names if together}
    for name in names:
        t0 = time.time()
        m = pending[name].result() if name in pending else measure(name, shapes, threads)
        pred = predicted(name, shapes, m["n_answer"], m["n_masked"])
        step_pred, step_meas = max(pred.values()), max(m["peaks"].values())
        rows[name] = dict(predicted=pred, measured=m["peaks"], step_predicted=step_pred, step_measured=step_meas,
                          ratio=step_meas / step_pred)
        cells = "".join(f" {pred[p] / MiB:7.0f} /{m['peaks'][p] / MiB:7.0f} ({m['peaks'][p] / pred[p]:4.2f})"
                        for p in PHASES)
        print(f"  {name:20}{cells} {step_pred / MiB:7.0f} /{step_meas / MiB:7.0f} {step_meas / step_pred:6.2f}"
              f"   ({time.time() - t0:.0f} s)")
    background.shutdown()
    return rows


# -----------------------------------------------------------------------------
# Main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Per-GPU memory plan of the paper's recipes at LLaDA-8B and Dream-v0-7B "
                                "for this code, and a check of its formulas against measured CPU steps at small "
                                "shapes.")
    p.add_argument("--check", action="store_true",
                   help=f"also run the check: {len(CHECKS)} configurations, each one step in a fresh process "
                        "(~1.5 min)")
    p.add_argument("--smoke", action="store_true",
                   help=f"the tables, and the check of {len(SMOKE_CHECKS)} configurations at tiny shapes, their "
                        "processes at once (seconds; ratios not meaningful)")
    p.add_argument("--table", action="store_true",
                   help="only the table of what fits 24, 40/48 and 80 GB cards at 1, 2, 4, 8 GPUs (LLaDA-8B, "
                        "Dream-v0-7B; LoRA, full fine-tuning)")
    p.add_argument("--configs", default=None,
                   help="comma-separated check configurations (default all): " + ", ".join(CHECKS))
    p.add_argument("--threads", type=int, default=2, help="torch threads in the check's processes")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one measured step (JSON spec)
    a = p.parse_args(argv)
    if a.configs:
        a.configs = a.configs.split(",")
        bad = [c for c in a.configs if c not in CHECKS]
        if bad:
            p.error(f"--configs: {bad} not among {', '.join(CHECKS)}")
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.worker:
        return worker(json.loads(a.worker))
    if a.table:
        return table()
    counts = param_counts(llada_8b())
    print(f"LLaDA-8B: {counts['total']:,} parameters ({counts['total'] / 1e9:.2f}B); per-GPU predictions for this "
          f"code (no GPU measured), against an H100's {H100_GIB:.1f} GiB")
    plans = {name: show(s) for name, s in recipes().items()}
    counts = param_counts(dream_7b())
    print(f"\nDream-v0-7B: {counts['total']:,} parameters ({counts['total'] / 1e9:.2f}B; GQA with 4 key/value heads, "
          f"q/k/v biases, untied head); the same predictions")
    plans |= {name: show(s) for name, s in dream_recipes().items()}
    rows = None
    if a.smoke:
        rows = check(a.configs or SMOKE_CHECKS, SMOKE_SHAPES, a.threads, together=True)
    elif a.check:
        rows = check(a.configs or list(CHECKS), CHECK_SHAPES, a.threads)
        outside = [name for name, row in rows.items() if abs(row["ratio"] - 1) > TOLERANCE]
        print(f"  steps within {TOLERANCE:.0%} of the plan: " + ("all" if not outside else f"NOT {outside}"))
        if outside:
            raise SystemExit(1)
    return plans, rows


if __name__ == "__main__":
    main()
