"""GIFT: Guided Importance-Aware Fine-Tuning of masked diffusion LMs (arXiv 2509.20863), on LLaDA and Dream.

    torchrun --nproc_per_node 8 gift.py --model LLaDA-8B-Instruct --data s1k.jsonl --lora   # the paper's recipes
    python gift.py                 # the embedded default: a tiny LLaDA learns 4x4 Sudoku on the CPU, then is evaluated

The file reads in two parts. Part I, GIFT itself (Theorem 1, Algorithms 1-2, the objectives, the loss): tensors in,
tensors out, only math and torch, to copy next to any LLaDA. Part II, training: gift_loss (GIFT's whole step once,
plainly: the function to port), the options, the model on its devices, one optimizer step (train_step), the loop
(train), main; its bookkeeping is calls into longjob.py, the embedded default's task embedded.py.

Every objective in the paper is ONE estimator of the weighted loss of Theorem 1 (eq. 10):

    L = sum_i E[ 1[x_t^i = M] * w_i * -log p(x0^i | x_t) ]

pick a masking probability p_i for every answer token, mask each one independently with probability p_i (the prompt
never), run the model once on the noisy sequence, and sum the cross-entropy at the masked answer positions times a
per-token weight w_i. The objectives differ only in p_i and w_i (p = (1 - eps) t + eps, t ~ U(0, 1) per row;
r_i = beta_i / beta_ref; H_i the entropy of Algorithm 1):

    name       p_i                                      w_i at masked answer tokens    norm    source
    sft        p                                        1 / p                          answer  eq. (1), LLaDA
    gift       t_i = 1 - (1 - p)^r_i, beta_i = H_i^0.5  1 / t_i                        masked  Thm 1, Alg. 1-2
    gift-elbo  t_i as in gift                           r_i (1 - p)^(r_i - 1) / t_i    answer  Thm 1 + Jacobian
    gift-sw    p                                        beta_i / p, beta_i = H_i^0.5   answer  ablation, eq. (15)
    nll        t_i with beta_i = -log p(x0^i)           1 / t_i                        masked  ablation, eq. (13)
    cart       p                                        w_cart_i / p                   answer  ablation, eq. (16)
    gift-star  t_i with the INITIAL model's betas       1 / t_i                        masked  Appendix "GIFT*"

The paper's estimator is not the ELBO. Appendix A changes variables from t to t_i and ends with sum_i integral dt_i
E[1[masked] / t_i * -log p], an integral over each token's OWN time t_i; Algorithm 2 samples one t ~ U(0, 1) and
weights by 1 / t_i, i.e. it integrates over t and drops the Jacobian dt_i/dt = r_i (1 - t)^(r_i - 1). With the
Jacobian (`gift-elbo`) the objective is the exact negative ELBO of the forward process with per-token rates beta_i:
for an exact denoiser it equals -log p(x0) for ANY betas, as SFT does. Without it (`gift`, what the paper ran) it is a
reweighting that is neither -log p(x0) nor a bound on it (tests/test_losses.py pins both down by exact enumeration).
"""

# =====================================================================================================================
# Part I. GIFT, the paper (arXiv 2509.20863, section 3 and Algorithms 1-2), to read first and to copy next to any
# LLaDA. It never calls a model: the caller passes the final hidden states (B, L, D) and the LM head (the official
# Hugging Face LLaDA's: `output_hidden_states=True`, its `ff_out`), or the logits (head=None), and mask_id.
# =====================================================================================================================

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

EPS = 1e-3  # LLaDA's t -> p = (1 - eps) t + eps, keeps 1/p finite
BETA_POWER = 0.5  # beta_i = H_i^0.5 (eq. 12); 1.0 is the raw-entropy ablation
CART_P = 0.3  # the paper's choice for the geometric kernel of Dream's CART weights (ablation, below eq. 16)
# answer positions whose full-vocabulary logits exist at one time: 256 x 126464 x 4 B = 128 MB per (c, V) tensor,
# and a chunk holds a few of them at once (bench/memory.py: a quarter of the naive step's memory needs <= 256)
CE_CHUNK = 256


def uniforms(shape, generator, device, dtype=None):
    """U(0, 1) draws of `shape` (B, ...) in `dtype` (None: float32) from one generator (None: torch's global one), or
    from B generators, one per row (one per example: N processes then draw what one draws, for any batch split)."""
    if generator is None or isinstance(generator, torch.Generator):
        where = device if generator is None else generator.device
        return torch.rand(shape, dtype=dtype, device=where, generator=generator).to(device)
    return torch.stack([torch.rand(shape[1:], dtype=dtype, device=g.device, generator=g) for g in generator]).to(device)


# ---------------------------------------------------------------------------------------------------------------------
# Masking probabilities p_i (B, L), 0 on prompt positions: SFT's one rate, and Theorem 1's per-token rates


def p_of_t(t, eps=EPS):
    """LLaDA's map of the time t (B,) to SFT's masking probability p = (1 - eps) t + eps (B,): 1/p stays finite."""
    return (1 - eps) * t + eps


def sft_mask_probs(t, answer_mask, eps=EPS):
    """LLaDA's SFT (eq. 1): every answer token is masked with p = p_of_t(t). t (B,), answer_mask (B, L) -> (B, L)."""
    p = p_of_t(t, eps)[:, None]  # (B, 1)
    return torch.where(answer_mask, p, 0.0)


def beta_ratios(beta, answer_mask):
    """r_i = beta_i / beta_ref, beta_ref = the mean of beta over the row's answer tokens (Algorithm 2, "beta_ref <-
    sum_i beta_i M_i / sum_i M_i"). A row whose beta_ref is 0 (all entropies zero) gets r = 1, i.e. SFT. (B, L)."""
    am = answer_mask.to(beta.dtype)
    beta_ref = (beta * am).sum(1, keepdim=True) / am.sum(1, keepdim=True).clamp_min(1)  # (B, 1)
    ok = beta_ref > 0
    r = torch.where(ok, beta / torch.where(ok, beta_ref, 1.0), 1.0)
    return torch.where(answer_mask, r, 0.0)


def gift_mask_probs(t, beta, answer_mask, eps=EPS):
    """Theorem 1: with the rate matrix Q of eq. (9) (token i jumps to [M] at rate beta_i) and the schedule
    fbar(t) = -log(1 - t) / beta_ref, token i is masked at time t with probability
        t_i = 1 - exp(-beta_i fbar(t)) = 1 - (1 - t)^(beta_i / beta_ref)     (Algorithm 2, "t_i <- ...")
    after t is mapped to p = p_of_t(t) as in SFT. Computed as -expm1(r log1p(-p)) (no cancellation for small t) and
    clamped to [eps, 1] so that a token with beta ~ 0 cannot produce a 1/t_i blow-up. t (B,), beta (B, L) -> (B, L)."""
    p = p_of_t(t, eps)  # (B,)
    r = beta_ratios(beta, answer_mask)  # (B, L)
    t_i = (-torch.expm1(r * torch.log1p(-p)[:, None])).clamp(eps, 1)
    return torch.where(answer_mask, t_i, 0.0)


def mask_tokens(input_ids, p_mask, u, mask_id):
    """Algorithm 2, "M'^i ~ Bernoulli(t_i); I' <- (1 - M') I + M' m": token i is masked where its uniform u_i < p_i
    (one uniform per position, as LLaDA's recipe; p_mask is 0 on the prompt, which stays clean). (B, L) -> (B, L)."""
    return torch.where(u < p_mask, mask_id, input_ids)


# ---------------------------------------------------------------------------------------------------------------------
# Weights w_i (B, L), only read at masked answer positions


def importance_weights(p_mask, answer_mask):
    """The 1 / t_i of Theorem 1 (1 / p for SFT): E[1[masked_i] / t_i] = 1, so every token counts once on average."""
    return torch.where(answer_mask, 1 / p_mask, 0.0)


def gift_elbo_jacobian(t, beta, answer_mask, eps=EPS):
    """dt_i/dp = r_i (1 - p)^(r_i - 1), the Jacobian of Appendix A's change of variables t -> t_i, which `gift-elbo`
    multiplies in (the top of this file says why); where t_i hits the eps clamp, the unclamped t_i's. (B, L)."""
    p = p_of_t(t, eps)  # (B,)
    r = beta_ratios(beta, answer_mask)  # (B, L)
    jac = r * torch.exp((r - 1) * torch.log1p(-p)[:, None])
    return torch.where(answer_mask, jac, 0.0)


def cart_weights(unmasked, p=CART_P):
    """Dream's context-adaptive reweighting, CART (ablation, eq. 16): w_i = 1/2 sum_j 1[x_t^j != M] Geo(p, |i - j| - 1),
    Geo(p, k) = p (1 - p)^k: a masked token next to many clean ones (the prompt included) is easier, weighs more."""
    pos = torch.arange(unmasked.shape[1], device=unmasked.device)
    d = (pos[:, None] - pos[None, :]).abs().float()  # (L, L) distance |i - j|
    geo = torch.where(d > 0, p * (1 - p) ** (d - 1).clamp_min(0), 0.0)  # (L, L), symmetric, 0 on the diagonal
    return 0.5 * unmasked.float() @ geo


# ---------------------------------------------------------------------------------------------------------------------
# Algorithm 1, the entropy pass: mask the whole answer, one no-grad forward, the entropy at every answer position


def mask_answer(input_ids, answer_mask, mask_id):
    """Algorithm 1, "I'^i <- (1 - M^i) I^i + M^i m": the input of the entropy pass, the whole answer masked."""
    return input_ids.masked_fill(answer_mask, mask_id)


def head_logits(head, h):
    """Logits (c, V) of hidden states h (c, D) in float32 (float64 for a float64 model); head=None: h are logits."""
    logits = h if head is None else head(h)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


@torch.no_grad()
def answer_entropy_and_nll(hidden, head, input_ids, answer_mask, chunk_size=CE_CHUNK):
    """Algorithm 1's entropy H_i = -sum_j softmax(z_ij) log_softmax(z_ij) and the NLL -log softmax(z_i)[x0^i] (the
    "nll" ablation's beta, eq. 13) at every answer position, one chunk of logits at a time. hidden (B, L, D): the
    final hidden states on mask_answer(input_ids, ...), in eval mode (no dropout). Returns H, nll (B, L) float32."""
    H = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    nll = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    h, targets = hidden[answer_mask], input_ids[answer_mask]  # (N, D), (N,)
    H_ans, nll_ans = [], []
    for s in range(0, len(h), chunk_size):
        logits = head_logits(head, h[s:s + chunk_size])  # (c, V)
        logp = F.log_softmax(logits, dim=-1)
        del logits  # the logits or their log-softmax, not both, beside the entropy's exp
        nll_ans.append(-logp.gather(-1, targets[s:s + chunk_size, None])[:, 0])
        H_ans.append(-logp.exp().mul_(logp).sum(-1))
        del logp  # before the next chunk's logits: at most two (c, V) float32 tensors at any time
    if H_ans:
        H[answer_mask] = torch.cat(H_ans).to(H.dtype)
        nll[answer_mask] = torch.cat(nll_ans).to(nll.dtype)
    return H, nll


def entropy_betas(H, answer_mask, power=BETA_POWER):
    """Algorithm 1, "beta_i <- M^i sqrt(H_i)": beta_i = H_i^power at answer positions, 0 elsewhere (eq. 12). (B, L)."""
    return torch.where(answer_mask, H.clamp_min(0) ** power, 0.0)


# ---------------------------------------------------------------------------------------------------------------------
# The objectives: one small function per row of the table at the top of this file. Each maps the draws (t (B,) and
# the uniforms u (B, L): token i is masked where u_i < p_i) and the betas (B, L) to (p_i, w_i), both (B, L).


def sft_objective(t, u, beta, answer_mask, eps):
    """eq. (1): p_i = p = p_of_t(t), w_i = 1 / p."""
    p = sft_mask_probs(t, answer_mask, eps)
    return p, importance_weights(p, answer_mask)


def gift_objective(t, u, beta, answer_mask, eps):
    """Theorem 1 / Algorithm 2: p_i = t_i, w_i = 1 / t_i; also `nll` (eq. 13) and `gift-star` (GIFT*): other betas."""
    t_i = gift_mask_probs(t, beta, answer_mask, eps)
    return t_i, importance_weights(t_i, answer_mask)


def gift_elbo_objective(t, u, beta, answer_mask, eps):
    """GIFT with the Jacobian of Appendix A's change of variables: w_i = r_i (1 - p)^(r_i - 1) / t_i."""
    t_i = gift_mask_probs(t, beta, answer_mask, eps)
    return t_i, importance_weights(t_i, answer_mask) * gift_elbo_jacobian(t, beta, answer_mask, eps)


def gift_sw_objective(t, u, beta, answer_mask, eps):
    """eq. (15), the "GIFT (SW)" ablation: SFT's masking, w_i = sqrt(H_i) / p (beta_i = sqrt(H_i))."""
    p = sft_mask_probs(t, answer_mask, eps)
    return p, importance_weights(p, answer_mask) * beta


def cart_objective(t, u, beta, answer_mask, eps):
    """eq. (16), Dream's CART: SFT's masking, w_i = w_cart_i / p, w_cart from the tokens this very mask leaves clean."""
    p = sft_mask_probs(t, answer_mask, eps)
    return p, importance_weights(p, answer_mask) * cart_weights(~(u < p))


# name -> (p_i and w_i, where the betas come from, the default normalisation). Betas: "entropy" = H_i^beta_power
# (Algorithm 1), "nll" = -log p(x0^i) (eq. 13), "initial_entropy" = the initial model's entropy betas (GIFT*).
OBJECTIVES = {
    "sft": (sft_objective, None, "answer"),
    "gift": (gift_objective, "entropy", "masked"),
    "gift-elbo": (gift_elbo_objective, "entropy", "answer"),
    "gift-sw": (gift_sw_objective, "entropy", "answer"),
    "nll": (gift_objective, "nll", "masked"),
    "cart": (cart_objective, None, "answer"),
    "gift-star": (gift_objective, "initial_entropy", "masked"),
}
LOSSES = tuple(OBJECTIVES)
DEFAULT_NORM = {name: norm for name, (_, _, norm) in OBJECTIVES.items()}


def objective_batch(loss_name, input_ids, answer_mask, generator, mask_id, beta=None, eps=EPS):
    """Between the entropy pass and the gradient pass: t ~ U(0, 1), p_i, the noisy sequence and the weights, noisy_ids
    and weight (B, L) float32 for diffusion_loss. beta (B, L): None for sft and cart. The draws: t (B,), then one
    uniform per position, so an objective whose p_i is SFT's masks exactly as SFT from the same generator state."""
    objective, betas_from, _ = OBJECTIVES[loss_name]
    if (beta is None) != (betas_from is None):
        raise ValueError(f"gift.py objective_batch: {loss_name!r} " + ("needs betas" if beta is None else
                                                                       "uses no betas, yet beta was given"))
    t = uniforms((len(input_ids),), generator, input_ids.device)  # (B,) Algorithm 2, "t ~ U(0, 1)"
    u = uniforms(input_ids.shape, generator, input_ids.device)  # (B, L) token i is masked where u_i < p_i
    p_mask, weight = objective(t, u, None if beta is None else beta.to(t.dtype), answer_mask, eps)
    return mask_tokens(input_ids, p_mask, u, mask_id), weight.detach()


# ---------------------------------------------------------------------------------------------------------------------
# The weighted loss of Theorem 1 (Algorithm 2's second, gradient-carrying pass; gift_loss below is the whole step)


def _cross_entropy_chunk(head, h, targets):
    return F.cross_entropy(head_logits(head, h), targets, reduction="none")  # (c,), softmax in float32


def chunked_cross_entropy(head, h, targets, chunk_size=CE_CHUNK):
    """-log softmax(head(h))[target] for h (N, D), targets (N,) -> (N,), one chunk of logits at a time, recomputed in
    backward (activation checkpointing). With N = 0 one empty chunk still runs: the head stays in the autograd graph."""
    losses = []
    for s in range(0, max(len(h), 1), chunk_size):
        hc, yc = h[s:s + chunk_size], targets[s:s + chunk_size]
        if torch.is_grad_enabled():
            losses.append(checkpoint(_cross_entropy_chunk, head, hc, yc, use_reentrant=False))
        else:
            losses.append(_cross_entropy_chunk(head, hc, yc))
    return torch.cat(losses)


def diffusion_loss(hidden, head, input_ids, noisy_ids, weight, answer_mask, mask_id, norm="answer", denominator=None,
                   chunk_size=CE_CHUNK):
    """Theorem 1 / Algorithm 2, "S <- sum_i 1[M'^i = 1] / t_i CrossEntropy(z_i, l_i)", with the objective's weight:
    the sum over masked answer tokens (noisy_ids == mask_id within answer_mask) of weight * CE, normalised. hidden
    (B, L, D): the final hidden states on noisy_ids. Logits only at masked positions, chunk by chunk; the loss (0-dim)
    is float32 (float64 for a float64 model). With no masked token it is 0, still connected to the head (no DDP hang).
    norm "answer": each row's sum / that row's answer length (EOS padding counts), then / B: LLaDA's SFT recipe;
    "masked": the total / the number of masked tokens (Algorithm 2, "L <- S / N"). denominator overrides B or N: pass
    the GLOBAL count over ranks and micro-batches; DDP and FSDP2 AVERAGE gradients, so backpropagate loss * world."""
    masked = (noisy_ids == mask_id) & answer_mask  # (B, L)
    ce = chunked_cross_entropy(head, hidden[masked], input_ids[masked], chunk_size)  # (N,)
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


# =====================================================================================================================
# Part II. Training: GIFT's whole step once, plainly (`gift_loss`); the options; the model on its devices; GIFT's
# passes besides the loss; one optimizer step (`train_step`); the loop (`train`; its bookkeeping: longjob.py); main().
# =====================================================================================================================

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from torch.nn.parallel import DistributedDataParallel as DDP

import embedded
from data import (FORMATS, Split, collate, data_fingerprint, epoch_batches, load_dataset, load_tokenizer, special_ids,
                  step_micro_batches)
from longjob import (DTYPES, EXPORTED, SEED_RULE, SEEDS, CheckpointManager, Export, MetricsLog, RunError, all_reduce,
                     banner, clipped_step, compute_device, compute_dtype, describe_data, end_distributed, folder_fingerprint,
                     gather_objects, is_rank0, is_sharded, load_weights, not_a_model_folder,
                     parse_dataclass_flags, print0, rank_and_world, run_command_line, run_folder, setup_distributed)
from model import (LINEARS, LLaDA, LORA, LORA_TARGETS, add_lora, atomic_write_text, check_fields, load_weight_rows,
                   lora_disabled, lora_layers, predicting_hidden, read_config, stored_dtype, unwrap)

# ---------------------------------------------------------------------------------------------------------------------
# GIFT's step once, plainly: what train_step computes, for one batch on one process, in a dozen lines


def model_logits(model, input_ids):
    """gift_loss's default `logits`: model(input_ids), our LLaDA's tensor or a Hugging Face output's .logits."""
    out = model(input_ids)
    return getattr(out, "logits", out)


def gift_loss(model, input_ids, answer_mask, mask_id, generator=None, beta_power=BETA_POWER, eps=EPS, n_masked=None,
              logits=model_logits):
    """GIFT's loss for a batch (Algorithms 1-2) to backpropagate: train_step's number (tests/test_gift_loss.py).
    The entropy pass runs in eval mode (no dropout). logits(model, ids) -> (B, L, V), each position predicting its own
    token (Dream's are shifted: pass e.g. `lambda m, x: m.head(predicting_hidden(m, x))`). n_masked: Algorithm 2's N
    (None: this batch's count); under gradient accumulation or DDP pass the GLOBAL count."""
    # Algorithm 1: the whole answer masked, one no-grad pass with dropout off, the entropy H_i at each answer position
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logp = F.log_softmax(logits(model, mask_answer(input_ids, answer_mask, mask_id)).float(), dim=-1)
        beta = entropy_betas(-(logp.exp() * logp).sum(-1), answer_mask, beta_power)  # (B, L) beta_i = H_i^0.5
    model.train(was_training)
    # Algorithm 2: t ~ U(0, 1) per row, t_i = 1 - (1 - t)^(beta_i / beta_ref), each answer token masked w.p. t_i
    t = uniforms((len(input_ids),), generator, input_ids.device)  # (B,)
    u = uniforms(input_ids.shape, generator, input_ids.device)  # (B, L)
    t_i = gift_mask_probs(t, beta, answer_mask, eps)  # (B, L)
    noisy_ids = mask_tokens(input_ids, t_i, u, mask_id)
    masked = (noisy_ids == mask_id) & answer_mask  # (B, L)
    # the cross-entropy at the masked answer tokens, weighted 1 / t_i, over the number of masked tokens N
    ce = F.cross_entropy(logits(model, noisy_ids)[masked].float(), input_ids[masked], reduction="none")  # (N,)
    return (ce / t_i[masked]).sum() / (masked.sum().clamp_min(1) if n_masked is None else n_masked)


LOSS_ALIASES = {"dream": "cart"}  # the paper's name for eq. (16)'s ablation (Dream's CART weights), read as cart


def option(default, help, **rule):
    """A TrainOptions field: its default, its flag's help and its rule (choices; range and what: model.check_fields)."""
    return field(default=default, metadata=dict(help=help, **rule))


AT_LEAST_1 = dict(range="[1, inf)", what="must be at least 1")  # a NaN lies in no range: it fails too
OFF_OR_MORE = dict(range="[0, inf)", what="must be 0 (off) or more")


@dataclass
class TrainOptions:
    # what to train
    model: str = option("", "Hugging Face LLaDA or Dream model folder; empty = the embedded tiny Sudoku task")
    data: str = option("", "training JSONL (messages, prompt/response, s1K or s1K-1.1)")
    data_format: str = option("auto", "the JSONL's layout (auto: from the first row)", choices=("auto",) + FORMATS)
    out: str = option("runs/default", "output folder: checkpoints, metrics.jsonl")
    loss: str = option("gift", "objective (the table in gift.py's docstring; dream: the paper's name for cart)",
                       choices=LOSSES + tuple(LOSS_ALIASES))
    norm: str = option("", "loss normalisation; empty = the objective's default", choices=("", "answer", "masked"))
    beta_power: float = option(BETA_POWER, "beta_i = H_i^power (0.5 = paper; 1.0 = raw entropy)", range="(0, 10]",
                               what="must be in (0, 10] (0.5 the paper, 1 raw entropy; more overflows)")
    beta_refresh_epochs: int = option(1, "entropy-pass objectives: an example's betas are reused for this many epochs "
                                      "(1 = the paper: every visit; 0 = never recomputed)", range="[0, inf)",
                                      what="must be 1 (every visit), more, or 0 (never)")
    eps: float = option(EPS, "LLaDA's masking floor: t -> (1 - eps) t + eps (not Dream's sampling eps)", range="[0, 1)")
    # LoRA (DDP) or full fine-tuning (FSDP2), and how the processes hold the model
    lora: bool = option(False, "LoRA fine-tuning (DDP); default full (FSDP2)")
    lora_r: int = option(LORA["r"], "LoRA rank", **AT_LEAST_1)
    lora_alpha: float = option(LORA["alpha"], "LoRA alpha (scale alpha / r)", range="(0, inf)",
                               what="must be a positive number (the adapters' scale is alpha / r; 0 trains nothing)")
    lora_dropout: float = option(LORA["dropout"], "LoRA dropout", range="[0, 1)")
    lora_targets: str = option(",".join(LORA_TARGETS), "comma-separated block linears (ff_out: the head too, as PEFT)")
    parallel: str = option("", "ddp: each process holds the whole model (LoRA only); fsdp: FSDP2 shards it (with --lora"
                           " the frozen base); empty = ddp with --lora, else fsdp", choices=("", "ddp", "fsdp"))
    cpu_offload: bool = option(False, "FSDP2: parameters, gradients and optimizer state on the host, each block "
                               "copied to the GPU for its passes: a model too big for the GPUs (slower: PCIe)")
    # optimisation
    epochs: int = option(20, "passes over the data", **AT_LEAST_1)
    max_steps: int = option(0, "stop after this many optimizer steps (0 = epochs)", **OFF_OR_MORE)
    batch_size: int = option(1, "examples per device per micro-step", **AT_LEAST_1)
    grad_accum: int = option(4, "micro-steps per optimizer step", **AT_LEAST_1)
    lr: float = option(1e-5, "peak learning rate", range="[0, inf)", what="must be positive")
    schedule: str = option("linear", "decay after warm-up", choices=("linear", "cosine", "constant"))
    warmup_steps: int = option(0, "linear warm-up steps", range="[0, inf)", what="must be 0 (none) or more")
    weight_decay: float = option(0.1, "AdamW weight decay", range="[0, inf)", what="must be 0 or more")
    grad_clip: float = option(1.0, "max gradient norm (0 = off)", range="[0, inf)",
                              what="must be 0 (off) or a finite positive norm")
    max_len: int = option(4096, "drop (and count) longer examples", range="[2, inf)",
                          what="must be at least 2 (a prompt token and an answer token)")
    pad_to_max_len: bool = option(False, "pad every batch to max_len, as d1/wd1")
    skip_bad_rows: bool = option(False, "skip and count malformed rows")
    seed: int = option(42, "model init, data order, noise and dropout seed", range=f"[{SEEDS.start}, {SEEDS.stop})",
                       what=f"must be {SEED_RULE}")
    dtype: str = option("auto", "compute dtype (auto: bf16 on GPU, float32 on CPU)", choices=DTYPES)
    activation_checkpointing: bool = option(False, "recompute blocks in backward")
    save_dtype: str = option("auto", "exported weights (auto: the base's stored dtype)", choices=DTYPES)
    save_merged: bool = option(False, "LoRA: each checkpoint also exports merged/ (the adapters folded into the base)")
    # bookkeeping
    log_every: int = option(10, "optimizer steps between log lines", **AT_LEAST_1)
    wandb_project: str = option("", "also send each metrics.jsonl record to this Weights & Biases project "
                                "(WANDB_MODE=offline needs no network; --resume continues the same W&B run)")
    save_every: int = option(0, "optimizer steps between checkpoints (0 = each epoch)", **OFF_OR_MORE)
    keep_last: int = option(2, "checkpoints kept (only this run's are ever deleted)", **AT_LEAST_1)
    resume: bool = option(False, "continue the run in --out from its latest complete checkpoint (or from step 0)")
    overwrite: bool = option(False, "delete the run already in --out and start over")
    max_bad_steps: int = option(5, "stop after this many non-finite steps in a row", **AT_LEAST_1)
    eval_puzzles: int = option(256, "embedded task: held-out puzzles to evaluate")


def parse_options(argv=None):
    """TrainOptions from the command line (`python gift.py --help` lists every option), checked before any work."""
    parser = argparse.ArgumentParser(description="GIFT / SFT fine-tuning of LLaDA or Dream (arXiv 2509.20863)")
    given = parse_dataclass_flags(parser, TrainOptions, argv)
    if "loss" in given:
        given["loss"] = LOSS_ALIASES.get(given["loss"], given["loss"])
    opts = TrainOptions(**given)
    if not opts.model:  # the embedded default: its settings (embedded.EMBEDDED) for the options not given
        embedded.apply_defaults(opts, given)
    check_options(opts, parser.error)
    return opts


def parallel_of(opts):
    """--parallel as it applies: ddp for LoRA, fsdp for full fine-tuning when not given."""
    return opts.parallel or ("ddp" if opts.lora else "fsdp")


def check_options(opts, error):
    """`error(message)` for the first option that fails, before any work: ranges (model.check_fields), rules, paths."""
    try:
        check_fields(opts, lambda name: f"--{name.replace('_', '-')} {getattr(opts, name)}")
    except ValueError as e:
        error(str(e))
    if opts.beta_refresh_epochs != 1 and OBJECTIVES[opts.loss][1] not in ("entropy", "nll"):
        error(f"--beta-refresh-epochs applies to the objectives with a per-step first pass "
              f"({', '.join(n for n, o in OBJECTIVES.items() if o[1] in ('entropy', 'nll'))}), not --loss {opts.loss}")
    if opts.parallel == "ddp" and not opts.lora:
        error("--parallel ddp needs --lora (full fine-tuning is sharded by FSDP2: --parallel fsdp, the default)")
    if opts.cpu_offload and parallel_of(opts) != "fsdp":
        error("--cpu-offload needs FSDP2: add --parallel fsdp (with --lora the default is ddp)")
    if opts.save_merged and not opts.lora:
        error("--save-merged needs --lora (a full fine-tuning checkpoint is already a complete model/)")
    if opts.lr == 0:
        print("warning: --lr 0: the weights will not change", file=sys.stderr)
    if opts.lora and (unknown := [t for t in opts.lora_targets.split(",") if t not in LINEARS]):
        error(f"--lora-targets: {unknown} not among the linears {', '.join(LINEARS)} (LLaDA's or Dream's names)")
    if opts.data and not opts.model:
        error("--data needs --model (without --model the built-in Sudoku task trains and --data is unused)")
    if opts.lora and not opts.model:
        error("--lora needs --model (the built-in Sudoku task trains a tiny model from scratch: all of it)")
    if opts.wandb_project and not (sys.modules.get("wandb") or importlib.util.find_spec("wandb")):
        error("--wandb-project: the wandb package is not installed (pip install wandb), or leave the flag out")
    if opts.resume and opts.overwrite:
        error("--resume continues the run in --out, --overwrite deletes it: choose one")
    if opts.model and not opts.data:
        error("--model needs --data (a JSONL file)")
    if opts.model and (problem := not_a_model_folder(opts.model)):  # a run, a checkpoint, an adapter: say what to give
        error(f"--model {opts.model}: {problem}")
    if opts.data and Path(opts.data).is_dir():
        error(f"--data {opts.data}: a folder; give the JSONL file")
    if not opts.out.strip():
        error("--out '': give the run's folder")
    out = Path(opts.out)
    if (out / "config.json").exists():  # a model folder (the base itself?): sample.py would load it, not the run
        error(f"--out {opts.out}: holds a model (config.json); a run needs a folder of its own")
    if out.exists() and not out.is_dir() or out.resolve() == Path(out.anchor):
        error(f"--out {opts.out}: must be a folder of its own (it is {'the root' if out.is_dir() else 'a file'})")
    if out.is_dir() and not os.access(out, os.W_OK | os.X_OK):
        error(f"--out {opts.out}: this user cannot write there")


# ---------------------------------------------------------------------------------------------------------------------
# The model on its devices: LoRA adapters on a frozen base, replicated by DDP; or full fine-tuning, sharded by FSDP2


FSDP_ONE_GROUP_MAX_PARAMS = 10_000_000  # FSDP2 shards a model up to this size as one group (fsdp_shard)


def wrap_model(model, device, dtype, world, lora=None, activation_checkpointing=False, seed=0, parallel=""):
    """lora=None: full fine-tuning, float32 master weights FSDP2-sharded over `world` > 1 processes, computing in
    `dtype` (a meta-device model gets empty storage for model.load_weight_rows to fill). lora=dict(r=, alpha=, dropout=,
    targets=): float32 adapters (A from `seed`) on a frozen base in `dtype`, replicated by DDP or sharded by FSDP2;
    "fsdp-offload" (--cpu-offload): FSDP2 even in one process, its states on the host."""
    if activation_checkpointing:
        model.set_activation_checkpointing(True)
    cpu_offload = parallel == "fsdp-offload"
    shard = world > 1 or cpu_offload
    if lora is not None:
        # offloaded, the base stays on the host: fully_shard moves it to the GPU and back one group at a time
        model.to(device=device if not cpu_offload else "cpu", dtype=dtype)
        add_lora(model, **lora, generator=torch.Generator().manual_seed(seed))
        if parallel.startswith("fsdp") and shard:
            fsdp_shard(model, device, None, cpu_offload)
        elif world > 1:
            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        return model
    on_meta = next(model.parameters()).is_meta
    if not on_meta:
        model.to(device=device, dtype=torch.float32)
    if shard:
        fsdp_shard(model, device, dtype, cpu_offload)
    if on_meta:
        model.to_empty(device="cpu" if cpu_offload else device)
    return model


def fsdp_shard(model, device, param_dtype, cpu_offload=False, one_group_max=None):
    """FSDP2 in place: one group per block, then the root; a model of at most `one_group_max` (None:
    FSDP_ONE_GROUP_MAX_PARAMS) parameters is one group. param_dtype: the gathered parameters' (None: their own)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    one_group_max = FSDP_ONE_GROUP_MAX_PARAMS if one_group_max is None else one_group_max  # read at each call
    if sum(p.numel() for p in model.parameters()) > one_group_max:
        for block in model.model.transformer.blocks:
            fully_shard(block, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    return model


def gradient_sync(model, enabled):
    """Skip the gradient all-reduce on all but the last micro-step (DDP: no_sync; FSDP2: requires_gradient_sync)."""
    if isinstance(model, DDP):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------------------------------
# GIFT's passes besides the loss: Algorithm 1 on the model; GIFT*'s initial betas; betas reused for K epochs


def first_pass_betas(model, betas_from, input_ids, answer_mask, mask_id, beta_power=BETA_POWER, chunk_size=CE_CHUNK):
    """Algorithm 1 on our model: the no-grad first pass's betas (dropout off), (B, L) float32, as betas_from
    (OBJECTIVES' second column) says; "initial_entropy": the adapters disabled (full fine-tuning: gift_star_betas)."""
    module = unwrap(model)
    if betas_from == "initial_entropy" and not lora_layers(module):
        raise ValueError("gift.py first_pass_betas: gift-star needs the initial model's betas, but this model has no "
                         "LoRA adapters to disable; with full fine-tuning give MicroBatch.precomputed_betas")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), lora_disabled(module) if betas_from == "initial_entropy" else contextlib.nullcontext():
            hidden = predicting_hidden(model, mask_answer(input_ids, answer_mask, mask_id))  # (B, L, D)
            H, nll = answer_entropy_and_nll(hidden, module.head, input_ids, answer_mask, chunk_size)
    finally:
        model.train(was_training)
    return nll if betas_from == "nll" else entropy_betas(H, answer_mask, beta_power)


@torch.no_grad()
def initial_model_betas(model, examples, pad_id, length, batch_size, device, beta_power=BETA_POWER):
    """GIFT*'s betas of the INITIAL model (LoRA: adapters off), examples padded to `length`: (N, length) on the CPU."""
    rows = []
    mask_id = unwrap(model).config.mask_token_id
    betas_from = "initial_entropy" if lora_layers(unwrap(model)) else "entropy"
    for start in range(0, len(examples), batch_size):
        input_ids, answer_mask = collate(examples[start:start + batch_size], pad_id, pad_to=length)
        betas = first_pass_betas(model, betas_from, input_ids.to(device), answer_mask.to(device), mask_id, beta_power)
        rows.append(betas.float().cpu())
    return torch.cat(rows) if rows else torch.zeros(0, length)


def gift_star_betas(model, inputs, path, pad_to, batch_size, beta_power, device, autocast=contextlib.nullcontext()):
    """GIFT*'s betas (len(examples), length) on the CPU: initial_model_betas of every example, padded to `pad_to`
    (0: the longest), split over the ranks, cached in `path` keyed by the data, the base, beta_power and the length."""
    examples, pad_id = inputs.examples, inputs.pad_id
    length = pad_to or max(len(ids) for ids, _ in examples)
    key = dict(inputs.fingerprints, beta_power=beta_power, length=length)
    if path.exists():
        try:
            cache = torch.load(path, weights_only=True)  # no code runs from a file in --out
            if cache.get("key") == key and cache["betas"].shape == (len(examples), length):
                return cache["betas"]
            print0(f"{path}: computed for other data, another base model or other settings; recomputing")
        except Exception as e:  # a damaged file: the betas are recomputed from the initial model, which is still here
            print0(f"{path} is unreadable ({type(e).__name__}: {e}); recomputing it")
    rank, world = rank_and_world()
    mine = list(range(rank, len(examples), world))
    padded = mine + [0] * (math.ceil(len(examples) / world) - len(mine))  # equal batches: FSDP2's forward is collective
    with autocast:
        part = initial_model_betas(model, [examples[i] for i in padded], pad_id, length, batch_size, device, beta_power)
    if is_sharded(model):  # FSDP2 keeps the root's parameters gathered after a forward with no backward
        model.reshard()
    betas = torch.zeros(len(examples), length)
    for r, part_r in enumerate(gather_objects(part[:len(mine)])):
        betas[r::world] = part_r
    if is_rank0():
        saved = io.BytesIO()
        torch.save({"key": key, "betas": betas}, saved)
        atomic_write_text(path, saved.getvalue())
    return betas


class BetaCache:
    """--beta-refresh-epochs K: each example's betas and the epoch that made them, recomputed when K or more epochs
    old (K = 3: in epochs 0, 3, 6, ...; 0: never). Every rank holds it all; checkpoints save it (4 B a padded token)."""

    def __init__(self, n_examples, refresh_epochs):
        self.refresh_epochs = refresh_epochs
        self.epoch = torch.full((n_examples,), -1, dtype=torch.int64)  # -1: never computed
        self.betas = [torch.zeros(0)] * n_examples  # (L_i,) float32, L_i = the padded length of its micro-batch

    def attach(self, micro_batches, epoch):
        """Set each micro-batch's stale and precomputed_betas (stale rows: zeros until train_step's first pass fills
        them). A row cached at another padded length is cut, or extended with its last value (an EOS pad's beta)."""
        for mb in micro_batches:
            made = self.epoch[mb.indices]  # (B,) the epoch of each row's cached betas
            mb.stale = (made < 0) | ((epoch - made >= self.refresh_epochs) & (self.refresh_epochs > 0))
            rows, L = torch.zeros(mb.input_ids.shape), mb.input_ids.shape[1]
            for r, cached in enumerate(self.betas[i] for i in mb.indices):
                if not mb.stale[r]:
                    rows[r, :len(cached)] = cached[:L]
                    rows[r, len(cached):] = cached[-1]
            mb.precomputed_betas = rows.to(mb.input_ids.device)

    def update(self, micro_batches, epoch):
        """Store the betas train_step computed for the stale real rows, from every rank."""
        mine = [(i, mb.precomputed_betas[r].float().cpu()) for mb in micro_batches if mb.real
                for r, i in enumerate(mb.indices) if mb.stale[r]]
        for part in gather_objects(mine):
            for i, row in part:
                self.epoch[i], self.betas[i] = epoch, row

    def state_dict(self):
        return dict(refresh_epochs=self.refresh_epochs, epoch=self.epoch, betas=self.betas)

    def load_state_dict(self, state):
        self.epoch, self.betas = state["epoch"], list(state["betas"])


def refresh_stale_betas(model, mb, betas_from, beta_power, autocast, world, device):
    """BetaCache: the first pass's betas of mb's stale rows, into mb.precomputed_betas. A rank with none runs its
    first row and discards it while any rank has one (FSDP2's forward is collective)."""
    stale = mb.stale.to(device)
    n_stale = int(stale.sum())
    if (all_reduce([n_stale], device)[0] if world > 1 else n_stale) == 0:  # no rank has a stale row
        return
    rows = stale if n_stale else torch.arange(len(stale), device=device) == 0
    with autocast:
        fresh = first_pass_betas(model, betas_from, mb.input_ids[rows], mb.answer_mask[rows],
                                 unwrap(model).config.mask_token_id, beta_power)
    if n_stale:
        mb.precomputed_betas[stale] = fresh.to(mb.precomputed_betas.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# One optimizer step


@dataclass
class MicroBatch:
    """One rank's micro-batch of one step (data.step_micro_batches' fields; train_step fills the last ones)."""
    input_ids: torch.Tensor  # (B, L) clean sequences, right-padded
    answer_mask: torch.Tensor  # (B, L) bool: answer positions (padding included), where the loss lives
    generators: object  # one torch.Generator per row (its t and its mask), or one for the whole micro-batch
    precomputed_betas: torch.Tensor = None  # (B, L) betas made before the step: GIFT*'s, or BetaCache's
    real: bool = True  # False: a zero-weight dummy row that keeps the DDP / FSDP2 collectives in lockstep
    indices: list = None  # the rows' example indices
    stale: torch.Tensor = None  # (B,) bool, BetaCache: rows whose betas the first pass must recompute
    noisy_ids: torch.Tensor = None  # (B, L) input_ids with the masked positions set to the mask token
    weight: torch.Tensor = None  # (B, L) w_i
    beta: torch.Tensor = None  # (B, L) the betas used (None for sft and cart)


def train_step(model, optimizer, micro_batches, loss_name, norm="", eps=EPS, beta_power=BETA_POWER, grad_clip=1.0,
               autocast=contextlib.nullcontext()):
    """One optimizer step of Algorithm 2 on a global batch, each rank passing its MicroBatches (norm "": DEFAULT_NORM).
    Returns loss (the whole batch's), grad_norm (before clipping), stepped (False if either is not finite), COUNTS."""
    world, module = rank_and_world()[1], unwrap(model)
    mask_id, device = module.config.mask_token_id, micro_batches[0].input_ids.device
    params = [p for p in model.parameters() if p.requires_grad]
    betas_from, norm = OBJECTIVES[loss_name][1], norm or DEFAULT_NORM[loss_name]

    # pass 1, every micro-batch: the betas (GIFT: the no-grad entropy pass, Algorithm 1), t, the mask, the weights
    for mb in micro_batches:
        if mb.stale is not None:  # BetaCache: the first pass over the stale rows only
            refresh_stale_betas(model, mb, betas_from, beta_power, autocast, world, device)
        with autocast:
            mb.beta = mb.precomputed_betas
            if mb.beta is None and betas_from is not None:
                mb.beta = first_pass_betas(model, betas_from, mb.input_ids, mb.answer_mask, mask_id, beta_power)
            mb.noisy_ids, weight = objective_batch(loss_name, mb.input_ids, mb.answer_mask, mb.generators, mask_id,
                                                   mb.beta, eps)
        mb.weight = weight if mb.real else torch.zeros_like(weight)

    # the global counts, over micro-batches and ranks: the loss normaliser and the step's statistics
    counts = dict(zip(COUNTS, all_reduce(step_counts(micro_batches, mask_id), device)))

    # pass 2: the loss over the GLOBAL denominator, backpropagated times world_size (diffusion_loss says why)
    loss_sum = 0.0
    denominator = max(counts["n_masked"], 1.0) if norm == "masked" else counts["n_rows"]
    for j, mb in enumerate(micro_batches):
        with gradient_sync(model, enabled=j == len(micro_batches) - 1), autocast:
            hidden = predicting_hidden(model, mb.noisy_ids)  # (B, L, D)
            loss = diffusion_loss(hidden, module.head, mb.input_ids, mb.noisy_ids, mb.weight, mb.answer_mask, mask_id,
                                  norm, denominator)
            (loss * world).backward()
        loss_sum += float(loss.detach())
    loss = all_reduce([loss_sum], device)[0]

    # clip the gradient, then step the optimizer unless the loss or the gradient is not finite
    grad_norm, stepped = clipped_step(params, optimizer, loss, grad_clip)
    return dict(loss=loss, grad_norm=grad_norm, stepped=stepped, **counts)


# the per-step sums train_step all-reduces: the loss normalisers and the logged statistics
COUNTS = ("n_rows", "n_masked", "n_answer", "n_tokens", "beta_n", "beta_sum", "beta_sq_sum")


@torch.no_grad()
def step_counts(micro_batches, mask_id):
    """This rank's COUNTS over its real micro-batches; the betas' sums in float64, so that they add up exactly."""
    local = dict.fromkeys(COUNTS, 0.0)
    for mb in (mb for mb in micro_batches if mb.real):
        n_answer = float(mb.answer_mask.sum())
        local["n_rows"] += len(mb.input_ids)
        local["n_masked"] += float(((mb.noisy_ids == mask_id) & mb.answer_mask).sum())
        local["n_answer"] += n_answer
        local["n_tokens"] += mb.input_ids.numel()
        if mb.beta is not None:
            b = mb.beta.to(mb.input_ids.device)[mb.answer_mask].double()
            local["beta_n"] += n_answer
            local["beta_sum"] += float(b.sum())
            local["beta_sq_sum"] += float((b * b).sum())
    return [local[k] for k in COUNTS]


# ---------------------------------------------------------------------------------------------------------------------
# The loop


def train(opts, preemption):
    """The whole run on every rank, in main's folder: set-up, resume, the steps. Returns (model, inputs, checkpoint)."""
    rank, world, device = setup_distributed(group_of_one=opts.cpu_offload)  # FSDP2 needs a group, even of one
    dtype = compute_dtype(opts.dtype, device)  # auto: bf16 on a GPU, float32 on the CPU
    # bf16: autocast on the CPU as on a GPU (one code path); norms, softmax and losses stay float32
    autocast = torch.autocast(device.type, dtype=dtype) if dtype == torch.bfloat16 else contextlib.nullcontext()

    # the model, the tokenizer and the data (every rank builds the same); a checkpoint of others is refused here
    inputs = load_inputs(opts, rank, dtype)
    checkpoints = CheckpointManager(opts, world, inputs, preemption, aliases=dict(loss=LOSS_ALIASES))
    lora = (dict(r=opts.lora_r, alpha=opts.lora_alpha, dropout=opts.lora_dropout,
                 targets=tuple(opts.lora_targets.split(","))) if opts.lora else None)
    model = wrap_model(inputs.model, device, dtype, world, lora, opts.activation_checkpointing, opts.seed,
                       parallel_of(opts) + ("-offload" if opts.cpu_offload else ""))
    if opts.model and not opts.lora:
        load_weight_rows(model, opts.model, rank, world)  # full fine-tuning: each rank reads only its rows

    # the optimizer and the learning-rate schedule
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opts.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=opts.weight_decay)
    global_batch = opts.batch_size * opts.grad_accum * world
    total_steps = min(opts.epochs * math.ceil(len(inputs.examples) / global_batch), opts.max_steps or math.inf)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(opts.schedule, opts.warmup_steps, total_steps))
    print0(banner(opts, inputs, model, world, device, dtype, total_steps, global_batch))
    check_run_size(opts, len(inputs.examples), total_steps)

    # betas made before a step: GIFT*'s, of the INITIAL model, before any checkpoint loads; or --beta-refresh-epochs'
    pad_to = opts.max_len if opts.pad_to_max_len else 0
    precomputed_betas = (gift_star_betas(model, inputs, Path(opts.out) / "ref_betas.pt", pad_to, opts.batch_size,
                                         opts.beta_power, device, autocast) if opts.loss == "gift-star" else None)
    beta_cache = BetaCache(len(inputs.examples), opts.beta_refresh_epochs) if opts.beta_refresh_epochs != 1 else None
    split = Split(rank, world, opts.batch_size, opts.grad_accum)

    # resume: the model, the optimizer, the schedule, the RNG states and the beta cache, or a fresh start
    torch.manual_seed(opts.seed * 1000 + rank)  # LoRA dropout draws from each rank's global generator
    state, unlogged = checkpoints.restore(model, optimizer, scheduler, beta_cache, total_steps)
    metrics = MetricsLog(Path(opts.out), opts.log_every, state, total_steps, unlogged, opts.wandb_project,
                         dataclasses.asdict(opts))
    model.train()
    while state.step < total_steps:
        # -------------------------------------------------------------------------------------------------------------
        # one training step
        order = epoch_batches(len(inputs.examples), state.epoch, opts.seed, global_batch)
        fields = step_micro_batches(inputs.examples, order[state.step_in_epoch], state.epoch, split, inputs.pad_id,
                                    device, opts.seed, pad_to)
        micro_batches = [MicroBatch(**f) for f in fields]
        for mb in micro_batches if precomputed_betas is not None else ():  # GIFT*'s, of the initial model
            mb.precomputed_betas = precomputed_betas[mb.indices, :mb.input_ids.shape[1]].to(device)
        if beta_cache:
            beta_cache.attach(micro_batches, state.epoch)
        result = train_step(model, optimizer, micro_batches, opts.loss, opts.norm, opts.eps, opts.beta_power,
                            opts.grad_clip, autocast)
        scheduler.step()
        if beta_cache:
            beta_cache.update(micro_batches, state.epoch)
        # -------------------------------------------------------------------------------------------------------------
        # bookkeeping: where we are, the log, a checkpoint when due (after a preemption signal: one, then exit)
        epoch = state.epoch
        epoch_done = state.advance(result, len(order), opts.max_bad_steps, Path(opts.out))
        metrics.add(result, state, epoch, scheduler.get_last_lr()[0])
        checkpoints.step_done(state, metrics.unlogged, epoch_done)
    return model, inputs, checkpoints.final(state)


@dataclass
class RunInputs:
    """What the loop trains on: the model (not yet wrapped), its tokenizer and the data, and what checkpoints record."""
    model: LLaDA
    tokenizer: object
    examples: list  # [(token ids, prompt length)]
    pad_id: int
    fingerprints: dict  # of the data and the base model: --resume refuses others
    export: "Export"  # what each checkpoint exports besides its training state
    heldout: list = None  # the embedded task's held-out (puzzle, solution) pairs
    resolved: dict = None  # what "auto" options resolved to (dtype, data_format): --resume compares these


def load_inputs(opts, rank, dtype):
    """The base model (LoRA: loaded in `dtype`; full fine-tuning: on the meta device, filled after sharding), its
    tokenizer and the tokenised data, or the embedded task. Prints the data's summary."""
    if not opts.model:  # a tiny LLaDA from the seed, its Sudoku puzzles and files (embedded.py)
        return RunInputs(**embedded.embedded_inputs(opts, rank, dtype, save_dtype(opts.save_dtype, torch.float32)))
    config = read_config(opts.model)  # checked against the safetensors headers, before anything is built
    if opts.max_len > (n := config.max_sequence_length):  # longer than the base was trained on
        print0(f"warning: --max-len {opts.max_len} exceeds the model's max_sequence_length {n} "
               f"({Path(opts.model) / 'config.json'}); using --max-len {n}")
        opts.max_len = n
    # the data, before the model: a bad row fails in seconds
    tokenizer = load_tokenizer(opts.model)
    pad_id = special_ids(tokenizer, config, opts.model).pad  # the chat tokens checked, as sample.py and eval.py
    examples, stats = load_dataset(opts.data, tokenizer, fmt=opts.data_format, max_len=opts.max_len,
                                   skip_bad_rows=opts.skip_bad_rows)
    print0(describe_data(stats))
    # the model, and what checkpoints record of it
    if opts.lora:
        model = load_weights(opts.model, dtype=dtype)  # the base, as sample.py and eval.py load a model
    else:
        with torch.device("meta"):
            model = LLaDA(config)
    fingerprints = dict(data=data_fingerprint(examples), examples=len(examples), model=folder_fingerprint(opts.model))
    exported = EXPORTED + embedded.EXPORTED  # a model folder of the embedded task's carries its held-out puzzles
    files = [f for f in sorted(Path(opts.model).iterdir()) if f.is_file() and any(f.match(p) for p in exported)]
    stored = stored_dtype(opts.model)  # a LoRA base loaded in a narrower dtype: merged/ from the folder's own weights
    exact = dtype == stored or torch.finfo(dtype).bits > torch.finfo(stored).bits
    export = Export(save_dtype(opts.save_dtype, stored), files, base_name=opts.model, merged=opts.save_merged,
                    base_fingerprint=fingerprints["model"], merge_from="" if exact else opts.model)
    return RunInputs(model, tokenizer, examples, pad_id, fingerprints, export,
                     resolved=dict(dtype=str(dtype).removeprefix("torch."), data_format=stats["format"]))


def save_dtype(name, base_dtype):
    """--save-dtype's dtype: auto is the base's own (bf16 in, bf16 out)."""
    return base_dtype if name == "auto" else getattr(torch, name)


def check_run_size(opts, n_examples, total_steps):
    """Sizes only the data make absurd: a batch larger than the data (refused), a warm-up longer than the run (said)."""
    if opts.batch_size * opts.grad_accum > n_examples:  # every step would be mostly empty micro-steps
        raise ValueError(f"--batch-size {opts.batch_size} x --grad-accum {opts.grad_accum} exceeds the {n_examples} "
                         "examples: lower them")
    if opts.warmup_steps > total_steps:
        print0(f"warning: --warmup-steps {opts.warmup_steps} is longer than the run ({total_steps} steps): the peak "
               "learning rate is never reached")


def lr_lambda(schedule, warmup_steps, total_steps):
    """The learning-rate factor of optimizer step `step`: linear warm-up, then linear / cosine decay or constant."""
    def f(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return {"linear": 1.0 - progress, "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}.get(schedule, 1.0)
    return f


# ---------------------------------------------------------------------------------------------------------------------
# main: the run in its claimed folder; the embedded task's evaluation; tear-down


def main(argv=None):
    opts = parse_options(argv)
    t0 = time.time()
    replaced = None if opts.model else embedded.REPLACED  # the files in --out the run may replace (None: longjob's)
    with run_folder(Path(opts.out), opts.resume, opts.overwrite, replaced) as preemption:
        model, inputs, checkpoint = train(opts, preemption)
        preemption.looping = False  # a signal in the final evaluation exits at once, status.json saying so
        if inputs.heldout is not None:  # the embedded default: its held-out puzzles with the block sampler, results
            embedded.evaluate_run(opts, inputs.heldout, checkpoint, compute_device(model), time.time() - t0, t0)
    end_distributed()  # every rank done with every collective before the process group goes


if __name__ == "__main__":
    # a user's mistake (a flag, file, folder, data row, checkpoint): one line from rank 0, exit status 1
    run_command_line(main, "gift.py", rank0_only=True, errors=(ValueError, OSError, RunError))
