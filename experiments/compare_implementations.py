"""Issue 32 item 2, "Other implementations": on ONE batch, how much each choice in which LIFT, d1 and dllm differ
from this code changes the loss (experiments/other_implementations.md has the table and the sources).

    python experiments/compare_implementations.py        # seeded, a few seconds on the CPU

The batch: a tiny random LLaDA (model.py; LoRA adapters with random B, so that LoRA dropout acts), 4 rows with
different prompt and answer lengths, right-padded with EOS per micro-batch, split into 2 micro-batches of 2 rows
(one rank, 2 accumulation steps: the same as 2 ranks x 1 step for every formula here). Every variant sees the same
t (one per row), the same uniforms (token i masked where u_i < t_i) and the same model. Each variant is this code's
objective with ONE choice changed, written from the other implementation's formula (no code of theirs is copied).
"""

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gift import (EPS, answer_entropy_and_nll, beta_ratios, diffusion_loss, entropy_betas, gift_objective,  # noqa: E402
                  mask_answer, mask_tokens, predicting_hidden, sft_objective)
from model import LLaDA, LLaDAConfig, add_lora  # noqa: E402

VOCAB, MASK_ID, PAD_ID = 48, 47, 46  # EOS = pad, as tests/conftest.py's tiny_config
# (prompt length, answer length) per row; micro-batch 0 = rows 0-1, micro-batch 1 = rows 2-3
ROWS = [(4, 6), (3, 12), (5, 3), (2, 9)]
MICRO = [[0, 1], [2, 3]]

# One dict per choice; OURS is this code (gift.py), each other value another implementation's
OURS = dict(pad="answer", beta_ref="row", norm="global", t_div="ours", entropy="eval-fp32", weight="1/p",
            sft_norm="row")
LIFT = dict(pad="excluded", beta_ref="micro-batch", norm="per-micro-batch", t_div="lift", entropy="train-bf16")
D1 = dict(sft_norm="micro-batch-tokens")
DLLM = dict(weight="1/(p+1e-6)", sft_norm="micro-batch-tokens")


def tiny_lora_model(seed=0):
    """A tiny LLaDA (std 0.2, so that entropies differ from token to token) with LoRA r=8, dropout 0.05 on q, k, v,
    its B drawn at random (as after some training; at B = 0 dropout would change nothing)."""
    config = LLaDAConfig(d_model=32, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=64, vocab_size=VOCAB,
                         embedding_size=VOCAB, mask_token_id=MASK_ID, eos_token_id=PAD_ID, pad_token_id=PAD_ID)
    g = torch.Generator().manual_seed(seed)
    model = LLaDA(config).init_weights(g, std=0.2)
    add_lora(model, r=8, alpha=16, dropout=0.05, generator=g)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def make_batch(seed=0):
    """Micro-batches [(input_ids (b, L), answer_mask (b, L))], each right-padded with EOS to its longest row; the
    answers hold no EOS of their own (LLaDA's <|eot_id|> differs from its pad <|endoftext|>)."""
    g = torch.Generator().manual_seed(seed)
    mbs = []
    for rows in MICRO:
        L = max(sum(ROWS[r]) for r in rows)
        ids = torch.full((len(rows), L), PAD_ID)
        for j, r in enumerate(rows):
            n = sum(ROWS[r])
            ids[j, :n] = torch.randint(0, PAD_ID, (n,), generator=g)
        prompt = torch.tensor([ROWS[r][0] for r in rows])
        mbs.append((ids, torch.arange(L)[None] >= prompt[:, None]))
    return mbs


def make_draws(mbs, seed=1):
    """Per micro-batch: t (b,), the uniforms u (b, L) of the mask, and u2 (b, L): a data collator's own uniforms
    (LIFT falls back to the collator's mask, drawn at p, when its own mask is empty)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(len(ids), generator=g), torch.rand(ids.shape, generator=g), torch.rand(ids.shape, generator=g))
            for ids, _ in mbs]


def entropies(model, ids, masked_in, mode, dropout_seed=0):
    """Algorithm 1's entropy at EVERY position (B, L) float32, the positions `masked_in` replaced by [MASK].
    mode "eval-fp32": ours (eval mode, float32). "train-bf16": LIFT's (train mode, so LoRA dropout is on, a bf16
    model, log-softmax and entropy in bf16, clamped at 0)."""
    noisy = mask_answer(ids, masked_in, MASK_ID)
    everywhere = torch.ones_like(masked_in)
    if mode == "eval-fp32":
        with torch.no_grad():
            H, _ = answer_entropy_and_nll(predicting_hidden(model, noisy), model.head, ids, everywhere)
        return H
    m = copy.deepcopy(model).to(torch.bfloat16).train()
    torch.manual_seed(dropout_seed)
    with torch.no_grad():
        logp = m(noisy).log_softmax(-1)  # bf16 logits, bf16 log-softmax
        return (logp.exp() * logp).sum(-1).neg().clamp_min(0).float()


def gift_variant(model, mbs, draws, eps=EPS, beta_power=0.5, entropy_hook=None, **choices):
    """This code's `gift` loss of the whole batch (all micro-batches), with the choices in `choices` changed:
      pad       "answer": EOS padding is answer (masked, trained, [MASK] in the entropy pass; ours, LLaDA's SFT);
                "excluded": never masked or trained, left visible in the entropy pass, not in beta_ref (LIFT)
      beta_ref  "row": the mean of beta over the row's answer (ours); "micro-batch": over the micro-batch's (LIFT)
      norm      "global": the batch's weighted sum / the batch's masked count (ours, train_step);
                "per-micro-batch": each micro-batch's sum / its masked count, then the mean over micro-batches (LIFT;
                accumulation steps and ranks alike)
      t_div     "ours": t_i clamped to [eps, 1], 1 / t_i at masked answer tokens only, 0 when nothing is masked;
                "lift": t_i = 1 - (1 - p)^(beta / beta_ref) unclamped at every position (prompt and pad included,
                their betas from the visible tokens' entropies), the CE (0 where unmasked) divided by t_i at every
                position (0 / 0 = NaN), and a micro-batch with nothing masked trains the collator's mask instead
                (u2 < p on every non-prompt token, pad included)
      entropy   "eval-fp32" (ours) or "train-bf16" (LIFT), see entropies()
    entropy_hook: H -> H, applied to the entropies (to construct edge cases). Returns a 0-dim float32 tensor."""
    c = {**OURS, **choices}
    sums, counts = [], []
    for (ids, answer), (t, u, u2) in zip(mbs, draws):
        train = answer & (ids != PAD_ID) if c["pad"] == "excluded" else answer  # tokens that may be masked
        H = entropies(model, ids, train, c["entropy"])
        if entropy_hook is not None:
            H = entropy_hook(H)
        beta_all = H.clamp_min(0) ** beta_power  # (b, L) every position
        beta = entropy_betas(H, train, beta_power)  # 0 off the trainable tokens
        p = (1 - eps) * t + eps  # (b,)
        if c["t_div"] == "ours":
            if c["beta_ref"] == "row":
                t_i, w = gift_objective(t, u, beta, train, eps)
            else:
                ref = beta[train].mean().clamp_min(1e-12)
                r = torch.where(train, beta / ref, 0.0)
                t_i = torch.where(train, (-torch.expm1(r * torch.log1p(-p)[:, None])).clamp(eps, 1), 0.0)
                w = torch.where(train, 1 / t_i, 0.0)
            masked = (u < t_i) & train
        else:
            ref = (beta[train].mean().clamp_min(1e-12) if c["beta_ref"] == "micro-batch"
                   else (beta * train).sum(1, keepdim=True) / train.sum(1, keepdim=True).clamp_min(1))
            t_i = 1 - (1 - p[:, None]) ** (beta_all / ref)  # every position, unclamped
            masked = (u < t_i) & train
            if not masked.any():
                masked = (u2 < p[:, None]) & answer  # the collator's mask: pad included
        noisy = torch.where(masked, MASK_ID, ids)
        with torch.no_grad():
            logits = model(noisy).float()
        ce = F.cross_entropy(logits.transpose(1, 2), ids, reduction="none")  # (b, L)
        ce = torch.where(masked, ce, 0.0)  # what ignore_index=-100 gives at unmasked positions
        tok = ce / t_i if c["t_div"] == "lift" else ce * torch.where(masked, w, 0.0)
        sums.append(tok.sum())
        counts.append(masked.sum())
    if c["norm"] == "global":
        return sum(sums) / max(int(sum(counts)), 1)
    return torch.stack([s / max(int(n), 1) for s, n in zip(sums, counts)]).mean()


def ours_gift(model, mbs, draws, eps=EPS):
    """The reference: Part I of gift.py as train_step uses it (gift_objective, mask_tokens, diffusion_loss with the
    GLOBAL masked count as denominator), the entropy pass in eval mode, float32."""
    parts = []
    for (ids, answer), (t, u, _) in zip(mbs, draws):
        with torch.no_grad():
            H, _ = answer_entropy_and_nll(predicting_hidden(model, mask_answer(ids, answer, MASK_ID)), model.head,
                                          ids, answer)
        t_i, w = gift_objective(t, u, entropy_betas(H, answer), answer, eps)
        parts.append((ids, answer, mask_tokens(ids, t_i, u, MASK_ID), w))
    n = max(sum(int(((noisy == MASK_ID) & a).sum()) for _, a, noisy, _ in parts), 1)
    with torch.no_grad():
        return sum(diffusion_loss(predicting_hidden(model, noisy), model.head, ids, noisy, w, a, MASK_ID, "masked", n)
                   for ids, a, noisy, w in parts)


def ours_sft(model, mbs, draws, eps=EPS):
    """The reference `sft`: Part I (sft_objective, diffusion_loss norm "answer", denominator = the batch's rows)."""
    B = sum(len(ids) for ids, _ in mbs)
    total = 0.0
    with torch.no_grad():
        for (ids, answer), (t, u, _) in zip(mbs, draws):
            p, w = sft_objective(t, u, None, answer, eps)
            noisy = mask_tokens(ids, p, u, MASK_ID)
            total = total + diffusion_loss(predicting_hidden(model, noisy), model.head, ids, noisy, w, answer, MASK_ID,
                                           "answer", B)
    return total


def sft_variant(model, mbs, draws, eps=EPS, **choices):
    """This code's `sft` loss with choices changed:
      weight    "1/p" (ours, LLaDA, d1) or "1/(p+1e-6)" (dllm's LinearAlphaScheduler.weight)
      sft_norm  "row": each row's sum / its answer length (EOS padding included), then / the batch's rows (ours,
                LLaDA's guidelines); "micro-batch-tokens": each micro-batch's sum / its non-prompt tokens (d1's
                B*L - num_prompt_tokens, dllm's loss_norm_type "token"), then the mean over micro-batches"""
    c = {**OURS, **choices}
    B = sum(len(ids) for ids, _ in mbs)
    per_mb, total = [], 0.0
    for (ids, answer), (t, u, _) in zip(mbs, draws):
        p = ((1 - eps) * t + eps)[:, None]
        masked = (u < p) & answer
        with torch.no_grad():
            ce = F.cross_entropy(model(torch.where(masked, MASK_ID, ids)).float().transpose(1, 2), ids,
                                 reduction="none")
        w = 1 / p if c["weight"] == "1/p" else 1 / (p + 1e-6)
        tok = torch.where(masked, ce * w, 0.0)
        if c["sft_norm"] == "row":
            total = total + (tok.sum(1) / answer.sum(1).clamp_min(1)).sum() / B
        else:
            per_mb.append(tok.sum() / answer.sum().clamp_min(1))
    return total if c["sft_norm"] == "row" else torch.stack(per_mb).mean()


def rel(a, b):
    return float((a - b) / b.abs())


def measure(seed=0):
    """{name: (value, relative difference to ours)} for every single choice and every all-aligned variant."""
    model, mbs = tiny_lora_model(seed), make_batch(seed)
    draws = make_draws(mbs, seed + 1)
    g0, s0 = ours_gift(model, mbs, draws), ours_sft(model, mbs, draws)
    out = {"gift (ours)": (float(g0), 0.0), "sft (ours)": (float(s0), 0.0)}
    for k, v in LIFT.items():
        val = gift_variant(model, mbs, draws, **{k: v})
        out[f"gift, LIFT's {k}={v}"] = (float(val), rel(val, g0))
    val = gift_variant(model, mbs, draws, **LIFT)
    out["gift, all LIFT's choices"] = (float(val), rel(val, g0))
    for name, choice in (("d1", D1), ("dllm", DLLM)):
        for k, v in choice.items():
            val = sft_variant(model, mbs, draws, **{k: v})
            out[f"sft, {name}'s {k}={v}"] = (float(val), rel(val, s0))
        val = sft_variant(model, mbs, draws, **choice)
        out[f"sft, all {name}'s choices"] = (float(val), rel(val, s0))
    # (d)'s edge case: one prompt position whose entropy underflows to 0 (bf16 makes this likely on a confident
    # model): LIFT's t_i there is 1 - (1 - p)^0 = 0 and its CE is 0, so 0 / 0 = NaN; ours never reads it
    def zero_first(H):
        H = H.clone()
        H[0, 0] = 0.0
        return H
    val = gift_variant(model, mbs, draws, t_div="lift", entropy_hook=zero_first)
    out["gift, LIFT's t_div, one prompt entropy = 0"] = (float(val), rel(val, g0))
    val = gift_variant(model, mbs, draws, entropy_hook=zero_first)
    out["gift, ours, one prompt entropy = 0"] = (float(val), rel(val, g0))
    return out


def main():
    for name, (value, r) in measure().items():
        print(f"{name:48s} loss {value:9.5f}   relative to ours {r:+.2e}")


if __name__ == "__main__":
    main()
