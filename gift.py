"""GIFT: Guided Importance-Aware Fine-Tuning of diffusion LMs (paper: ../shared/paper/gift_paper.tex).

Part 1, the losses. Every objective in the paper is ONE estimator of the weighted loss of Theorem 1 (eq. 10):

    L = sum_i E[ 1[x_t^i = M] * w_i * -log p(x0^i | x_t) ]

pick a masking probability p_i for every answer token, mask each answer token independently with probability
p_i (the prompt never), run the model once on the noisy sequence, and sum the cross-entropy at the masked
answer positions times a per-token weight w_i. The objectives differ only in how p_i and w_i are chosen
(p = (1 - eps) t + eps, t ~ U(0, 1) per row; r_i = beta_i / beta_ref; H_i the entropy of Algorithm 1):

    name       p_i                                      w_i at masked answer tokens    norm    source
    sft        p                                        1 / p                          answer  eq. (1), LLaDA
    gift       t_i = 1 - (1 - p)^r_i, beta_i = H_i^0.5  1 / t_i                        masked  Thm 1, Alg. 1-2
    gift-elbo  t_i as in gift                           r_i (1 - p)^(r_i - 1) / t_i    answer  Thm 1 + Jacobian
    gift-sw    p                                        H_i^0.5 / p                    answer  ablation, eq. (15)
    nll        t_i with beta_i = -log p(x0^i)           1 / t_i                        masked  ablation, eq. (13)
    dream      p                                        w_dream_i / p                  answer  ablation, eq. (16)
    gift-star  t_i with the INITIAL model's betas       1 / t_i                        masked  Appendix "GIFT*"

The paper's estimator is not the ELBO. Appendix A changes variables from t to t_i and ends with
sum_i integral dt_i E[1[masked] / t_i * -log p]: an integral over each token's OWN time t_i. Algorithm 2 samples
one t ~ U(0, 1) and weights by 1 / t_i, i.e. it integrates over t and drops the Jacobian
dt_i/dt = r_i (1 - t)^(r_i - 1). With the Jacobian (`gift-elbo`) the objective is the exact negative ELBO of the
forward process with per-token rates beta_i: for an exact denoiser it equals -log p(x0) for ANY betas, as SFT does.
Without it (`gift`, what the paper ran) it is a reweighting that is neither -log p(x0) nor a bound on it
(tests/test_losses.py pins both facts down by exact enumeration).

The training step calls `objective_batch` (the no-grad entropy pass, t, the mask, the weights) and then
`diffusion_loss` (the one forward/backward pass) with the global normaliser.
"""

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from data import (FORMATS, collate, epoch_order, load_dataset, load_tokenizer, make_char_tokenizer,
                  rank_micro_batches, special_ids, step_batches, sudoku_examples, sudoku_split, tiny_config_for)
from eval import SUDOKU_QUESTION, evaluate
from model import LLaDA, add_lora, atomic_write_text, lora_disabled, lora_layers, save_adapter

# -----------------------------------------------------------------------------
# Constants

EPS = 1e-3  # LLaDA's t -> p = (1 - eps) t + eps, keeps 1/p finite
BETA_POWER = 0.5  # beta_i = H_i^0.5 (eq. 12); 1.0 is the raw-entropy ablation
DREAM_P = 0.3  # the paper's choice for Dream's geometric kernel (ablation, below eq. 16)
# answer positions whose full-vocabulary logits exist at one time: 256 x 126464 x 4 B = 128 MB per (c, V) tensor,
# and a chunk holds a few of them at once (bench/memory.py: a quarter of the naive step's memory needs <= 256)
CE_CHUNK = 256
LOSSES = ("sft", "gift", "gift-elbo", "gift-sw", "nll", "dream", "gift-star")
DEFAULT_NORM = {"sft": "answer", "gift": "masked", "gift-elbo": "answer", "gift-sw": "answer",
                "nll": "masked", "dream": "answer", "gift-star": "masked"}

# -----------------------------------------------------------------------------
# Masking probabilities p_i: (B, L), 0 on prompt positions


def sft_mask_probs(t, answer_mask, eps=EPS):
    """LLaDA's SFT (paper eq. 1, GUIDELINES.md): every answer token is masked with p = (1 - eps) t + eps.
    t (B,), answer_mask (B, L) bool -> (B, L), 0 on the prompt."""
    p = ((1 - eps) * t + eps)[:, None]  # (B, 1)
    return torch.where(answer_mask, p, 0.0)


def beta_ratios(beta, answer_mask):
    """r_i = beta_i / beta_ref, beta_ref = the mean of beta over the row's answer tokens (Algorithm 2,
    "beta_ref <- sum_i beta_i M_i / sum_i M_i"). A row whose beta_ref is 0 (all entropies zero) gets r = 1,
    i.e. SFT. (B, L), 0 off the answer."""
    am = answer_mask.to(beta.dtype)
    beta_ref = (beta * am).sum(1, keepdim=True) / am.sum(1, keepdim=True).clamp_min(1)  # (B, 1)
    ok = beta_ref > 0
    r = torch.where(ok, beta / torch.where(ok, beta_ref, 1.0), 1.0)
    return torch.where(answer_mask, r, 0.0)


def gift_mask_probs(t, beta, answer_mask, eps=EPS):
    """Theorem 1: with the rate matrix Q of eq. (9) (token i jumps to [M] at rate beta_i) and the schedule
    fbar(t) = -log(1 - t) / beta_ref, token i is masked at time t with probability
        t_i = 1 - exp(-beta_i fbar(t)) = 1 - (1 - t)^(beta_i / beta_ref)     (Algorithm 2, "t_i <- ...")
    after t is mapped to p = (1 - eps) t + eps as in SFT. Computed as -expm1(r log1p(-p)) (no cancellation for
    small t) and clamped to [eps, 1] so that a token with beta ~ 0 cannot produce a 1/t_i blow-up.
    t (B,), beta (B, L), answer_mask (B, L) bool -> (B, L), 0 on the prompt."""
    p = (1 - eps) * t + eps  # (B,)
    r = beta_ratios(beta, answer_mask)  # (B, L)
    t_i = (-torch.expm1(r * torch.log1p(-p)[:, None])).clamp(eps, 1)
    return torch.where(answer_mask, t_i, 0.0)


# -----------------------------------------------------------------------------
# Weights w_i: (B, L), only read at masked answer positions


def importance_weights(p_mask, answer_mask):
    """The 1 / t_i of Theorem 1 (1 / p for SFT): E[1[masked_i] / t_i] = 1, so every token counts once on average."""
    return torch.where(answer_mask, 1 / p_mask, 0.0)


def gift_elbo_jacobian(t, beta, answer_mask, eps=EPS):
    """dt_i/dp = r_i (1 - p)^(r_i - 1), the Jacobian of Appendix A's change of variables t -> t_i.

    Appendix A's final loss integrates over t_i; Algorithm 2 samples t uniformly, so an unbiased estimate of the
    appendix's integral needs this factor. `gift` omits it (faithful to Algorithm 2, what the paper evaluated);
    `gift-elbo` multiplies it in, which makes sum_i E_t[1[masked_i] r_i (1-t)^(r_i-1) / t_i * -log p] the exact
    negative ELBO of the forward process with per-token rates beta_i (integrable: r_i - 1 > -1). Where t_i hits
    the eps clamp the factor is that of the unclamped t_i (a negligible O(eps) difference). (B, L), 0 off the answer."""
    p = (1 - eps) * t + eps  # (B,)
    r = beta_ratios(beta, answer_mask)  # (B, L)
    jac = r * torch.exp((r - 1) * torch.log1p(-p)[:, None])
    return torch.where(answer_mask, jac, 0.0)


def dream_weights(unmasked, p=DREAM_P):
    """Dream's context-adaptive weight (ablation, eq. 16): w_i = 1/2 sum_j 1[x_t^j != M] Geo(p, |i - j| - 1),
    Geo(p, k) = p (1 - p)^k. A masked token next to many clean tokens is easier and gets a larger weight.
    Clean j includes the prompt. unmasked (B, L) bool -> (B, L)."""
    L = unmasked.shape[1]
    pos = torch.arange(L, device=unmasked.device)
    d = (pos[:, None] - pos[None, :]).abs().float()  # (L, L) distance |i - j|
    geo = torch.where(d > 0, p * (1 - p) ** (d - 1).clamp_min(0), 0.0)  # (L, L), symmetric, 0 on the diagonal
    return 0.5 * unmasked.float() @ geo


# -----------------------------------------------------------------------------
# The forward process: one shared noising function


def uniforms(shape, generator, device):
    """U(0, 1) draws of `shape` (B, ...) from one explicit generator, or from a list of B generators, one per row.
    Per-row generators (seeded per example by the training loop) make a row's noise independent of how the batch
    is split across ranks and micro-batches: N processes then draw exactly what one process draws."""
    if isinstance(generator, torch.Generator):
        return torch.rand(shape, generator=generator, device=generator.device).to(device)
    return torch.stack([torch.rand(shape[1:], generator=g, device=g.device) for g in generator]).to(device)


def draw_t(batch_size, generator, device):
    """Algorithm 2, "t ~ U(0, 1)": one t per row."""
    return uniforms((batch_size,), generator, device)


def mask_tokens(input_ids, p_mask, mask_id, generator):
    """Algorithm 2, "M'^i ~ Bernoulli(t_i); I' <- (1 - M') I + M' m": mask each token independently with
    probability p_mask (B, L). p_mask is 0 on the prompt (u < 0 never holds), so the prompt stays clean.
    Same draws as LLaDA's recipe: one uniform per position, masked where u < p."""
    u = uniforms(input_ids.shape, generator, input_ids.device)
    return torch.where(u < p_mask, mask_id, input_ids)


# -----------------------------------------------------------------------------
# Cross-entropy from hidden states, a chunk of positions at a time


def _cross_entropy_chunk(head, h, targets):
    logits = head(h)  # (c, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # softmax in float32 (or float64)
    return F.cross_entropy(logits, targets, reduction="none")  # (c,)


def chunked_cross_entropy(head, h, targets, chunk_size=CE_CHUNK):
    """-log softmax(head(h))[target] for h (N, D), targets (N,) -> (N,). Only one chunk of (chunk_size, V)
    logits exists at a time: each chunk is recomputed in backward (activation checkpointing) instead of
    keeping its logits. With N = 0 one empty chunk still runs, so the head stays in the autograd graph."""
    losses = []
    for s in range(0, max(len(h), 1), chunk_size):
        hc, yc = h[s:s + chunk_size], targets[s:s + chunk_size]
        if torch.is_grad_enabled():
            losses.append(checkpoint(_cross_entropy_chunk, head, hc, yc, use_reentrant=False))
        else:
            losses.append(_cross_entropy_chunk(head, hc, yc))
    return torch.cat(losses)


# -----------------------------------------------------------------------------
# The one loss function (the second, gradient-carrying pass)


def diffusion_loss(model, input_ids, noisy_ids, weight, answer_mask, norm="answer", denominator=None,
                   chunk_size=CE_CHUNK):
    """sum over masked answer tokens of weight * CE(model(noisy_ids), input_ids), normalised.
    Theorem 1 / Algorithm 2, "S <- sum_i 1[M'^i = 1] / t_i CrossEntropy(z_i, l_i)", with the weight chosen per
    objective. Masked = noisy_ids holds the model's mask token AND answer_mask is true. Logits are computed only
    at masked positions, chunk by chunk (chunked_cross_entropy).

    norm "answer": each row's sum / that row's answer length (EOS padding counts), then / B: LLaDA's SFT recipe.
    norm "masked": the total / the number of masked tokens (Algorithm 2, "L <- S / N").
    denominator: overrides that final divisor (B for "answer", N for "masked"). Pass the GLOBAL count over
    ranks and accumulation micro-batches so that micro-batch losses add up to the full-batch loss; under DDP,
    which averages gradients over ranks, pass global_count / world_size.
    With no masked token the loss is 0 but still connected to every parameter used (DDP does not hang)."""
    core = getattr(model, "module", model)  # DDP keeps the real module in .module
    masked = (noisy_ids == core.config.mask_token_id) & answer_mask  # (B, L)
    h = model(noisy_ids, return_hidden=True)  # (B, L, D)
    ce = chunked_cross_entropy(core.head, h[masked], input_ids[masked], chunk_size)  # (N,)
    token_loss = ce * weight[masked].to(ce.dtype)  # (N,)
    if norm == "answer":
        n_answer = answer_mask.sum(1, keepdim=True).clamp_min(1).expand_as(masked)  # (B, L) row's answer length
        total = (token_loss / n_answer[masked]).sum()
        denominator = len(input_ids) if denominator is None else denominator
    elif norm == "masked":
        total = token_loss.sum()
        denominator = masked.sum().clamp_min(1) if denominator is None else denominator
    else:
        raise ValueError(f"gift.py diffusion_loss: norm={norm!r}; use 'answer' or 'masked'")
    return total / denominator


# -----------------------------------------------------------------------------
# The entropy pass (Algorithm 1): no grad, all answer tokens masked


@torch.no_grad()
def answer_entropy_and_nll(model, input_ids, answer_mask, chunk_size=CE_CHUNK):
    """Algorithm 1: mask the whole answer, one forward pass, and at each answer position the entropy
    H_i = -sum_j softmax(z_ij) log_softmax(z_ij) and the NLL -log softmax(z_i)[x0^i] (the "nll" ablation's
    beta, eq. 13). Dropout (LoRA's) is off: the model is put in eval mode and its mode restored. Logits exist
    for one chunk of answer positions at a time, in float32. Returns H, nll (B, L) float32, 0 off the answer."""
    core = getattr(model, "module", model)
    x = input_ids.masked_fill(answer_mask, core.config.mask_token_id)  # Algorithm 1, "I'^i <- (1-M^i) I^i + M^i m"
    H = torch.zeros(input_ids.shape, device=input_ids.device)
    nll = torch.zeros(input_ids.shape, device=input_ids.device)
    was_training = model.training
    model.eval()
    try:
        h = model(x, return_hidden=True)[answer_mask]  # (N, D)
        targets = input_ids[answer_mask]  # (N,)
        H_ans, nll_ans = [], []
        for s in range(0, len(h), chunk_size):
            logits = core.head(h[s:s + chunk_size])  # (c, V)
            logp = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
            del logits  # two (c, V) tensors alive at a time, not four
            nll_ans.append(-logp.gather(-1, targets[s:s + chunk_size, None])[:, 0])
            H_ans.append(-logp.exp().mul_(logp).sum(-1))
    finally:
        model.train(was_training)
    if H_ans:
        H[answer_mask] = torch.cat(H_ans).to(H.dtype)
        nll[answer_mask] = torch.cat(nll_ans).to(nll.dtype)
    return H, nll


def entropy_betas(model, input_ids, answer_mask, power=BETA_POWER, chunk_size=CE_CHUNK):
    """Algorithm 1, "beta_i <- M^i sqrt(H_i)": beta_i = H_i^power at answer positions, 0 elsewhere (eq. 12;
    power 0.5 is the paper's, 1.0 the raw-entropy ablation). No autograd graph. (B, L) float32."""
    H, _ = answer_entropy_and_nll(model, input_ids, answer_mask, chunk_size)
    return torch.where(answer_mask, H.clamp_min(0) ** power, 0.0)


def reference_betas(model, input_ids, answer_mask, power=BETA_POWER, chunk_size=CE_CHUNK):
    """GIFT* (Appendix "Discussion on the Rigor"): betas from the frozen INITIAL model, so Q stays fixed during
    training and Theorem 1 applies as derived. Under LoRA the initial model is the base with the adapters
    disabled (no extra memory). For full fine-tuning compute entropy_betas(initial_model, ...) once per example
    before training, cache them, and pass them to objective_batch as ref_betas."""
    core = getattr(model, "module", model)
    if not lora_layers(core):
        raise ValueError("gift.py reference_betas: gift-star needs the initial model's betas, but this model has "
                         "no LoRA adapters to disable; with full fine-tuning precompute "
                         "entropy_betas(initial_model, ...) per example and pass ref_betas=")
    with lora_disabled(core):
        return entropy_betas(model, input_ids, answer_mask, power, chunk_size)


# -----------------------------------------------------------------------------
# The dispatch: what each objective feeds the shared loss


def _masked_mean_std(x, sel):
    """Mean and (population) std of x[sel]; 0 when sel is empty (no NaN in the logs)."""
    v = x[sel].float()
    n = max(v.numel(), 1)
    mean = v.sum() / n
    return mean, ((v - mean) ** 2).sum().div(n).sqrt()


def objective_batch(loss_name, model, input_ids, answer_mask, generator, eps=EPS, beta_power=BETA_POWER,
                    ref_betas=None, norm=None, dream_p=DREAM_P):
    """Everything before the gradient pass, for one micro-batch: the no-grad entropy pass when the objective needs
    it, t ~ U(0, 1), p_i, the noisy sequence and the weights. Returns (noisy_ids, weight, norm, stats) for
    diffusion_loss(model, input_ids, noisy_ids, weight, answer_mask, norm, denominator=...).

    loss_name: one of LOSSES (table at the top of this file). norm: None = the objective's default (DEFAULT_NORM),
    or "answer" / "masked" to hold it fixed across objectives. ref_betas: gift-star only, (B, L) betas of the
    initial model cached per example (full fine-tuning); when None, gift-star uses the LoRA base model.
    Random draws, in order: t (B,), then one uniform per position; an objective whose p_i equals SFT's therefore
    masks exactly as SFT for the same generator state.
    stats (0-dim tensors, detached; .item() them when logging): n_masked, n_answer, n_rows, frac_masked,
    weight_mean (over masked tokens), beta_mean / beta_std (over answer tokens; gift-sw: of its weight)."""
    if loss_name not in LOSSES:
        raise ValueError(f"gift.py objective_batch: unknown loss {loss_name!r}; choose one of {LOSSES}")
    if ref_betas is not None and loss_name != "gift-star":
        raise ValueError(f"gift.py objective_batch: ref_betas is only used by gift-star, not {loss_name!r}")
    core = getattr(model, "module", model)
    mask_id = core.config.mask_token_id
    t = draw_t(len(input_ids), generator, input_ids.device)  # (B,)

    # First pass (no grad, Algorithm 1): the betas, or the GIFT (SW) weight
    beta = None
    if loss_name in ("gift", "gift-elbo", "gift-sw"):
        beta = entropy_betas(model, input_ids, answer_mask, power=beta_power)
    elif loss_name == "nll":
        beta = answer_entropy_and_nll(model, input_ids, answer_mask)[1]  # eq. 13: beta_i = -log p(x0^i)
    elif loss_name == "gift-star":
        beta = (ref_betas.to(input_ids.device) if ref_betas is not None
                else reference_betas(model, input_ids, answer_mask, beta_power))

    # p_i: the uniform SFT rate, or Theorem 1's per-token rate
    if loss_name in ("sft", "gift-sw", "dream"):
        p_mask = sft_mask_probs(t, answer_mask, eps)
    else:
        p_mask = gift_mask_probs(t, beta.to(t.dtype), answer_mask, eps)
    noisy_ids = mask_tokens(input_ids, p_mask, mask_id, generator)

    # w_i: 1 / p_i, times the objective's own factor
    weight = importance_weights(p_mask, answer_mask)
    if loss_name == "gift-elbo":
        weight = weight * gift_elbo_jacobian(t, beta.to(t.dtype), answer_mask, eps)
    elif loss_name == "gift-sw":
        weight = weight * beta  # eq. 15: w_i = sqrt(H_i), on top of SFT's 1/t
    elif loss_name == "dream":
        weight = weight * dream_weights(noisy_ids != mask_id, dream_p)

    with torch.no_grad():
        masked = (noisy_ids == mask_id) & answer_mask
        n_masked, n_answer = masked.sum(), answer_mask.sum()
        stats = dict(n_masked=n_masked, n_answer=n_answer, n_rows=torch.tensor(len(input_ids)),
                     frac_masked=n_masked / n_answer.clamp_min(1),
                     weight_mean=_masked_mean_std(weight, masked)[0])
        if beta is not None:
            stats["beta_mean"], stats["beta_std"] = _masked_mean_std(beta, answer_mask)
    return noisy_ids, weight.detach(), norm or DEFAULT_NORM[loss_name], stats


# ----------------------------------------------------------------------------- end of the losses

# =============================================================================
# Training: `torchrun --nproc_per_node N gift.py [options]`, or `python gift.py` for one process.
# With no --model it trains the embedded default: a tiny LLaDA from scratch on 4x4 Sudoku, then evaluates it.


@dataclass
class TrainOptions:
    # what to train
    model: str = field(default="", metadata={"help": "Hugging Face LLaDA folder (config.json, safetensors, "
                                             "tokenizer.json); empty = the embedded tiny Sudoku task"})
    data: str = field(default="", metadata={"help": "training JSONL (messages, prompt/response, s1K or s1K-1.1)"})
    data_format: str = field(default="auto", metadata={"help": "auto|" + "|".join(FORMATS)})
    out: str = field(default="runs/default", metadata={"help": "output folder: checkpoints, metrics.jsonl"})
    loss: str = field(default="gift", metadata={"help": "|".join(LOSSES)})
    norm: str = field(default="", metadata={"help": "answer|masked; empty = the objective's default"})
    beta_power: float = field(default=0.5, metadata={"help": "beta_i = H_i^power (0.5 = paper; 1.0 = raw entropy)"})
    eps: float = field(default=1e-3, metadata={"help": "t -> (1 - eps) t + eps, as LLaDA"})
    # LoRA (DDP) or full fine-tuning (FSDP2)
    lora: bool = field(default=False, metadata={"help": "LoRA fine-tuning (DDP); default full (FSDP2)"})
    lora_r: int = field(default=128, metadata={"help": "LoRA rank"})
    lora_alpha: float = field(default=256.0, metadata={"help": "LoRA alpha (scale alpha / r)"})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout"})
    lora_targets: str = field(default="q_proj,k_proj,v_proj", metadata={"help": "comma-separated block linears"})
    # optimisation
    epochs: int = field(default=20, metadata={"help": "passes over the data"})
    max_steps: int = field(default=0, metadata={"help": "stop after this many optimizer steps (0 = epochs)"})
    batch_size: int = field(default=1, metadata={"help": "examples per device per micro-step"})
    grad_accum: int = field(default=4, metadata={"help": "micro-steps per optimizer step"})
    lr: float = field(default=1e-5, metadata={"help": "peak learning rate"})
    schedule: str = field(default="linear", metadata={"help": "linear|cosine|constant decay after warm-up"})
    warmup_steps: int = field(default=0, metadata={"help": "linear warm-up steps"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay"})
    grad_clip: float = field(default=1.0, metadata={"help": "max gradient norm (0 = off)"})
    max_len: int = field(default=4096, metadata={"help": "drop (and count) longer examples"})
    pad_to_max_len: bool = field(default=False, metadata={"help": "pad every batch to max_len, as d1/wd1"})
    skip_bad_rows: bool = field(default=False, metadata={"help": "skip and count malformed rows"})
    seed: int = field(default=42, metadata={"help": "model init, data order and noise seed"})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 on GPU, float32 on CPU)|bfloat16|float32"})
    activation_checkpointing: bool = field(default=False, metadata={"help": "recompute blocks in backward"})
    # bookkeeping
    log_every: int = field(default=10, metadata={"help": "optimizer steps between log lines"})
    save_every: int = field(default=0, metadata={"help": "optimizer steps between checkpoints (0 = each epoch)"})
    keep_last: int = field(default=2, metadata={"help": "checkpoints kept"})
    resume: bool = field(default=False, metadata={"help": "continue from the latest checkpoint in --out"})
    max_bad_steps: int = field(default=5, metadata={"help": "stop after this many non-finite steps in a row"})
    eval_puzzles: int = field(default=256, metadata={"help": "embedded task: held-out puzzles to evaluate"})


# The embedded default: sizes and settings for a tiny model trained from scratch on the 2-core CPU. They apply only
# when --model is empty, and only to options not given on the command line.
EMBEDDED = dict(out="runs/sudoku-tiny", loss="gift", epochs=6, grad_accum=1, lr=2e-3,
                schedule="cosine", warmup_steps=50, weight_decay=0.0, log_every=100)
EMBEDDED_MODEL = dict(d_model=64, n_heads=4, n_kv_heads=4, n_layers=3, mlp_hidden_size=192, max_sequence_length=256)
EMBEDDED_GLOBAL_BATCH = 32  # split over the processes, so `python gift.py` and torchrun compute the same run
EMBEDDED_PUZZLES = dict(n_train=20000, n_blanks=(2, 8))  # held-out puzzles: --eval-puzzles, 8 blanks as d1's
# the answer "<answer>{16 digits}</answer><|eot_id|>" is 34 tokens: generate exactly that, one token per step
EMBEDDED_EVAL = dict(gen_length=34, block_length=34, steps=34, batch_size=64)
# options that may change between a run and its resumption
RESUMABLE_CHANGES = {"out", "resume", "log_every", "save_every", "keep_last", "max_bad_steps", "eval_puzzles",
                     "epochs", "max_steps"}


def parse_dataclass_flags(parser, cls, argv=None):
    """One flag per field of the dataclass `cls` (--name-with-dashes, typed, its help from the field's metadata);
    unknown flags are an error. Returns the fields given on the command line (a flag given as 0 is given)."""
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action="store_true", default=None, help=f.metadata["help"])
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type, f.type) if isinstance(f.type, str) else f.type
            parser.add_argument(flag, type=kind, default=None,
                                help=f"{f.metadata['help']} (default {f.default!r})")
    return {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}


def parse_options(argv=None):
    """TrainOptions from the command line (`python gift.py --help` lists every option)."""
    parser = argparse.ArgumentParser(description="GIFT / SFT fine-tuning of LLaDA (see README.md)")
    given = parse_dataclass_flags(parser, TrainOptions, argv)
    opts = TrainOptions(**given)
    if not opts.model:
        for k, v in EMBEDDED.items():
            if k not in given:
                setattr(opts, k, v)
        if "batch_size" not in given:
            opts.batch_size = max(1, EMBEDDED_GLOBAL_BATCH // int(os.environ.get("WORLD_SIZE", 1)))
    if opts.loss not in LOSSES:
        parser.error(f"--loss {opts.loss!r}: choose one of {', '.join(LOSSES)}")
    if opts.norm not in ("", "answer", "masked"):
        parser.error(f"--norm {opts.norm!r}: choose answer or masked")
    if opts.schedule not in ("linear", "cosine", "constant"):
        parser.error(f"--schedule {opts.schedule!r}: choose linear, cosine or constant")
    if opts.model and not opts.data:
        parser.error("--model needs --data (a JSONL file)")
    return opts


# torch.distributed.checkpoint warns that it saves "in a single process" when run without torchrun: it is meant
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

# -----------------------------------------------------------------------------
# Distributed set-up, straight from torchrun's environment (one process works without torchrun)


def setup_distributed():
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device
                                if device.type == "cuda" else None)
    return rank, world, device


def is_rank0():
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args):
    if is_rank0():
        print(*args, flush=True)


def all_reduce_sum(values, device):
    """Sum a list of floats over ranks (a no-op for one process)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def broadcast_object(obj):
    if dist.is_initialized():
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def gather_objects(obj):
    """Every rank's object, on every rank, in rank order."""
    if dist.is_initialized():
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def barrier():
    if dist.is_initialized():
        dist.barrier()


# -----------------------------------------------------------------------------
# Model and data


def build_embedded_task(opts, out):
    """The tiny default: a char-level tokenizer with LLaDA's special tokens, a tiny LLaDA initialised from the
    seed (identical on every rank), and Sudoku puzzles split into train / held-out with no puzzle in both."""
    tokenizer = make_char_tokenizer()
    config = tiny_config_for(tokenizer, **EMBEDDED_MODEL)
    model = LLaDA(config).init_weights(torch.Generator().manual_seed(opts.seed))
    train_pairs, _ = sudoku_split(EMBEDDED_PUZZLES["n_train"], 0, EMBEDDED_PUZZLES["n_blanks"], seed=opts.seed)
    _, heldout = sudoku_split(0, opts.eval_puzzles, 8, seed=opts.seed + 1)
    heldout = [pair for pair in heldout if pair[0] not in {p for p, _ in train_pairs}]
    return tokenizer, config, model, sudoku_examples(tokenizer, train_pairs), heldout


def wrap_model(model, opts, world, device, dtype):
    """LoRA: adapters on a frozen base, replicated with DDP. Full: FSDP2, one shard group per block then the root.
    bf16 on GPU: LoRA keeps the base in bf16 (adapters in float32); FSDP2 keeps float32 master weights and computes
    in bf16 with float32 gradient reductions."""
    if opts.activation_checkpointing:
        model.set_activation_checkpointing(True)
    if opts.lora:
        model.to(device=device, dtype=dtype)
        add_lora(model, r=opts.lora_r, alpha=opts.lora_alpha, dropout=opts.lora_dropout,
                 targets=tuple(opts.lora_targets.split(",")), generator=torch.Generator().manual_seed(opts.seed))
        if world > 1:
            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        return model
    model.to(device=device, dtype=torch.float32)
    if world > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for block in model.model.transformer.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    return model


def unwrap(model):
    return getattr(model, "module", model)


def lr_lambda(opts, total_steps):
    def f(step):
        if step < opts.warmup_steps:
            return (step + 1) / opts.warmup_steps
        progress = (step - opts.warmup_steps) / max(1, total_steps - opts.warmup_steps)
        if opts.schedule == "linear":
            return max(0.0, 1.0 - progress)
        if opts.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0
    return f


# -----------------------------------------------------------------------------
# Checkpoints: <out>/checkpoints/step-N/ = the model in an ecosystem format (a PEFT adapter, or a complete
# Hugging Face folder) + train_state/ (torch.distributed.checkpoint: model + optimizer, sharded under FSDP2)
# + trainer.json (step, data position, options) + rng.pt (every rank's RNG state, the LR schedule). Written to a
# temporary folder and renamed; <out>/latest names the newest complete one.


def save_checkpoint(model, optimizer, scheduler, opts, state, rng_states, tokenizer_files):
    out = Path(opts.out)
    name = f"step-{state['step']:07d}"
    final = out / "checkpoints" / name
    tmp = out / "checkpoints" / f"{name}.tmp"
    if is_rank0():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    sd_opts = StateDictOptions(ignore_frozen_params=opts.lora)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=sd_opts)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "train_state"))
    full = None
    if not opts.lora:  # gather the full weights (collective under FSDP2) for the Hugging Face export
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_rank0():
        if opts.lora:
            save_adapter(unwrap(model), tmp / "adapter", base_model_name_or_path=opts.model or "embedded")
        else:
            export = LLaDA(unwrap(model).config)
            export.load_state_dict(full)
            export.save_pretrained(tmp / "model")
            for f in tokenizer_files:  # tokenizer, official modeling code, generation config, ...
                shutil.copy2(f, tmp / "model" / f.name)
        torch.save({"rng": rng_states, "scheduler": scheduler.state_dict()}, tmp / "rng.pt")
        (tmp / "trainer.json").write_text(json.dumps({**state, "options": dataclasses.asdict(opts),
                                                      "world_size": dist.get_world_size()
                                                      if dist.is_initialized() else 1}, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # the checkpoint becomes visible only when complete
        atomic_write_text(out / "latest", name + "\n")
        for old in sorted((out / "checkpoints").glob("step-*"))[:-opts.keep_last]:
            if not old.name.endswith(".tmp"):
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(model, optimizer, scheduler, opts, world):
    out = Path(opts.out)
    latest = out / "latest"
    if not latest.exists():
        raise FileNotFoundError(f"--resume: no checkpoint in {out} (missing {latest})")
    ckpt = out / "checkpoints" / latest.read_text().strip()
    meta = json.loads((ckpt / "trainer.json").read_text())
    saved = meta["options"]
    differ = {k: (saved.get(k), v) for k, v in dataclasses.asdict(opts).items()
              if k not in RESUMABLE_CHANGES and saved.get(k) != v}
    if differ:
        raise ValueError(f"--resume: {ckpt} was written with different options (saved, now): {differ}")
    if meta["world_size"] != world:
        raise ValueError(f"--resume: {ckpt} was written by {meta['world_size']} processes, now {world}: "
                         "the global RNG states (LoRA dropout) are saved per rank")
    sd_opts = StateDictOptions(ignore_frozen_params=opts.lora, strict=not opts.lora)  # LoRA: adapters only
    model_sd, optim_sd = get_state_dict(model, optimizer, options=sd_opts)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(ckpt / "train_state"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=sd_opts)
    extra = torch.load(ckpt / "rng.pt", weights_only=False)
    scheduler.load_state_dict(extra["scheduler"])
    return meta, extra["rng"]


# -----------------------------------------------------------------------------
# The loop


def train(opts):
    rank, world, device = setup_distributed()
    out = Path(opts.out)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "bfloat16": torch.bfloat16, "float32": torch.float32}[opts.dtype]

    # model, tokenizer and data (every rank builds the same thing from the same seed)
    heldout = None
    if opts.model:
        tokenizer = load_tokenizer(opts.model)
        model = LLaDA.from_pretrained(opts.model, dtype=dtype if opts.lora else torch.float32)
        config = model.config
        examples, stats = load_dataset(opts.data, tokenizer, fmt=opts.data_format, max_len=opts.max_len,
                                       skip_bad_rows=opts.skip_bad_rows)
        base_files = [f for f in Path(opts.model).iterdir()
                      if f.is_file() and not f.name.endswith(".safetensors") and f.name not in
                      ("config.json", "model.safetensors.index.json")]
    else:
        tokenizer, config, model, examples, heldout = build_embedded_task(opts, out)
        stats = {"held_out_puzzles": len(heldout)}
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            tokenizer.save(str(out / "tokenizer.json"))
        barrier()
        base_files = [out / "tokenizer.json"]
    print0(f"data: {len(examples)} examples {stats}")
    ids_special = special_ids(tokenizer, config)

    model = wrap_model(model, opts, world, device, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opts.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=opts.weight_decay)
    global_batch = opts.batch_size * opts.grad_accum * world
    steps_per_epoch = math.ceil(len(examples) / global_batch)
    total_steps = opts.epochs * steps_per_epoch
    if opts.max_steps:
        total_steps = min(total_steps, opts.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(opts, total_steps))

    state = {"step": 0, "epoch": 0, "step_in_epoch": 0, "bad_in_row": 0, "skipped_steps": 0}
    first_step = 0
    if opts.resume:
        meta, rng = load_checkpoint(model, optimizer, scheduler, opts, world)
        state.update({k: meta[k] for k in state})
        first_step = state["step"]
        torch.set_rng_state(rng[rank]["cpu"])  # LoRA dropout draws from the global generators
        if rng[rank]["cuda"] is not None:
            torch.cuda.set_rng_state(rng[rank]["cuda"], device)
        print0(f"resumed from step {state['step']} (epoch {state['epoch']}, step {state['step_in_epoch']})")

    # GIFT*: betas of the frozen initial model, computed once per example and cached (Appendix "GIFT*")
    ref_betas = None
    if opts.loss == "gift-star":
        ref_betas = reference_betas_cache(model, examples, opts, rank, world, device, ids_special)

    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" and dtype == torch.bfloat16
                else contextlib.nullcontext())
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    metrics = open(out / "metrics.jsonl", "a") if rank == 0 else None
    t_start, tokens_seen, window = time.time(), 0, []
    model.train()
    while state["step"] < total_steps:
        order = epoch_order(len(examples), state["epoch"], opts.seed)
        batches = step_batches(order, global_batch)
        while state["step_in_epoch"] < len(batches) and state["step"] < total_steps:
            step_indices = batches[state["step_in_epoch"]]
            everyone = [rank_micro_batches(step_indices, r, world, opts.batch_size, opts.grad_accum)
                        for r in range(world)]
            micro = everyone[rank]
            # pad micro-batch j to the longest example of micro-batch j over ALL ranks: pads are trained on, so
            # this keeps the distributed loss equal to the single-process one (every rank knows every index)
            pad_lengths = [opts.max_len if opts.pad_to_max_len else
                           max([len(examples[i][0]) for r in range(world) for i in everyone[r][j]] or [1])
                           for j in range(opts.grad_accum)]
            # pass 1 for every micro-batch: the noise (and for GIFT the no-grad entropy pass)
            prepared, local = [], {"rows": 0.0, "masked": 0.0, "answer": 0.0, "tokens": 0.0}
            for idx, pad_to in zip(micro, pad_lengths):
                real = len(idx) > 0
                rows = idx if real else [0]  # a zero-weight dummy keeps DDP / FSDP2 in lockstep
                input_ids, prompt_lengths = collate([examples[i] for i in rows], ids_special.pad,
                                                    pad_to=max(pad_to, len(examples[rows[0]][0])))
                input_ids, prompt_lengths = input_ids.to(device), prompt_lengths.to(device)
                L = input_ids.shape[1]
                answer_mask = torch.arange(L, device=device)[None] >= prompt_lengths[:, None]
                rb = None if ref_betas is None else ref_betas[rows][:, :L].to(device)
                with autocast:
                    noisy_ids, weight, norm, stats = objective_batch(
                        opts.loss, model, input_ids, answer_mask,
                        [example_generator(opts.seed, state["epoch"], i, device) for i in rows], eps=opts.eps,
                        beta_power=opts.beta_power, ref_betas=rb)
                norm = opts.norm or norm
                if not real:
                    weight = torch.zeros_like(weight)
                masked = (noisy_ids == config.mask_token_id) & answer_mask
                if real:
                    local["rows"] += len(rows)
                    local["masked"] += float(masked.sum())
                    local["answer"] += float(answer_mask.sum())
                    local["tokens"] += input_ids.numel()
                prepared.append((input_ids, noisy_ids, weight, answer_mask, norm, stats, real))
            g_rows, g_masked, g_answer, g_tokens = all_reduce_sum(
                [local["rows"], local["masked"], local["answer"], local["tokens"]], device)

            # pass 2: the loss with the GLOBAL normaliser, so N ranks x K micro-steps give exactly the loss of one
            # process on the whole global batch (DDP / FSDP2 average gradients over ranks, hence the * world)
            loss_sum = 0.0
            for j, (input_ids, noisy_ids, weight, answer_mask, norm, stats, real) in enumerate(prepared):
                last = j == len(prepared) - 1
                sync = gradient_sync(model, enabled=last)
                with sync, autocast:
                    denominator = max(g_masked, 1.0) if norm == "masked" else g_rows
                    loss = diffusion_loss(model, input_ids, noisy_ids, weight, answer_mask, norm=norm,
                                          denominator=denominator)
                    (loss * world).backward()
                loss_sum += float(loss.detach())
            loss_global = all_reduce_sum([loss_sum], device)[0]

            grad_norm = (torch.nn.utils.clip_grad_norm_(params, opts.grad_clip) if opts.grad_clip > 0
                         else torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            finite = math.isfinite(loss_global) and math.isfinite(grad_norm)
            if finite:
                optimizer.step()
                state["bad_in_row"] = 0
            else:  # skip the update; the last good checkpoint stays as it is
                state["bad_in_row"] += 1
                state["skipped_steps"] += 1
                print0(f"step {state['step'] + 1}: non-finite loss {loss_global} or grad norm {grad_norm}, "
                       f"update skipped ({state['bad_in_row']} in a row)")
                if state["bad_in_row"] >= opts.max_bad_steps:
                    raise RuntimeError(f"{opts.max_bad_steps} non-finite steps in a row, the last at step "
                                       f"{state['step'] + 1}; stopping (last good checkpoint in {out / 'latest'})")
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            state["step"] += 1
            state["step_in_epoch"] += 1
            tokens_seen += g_tokens
            window.append((loss_global, grad_norm, g_masked / max(g_answer, 1.0), prepared[0][5]))

            if state["step"] % opts.log_every == 0 or state["step"] == total_steps:
                elapsed = time.time() - t_start
                betas = [w[3] for w in window if "beta_mean" in w[3]]
                record = {
                    "step": state["step"], "total_steps": total_steps, "epoch": state["epoch"],
                    "loss": sum(w[0] for w in window) / len(window), "lr": scheduler.get_last_lr()[0],
                    "grad_norm": sum(w[1] for w in window) / len(window),
                    "masked_fraction": sum(w[2] for w in window) / len(window),
                    "tokens_per_s": tokens_seen / elapsed, "elapsed_s": elapsed,
                    "eta_s": elapsed / (state["step"] - first_step)
                    * (total_steps - state["step"]), "skipped_steps": state["skipped_steps"],
                }
                if betas:
                    record["beta_mean"] = sum(float(b["beta_mean"]) for b in betas) / len(betas)
                    record["beta_std"] = sum(float(b["beta_std"]) for b in betas) / len(betas)
                print0(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))
                if metrics:
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                window = []

            epoch_done = state["step_in_epoch"] == len(batches)
            if epoch_done:
                state["epoch"] += 1
                state["step_in_epoch"] = 0
            if (opts.save_every and state["step"] % opts.save_every == 0) or \
                    (not opts.save_every and epoch_done) or state["step"] == total_steps:
                rng_states = gather_objects({"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device)
                                             if device.type == "cuda" else None})
                save_checkpoint(model, optimizer, scheduler, opts, dict(state), rng_states, base_files)
    final = Path(opts.out) / "checkpoints" / (Path(opts.out) / "latest").read_text().strip()
    print0(f"done: {state['step']} steps in {time.time() - t_start:.0f} s; checkpoint {final}")
    return model, tokenizer, heldout, final


def example_generator(seed, epoch, index, device):
    """The noise of example `index` in `epoch` (its t and its mask) comes from its own seeded generator: the draws
    do not depend on the batch layout (N ranks draw what one process draws) and a resumed run redraws them."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + epoch) * 10_000_019 + index)


def gradient_sync(model, enabled):
    """Skip the gradient all-reduce on all but the last micro-step (DDP: no_sync; FSDP2: requires_gradient_sync)."""
    if isinstance(model, DDP):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


@torch.no_grad()
def reference_betas_cache(model, examples, opts, rank, world, device, ids_special):
    """GIFT*: betas of the frozen initial model, one no-grad pass over the dataset before training, each example
    padded to the dataset's longest length (a batch of length L uses the first L). Cached in <out>/ref_betas.pt
    and reused on resume; the ranks split the pass and share the result."""
    path = Path(opts.out) / "ref_betas.pt"
    if path.exists():
        cache = torch.load(path)
        if cache["n"] == len(examples) and cache["beta_power"] == opts.beta_power:
            return cache["betas"]
    L_max = opts.max_len if opts.pad_to_max_len else max(len(ids) for ids, _ in examples)
    mine = list(range(rank, len(examples), world))
    rows = []
    with lora_disabled(unwrap(model)):
        for start in range(0, len(mine), opts.batch_size):
            idx = mine[start:start + opts.batch_size]
            input_ids, prompt_lengths = collate([examples[i] for i in idx], ids_special.pad, pad_to=L_max)
            input_ids, prompt_lengths = input_ids.to(device), prompt_lengths.to(device)
            answer_mask = torch.arange(L_max, device=device)[None] >= prompt_lengths[:, None]
            rows += list(zip(idx, entropy_betas(model, input_ids, answer_mask, power=opts.beta_power).float().cpu()))
    betas = torch.zeros(len(examples), L_max)
    for part in gather_objects(rows):
        for i, b in part:
            betas[i] = b
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"n": len(examples), "beta_power": opts.beta_power, "betas": betas}, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
    return betas


def evaluate_embedded(heldout, checkpoint, seed, device):
    """Held-out Sudoku accuracy (eval.py's grader: correct cells among the blanks) of the trained checkpoint and,
    for scale, of the same architecture untrained. Every rank loads the saved folder and grades a slice."""
    items = [dict(question=SUDOKU_QUESTION.format(puzzle=p), puzzle=p, solution=s) for p, s in heldout]
    trained = LLaDA.from_pretrained(checkpoint / "model", device=device)
    tokenizer = load_tokenizer(checkpoint / "model")
    untrained = LLaDA(trained.config).init_weights(torch.Generator().manual_seed(seed)).to(device)
    results = {}
    for name, model in (("untrained", untrained), ("trained", trained)):
        t0 = time.time()
        acc, records = evaluate(model, tokenizer, items, "sudoku", prompt_style="plain", **EMBEDDED_EVAL)
        if records is not None:
            solved = sum(r["correct_cells"] == r["empty_cells"] for r in records) / len(records)
            results[name] = acc
            print0(f"held-out Sudoku ({len(records)} puzzles, {name}): cell accuracy {acc:.1f}%, "
                   f"whole puzzles solved {100 * solved:.1f}% ({time.time() - t0:.0f} s)")
    return results


def main(argv=None):
    opts = parse_options(argv)
    model, tokenizer, heldout, checkpoint = train(opts)
    if heldout is not None:  # the embedded default: evaluate on held-out puzzles with the block sampler
        evaluate_embedded(heldout, checkpoint, opts.seed, next(model.parameters()).device)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
