"""gift.py losses: Theorem 1 from the rate matrix, unbiasedness, the exact-denoiser ELBO (gift-elbo is the ELBO,
gift is not), reductions, the official SFT loss, the entropy pass, and gradient/DDP behaviour on a tiny LLaDA."""

import copy
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import shared_path, tiny_model
from safetensors.torch import load_file

from gift import (LOSSES, cart_weights, chunked_cross_entropy, first_pass_betas, gift_elbo_jacobian, gift_mask_probs,
                  importance_weights, mask_tokens, sft_mask_probs, uniforms)
from on_model import model_betas, model_entropy_and_nll, model_loss, model_objective
from model import LLaDA, add_lora, lora_layers

pytestmark = pytest.mark.numerics  # float32 against goldens and other code paths (conftest.py)


f64 = torch.float64


def gen(seed):
    return torch.Generator().manual_seed(seed)


def tiny_batch(seed=0, B=4, L=16):
    g = gen(seed)
    ids = torch.randint(0, 46, (B, L), generator=g)
    prompt_len = torch.randint(2, L // 2, (B,), generator=g)
    answer_mask = torch.arange(L)[None] >= prompt_len[:, None]
    return ids, answer_mask


def gauss_legendre_t(n=400, q=12):
    """Nodes and weights for integral_0^1 f(t) dt after t = 1 - (1 - v)^q, which flattens the (1 - t)^(r - 1)
    endpoint singularity of the gift-elbo weight into the smooth (1 - v)^(q r - 1)."""
    x, w = np.polynomial.legendre.leggauss(n)
    v, wv = torch.tensor((x + 1) / 2, dtype=f64), torch.tensor(w / 2, dtype=f64)
    t = -torch.expm1(q * torch.log1p(-v))
    dt = wv * q * (1 - v) ** (q - 1)
    keep = t < 1  # nodes where 1 - t underflows carry weight ~(1 - v)^(q r) < 1e-20: drop, not inf * 0
    return t[keep], dt[keep]


# -----------------------------------------------------------------------------
# 1. Theorem 1 from first principles


def test_theorem1_absorption_probability_equals_gift_mask_probs():
    g = gen(1)
    B, L, eps = 3, 7, 1e-3
    answer_mask = torch.arange(L)[None] >= torch.tensor([2, 0, 4])[:, None]
    beta = (0.1 + 2 * torch.rand(B, L, generator=g, dtype=f64)) * answer_mask
    t = torch.tensor([0.1, 0.5, 0.9], dtype=f64)
    t_i = gift_mask_probs(t, beta, answer_mask, eps)
    assert (t_i[~answer_mask] == 0).all()
    for b in range(B):
        beta_b = beta[b, answer_mask[b]]  # (n,)
        n = len(beta_b)
        # eq. (9): token k jumps to the absorbing mask state (index n) at rate beta_k
        Q = torch.zeros(n + 1, n + 1, dtype=f64)
        Q[range(n), range(n)] = -beta_b
        Q[range(n), n] = beta_b
        p = (1 - eps) * t[b] + eps
        fbar = -torch.log1p(-p) / beta_b.mean()  # the schedule with 1 - exp(-beta_ref fbar(t)) = t
        P = torch.linalg.matrix_exp(Q * fbar)
        assert (t_i[b, answer_mask[b]] > eps).all()  # away from the clamp
        torch.testing.assert_close(P[:n, n], t_i[b, answer_mask[b]], rtol=1e-10, atol=1e-12)

        # the jump process itself: exponential clocks, a token is masked once its clock rings before fbar
        N = 100_000
        tau = -torch.log(torch.rand(N, n, generator=g, dtype=f64)) / beta_b
        freq = (tau < fbar).double().mean(0)
        sd = (t_i[b, answer_mask[b]] * (1 - t_i[b, answer_mask[b]]) / N).sqrt()
        assert ((freq - t_i[b, answer_mask[b]]).abs() < 5 * sd + 1e-12).all()


def test_gift_mask_probs_clamp_and_zero_beta_fallback():
    t = torch.tensor([0.3, 0.3], dtype=f64)
    answer_mask = torch.tensor([[False, True, True, True], [False, True, True, True]])
    beta = torch.tensor([[5.0, 0.0, 1.0, 2.0], [0.0, 0.0, 0.0, 0.0]], dtype=f64)
    t_i = gift_mask_probs(t, beta, answer_mask, eps=1e-3)
    assert t_i[0, 1] == 1e-3  # beta = 0: clamped to eps, so 1/t_i <= 1000
    assert t_i[0, 0] == 0 and t_i[1, 0] == 0  # prompt, whatever its beta
    torch.testing.assert_close(t_i[1], sft_mask_probs(t, answer_mask)[1])  # beta_ref = 0 -> SFT
    assert torch.isfinite(importance_weights(t_i, answer_mask)).all()


# -----------------------------------------------------------------------------
# 2. The importance weights are unbiased


def test_importance_weights_unbiased_exact_and_monte_carlo():
    g = gen(2)
    L = 6
    answer_mask = torch.arange(L)[None] >= 1
    c = torch.rand(1, L, generator=g, dtype=f64) * answer_mask  # context-independent per-token losses
    beta = 0.5 + torch.rand(1, L, generator=g, dtype=f64)
    target = c.sum()
    t, dt = gauss_legendre_t()
    am = answer_mask.expand(len(t), L)
    # exact: E_mask[m_i] = p_i, integrated over t by quadrature
    for eps in (0.0, 1e-3):
        for p in (sft_mask_probs(t, am, eps), gift_mask_probs(t, beta.expand(len(t), L), am, eps)):
            torch.testing.assert_close((dt[:, None] * p * importance_weights(p, am) * c).sum(), target)
    p = gift_mask_probs(t, beta.expand(len(t), L), am, 0.0)  # gift-elbo: unbiased after integrating over t
    w = importance_weights(p, am) * gift_elbo_jacobian(t, beta.expand(len(t), L), am, 0.0)
    torch.testing.assert_close((dt[:, None] * p * w * c).sum(), target)

    # Monte Carlo through the real noising function
    N = 40_000
    ids, mask_id = torch.zeros(N, L, dtype=torch.long), 9
    am = answer_mask.expand(N, L)
    for use_gift in (False, True):
        t = uniforms((N,), g, "cpu").double()
        p = gift_mask_probs(t, beta.expand(N, L), am) if use_gift else sft_mask_probs(t, am)
        m = mask_tokens(ids, p, uniforms(ids.shape, g, "cpu"), mask_id) == mask_id
        assert not m[:, 0].any()  # the prompt is never masked
        est = (m * importance_weights(p, am) * c).sum(1)
        assert (est.mean() - target).abs() < 5 * est.std() / N ** 0.5


# -----------------------------------------------------------------------------
# 3. Exact denoiser: sft and gift-elbo are -log p(x0), gift is not


class ExactDenoiser(nn.Module):
    """The Bayes-optimal denoiser of an enumerable joint p(x) over n positions, vocabulary V0 plus the mask id
    V0: its "hidden states" are log p(x^i = v | unmasked tokens), and the identity head turns them into logits."""

    def __init__(self, logp):
        super().__init__()
        self.joint, self.V0 = logp.exp(), logp.shape[0]
        self.config = SimpleNamespace(mask_token_id=self.V0)
        self.head = nn.Linear(self.V0 + 1, self.V0 + 1, bias=False, dtype=f64)
        with torch.no_grad():
            self.head.weight.copy_(torch.eye(self.V0 + 1, dtype=f64))

    def forward(self, ids, attention_mask=None, return_hidden=False):
        B, n = ids.shape
        out = torch.full((B, n, self.V0 + 1), -80.0, dtype=f64)  # exp(-80): a mask class of probability ~0
        for b in range(B):
            hidden = [j for j in range(n) if ids[b, j] == self.V0]
            sub = self.joint[tuple(slice(None) if j in hidden else int(ids[b, j]) for j in range(n))]
            for j in range(n):
                if j in hidden:
                    k = hidden.index(j)
                    marg = sub.sum(dim=[d for d in range(sub.dim()) if d != k]) if sub.dim() > 1 else sub
                    out[b, j, :self.V0] = (marg / marg.sum()).log().clamp_min(-80)
                else:
                    out[b, j, ids[b, j]] = 0.0
        return out if return_hidden else self.head(out)


def expected_loss(model, x0, answer_mask, p_i, w_i, dt):
    """E_t E_mask[sum_i m_i w_i CE_i], exactly: all masks of the answer enumerated, t by quadrature.
    p_i, w_i (N, L) at the N quadrature nodes; returns diffusion_loss's sum with the weights integrated in."""
    L = x0.shape[1]
    ans = answer_mask[0].nonzero()[:, 0].tolist()
    rows = []
    for bits in itertools.product([0, 1], repeat=len(ans)):
        m = torch.zeros(L, dtype=torch.bool)
        m[[a for a, bit in zip(ans, bits) if bit]] = True
        rows.append(m)
    m = torch.stack(rows)  # (R, L) every mask of the answer
    prob = torch.where(m[None], p_i[:, None], 1 - p_i[:, None])[..., answer_mask[0]].prod(-1)  # (N, R)
    weight = (dt[:, None, None] * prob[..., None] * w_i[:, None]).sum(0) * m  # (R, L)
    x = x0.expand(len(m), L)
    noisy = torch.where(m, model.config.mask_token_id, x)
    return model_loss(model, x, noisy, weight, answer_mask.expand(len(m), L), norm="masked", denominator=1.0)


def test_exact_denoiser_elbo_sft_and_gift_elbo_exact_gift_not():
    g = gen(3)
    V0, n = 3, 4  # one prompt token, three answer tokens
    logp = torch.log_softmax(1.5 * torch.randn(V0 ** n, generator=g, dtype=f64), 0).reshape((V0,) * n)
    model = ExactDenoiser(logp)
    answer_mask = torch.tensor([[False, True, True, True]])
    t, dt = gauss_legendre_t(n=400, q=12)
    N = len(t)
    am = answer_mask.expand(N, n)
    for trial in range(2):
        x0 = torch.randint(0, V0, (1, n), generator=g)
        nll = -(logp[tuple(x0[0])] - logp[x0[0, 0]].flatten().logsumexp(0))  # -log p(answer | prompt)

        p = sft_mask_probs(t, am, eps=0.0)
        sft = expected_loss(model, x0, answer_mask, p, importance_weights(p, am), dt)
        assert abs(sft.item() - nll.item()) < 1e-6

        beta = (0.5 + 1.5 * torch.rand(1, n, generator=g, dtype=f64)) * answer_mask
        r = beta[answer_mask] / beta[answer_mask].mean()
        assert r.min() >= 0.3 and r.max() <= 3
        t_i = gift_mask_probs(t, beta.expand(N, n), am, eps=0.0)
        w = importance_weights(t_i, am) * gift_elbo_jacobian(t, beta.expand(N, n), am, eps=0.0)
        elbo = expected_loss(model, x0, answer_mask, t_i, w, dt)
        assert abs(elbo.item() - nll.item()) < 1e-6

    # Algorithm 2 as printed (no Jacobian) is a different objective, not -log p(x0)
    beta = torch.tensor([[0.0, 0.4, 1.0, 2.0]], dtype=f64)
    t_i = gift_mask_probs(t, beta.expand(N, n), am, eps=0.0)
    gift = expected_loss(model, x0, answer_mask, t_i, importance_weights(t_i, am), dt)
    assert gift.item() < nll.item() - 1e-3  # below -log p(x0) under the exact denoiser: not even a bound


# -----------------------------------------------------------------------------
# 4. Reductions: equal betas give SFT; betas are scale-free


def test_equal_betas_mask_exactly_as_sft_and_scale_invariance():
    model = tiny_model()
    ids, answer_mask = tiny_batch(4, B=6, L=20)
    const = torch.full(ids.shape, 0.7)
    out_sft = model_objective("sft", model, ids, answer_mask, gen(11))
    out_star = model_objective("gift-star", model, ids, answer_mask, gen(11), ref_betas=const)
    assert torch.equal(out_sft[0], out_star[0])  # same draws, same mask
    torch.testing.assert_close(out_sft[1], out_star[1])
    for norm in ("answer", "masked"):
        torch.testing.assert_close(model_loss(model, ids, out_sft[0], out_sft[1], answer_mask, norm),
                                   model_loss(model, ids, out_star[0], out_star[1], answer_mask, norm))

    beta = torch.rand(ids.shape, generator=gen(5))
    t = torch.rand(len(ids), generator=gen(6))
    for c in (1e-3, 7.3):
        torch.testing.assert_close(gift_mask_probs(t, c * beta, answer_mask), gift_mask_probs(t, beta, answer_mask))
        torch.testing.assert_close(gift_elbo_jacobian(t, c * beta, answer_mask),
                                   gift_elbo_jacobian(t, beta, answer_mask))
        a = model_objective("gift-star", model, ids, answer_mask, gen(12), ref_betas=beta)
        b = model_objective("gift-star", model, ids, answer_mask, gen(12), ref_betas=c * beta)
        assert torch.equal(a[0], b[0])
        torch.testing.assert_close(a[1], b[1])


# -----------------------------------------------------------------------------
# 5. Golden: the official SFT loss


def test_golden_sft_loss():
    model = LLaDA.from_pretrained(shared_path("golden", "tiny_llada_mha"))
    raw = load_file(shared_path("golden", "golden_sft_loss.safetensors"))
    gold = {k.removeprefix("mha."): v for k, v in raw.items()}
    ids, L = gold["input_ids"], gold["input_ids"].shape[1]
    answer_mask = torch.arange(L)[None] >= gold["prompt_lengths"][:, None]
    p_mask = sft_mask_probs(gold["t"], answer_mask, eps=1e-3)
    torch.testing.assert_close(p_mask[answer_mask], gold["p_mask"][answer_mask])
    weight = importance_weights(p_mask, answer_mask)
    loss = model_loss(model, ids, gold["noisy_batch"], weight, answer_mask, norm="answer")
    torch.testing.assert_close(loss, gold["loss"][0], rtol=1e-5, atol=0)
    assert abs(loss.item() - 2.4899890) < 1e-5
    masked = gold["masked_indices"].bool()
    assert torch.equal(masked, (gold["noisy_batch"] == model.config.mask_token_id) & answer_mask)
    h = model(gold["noisy_batch"], return_hidden=True)
    token_loss = chunked_cross_entropy(model.head, h[masked], ids[masked], chunk_size=4) / gold["p_mask"][masked]
    torch.testing.assert_close(token_loss, gold["token_loss"], rtol=1e-5, atol=1e-6)
    # pre-training: no prompt, sum / (B L) = "answer" norm with every position in the answer
    everything = torch.ones_like(answer_mask)
    p_all = sft_mask_probs(gold["t"], everything, eps=1e-3)
    pre = model_loss(model, ids, gold["pretrain_noisy_batch"], importance_weights(p_all, everything), everything)
    torch.testing.assert_close(pre, gold["pretrain_loss"][0], rtol=1e-5, atol=0)


# -----------------------------------------------------------------------------
# 6. The entropy pass


def test_entropy_pass_chunked_equals_direct_no_graph_dropout_off():
    model = tiny_model(1)
    add_lora(model, r=4, alpha=8, dropout=0.5, generator=gen(7))
    for _, m in lora_layers(model):
        nn.init.normal_(m.lora_B, std=0.2, generator=gen(8))  # non-zero adapters, so dropout would show
    model.train()
    ids, answer_mask = tiny_batch(9, B=3, L=13)
    beta = model_betas(model, ids, answer_mask, chunk_size=5)
    H, nll = model_entropy_and_nll(model, ids, answer_mask, chunk_size=4)
    assert model.training  # mode restored
    assert not beta.requires_grad and beta.grad_fn is None and not H.requires_grad
    torch.testing.assert_close(model_betas(model, ids, answer_mask, chunk_size=5), beta, rtol=0, atol=0)
    model.eval()
    with torch.no_grad():
        logp = model(ids.masked_fill(answer_mask, model.config.mask_token_id)).float().log_softmax(-1)  # (B, L, V)
    model.train()
    H_direct = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(beta, torch.where(answer_mask, H_direct.sqrt(), 0.0))
    torch.testing.assert_close(H, torch.where(answer_mask, H_direct, 0.0))
    torch.testing.assert_close(nll, torch.where(answer_mask, -logp.gather(-1, ids[..., None])[..., 0], 0.0))
    assert (beta[~answer_mask] == 0).all() and (beta[answer_mask] > 0).all()
    torch.testing.assert_close(model_betas(model, ids, answer_mask, power=1.0), H)


def test_reference_betas_use_the_base_model_under_lora():
    model = tiny_model(2)
    ids, answer_mask = tiny_batch(10, B=2, L=12)
    base = model_betas(model, ids, answer_mask)
    with pytest.raises(ValueError, match="precomputed_betas"):
        first_pass_betas(model, "initial_entropy", ids, answer_mask, model.config.mask_token_id)
    add_lora(model, r=4, alpha=8, dropout=0.0, generator=gen(7))
    for _, m in lora_layers(model):
        nn.init.normal_(m.lora_B, std=0.2, generator=gen(8))
    assert not torch.allclose(model_betas(model, ids, answer_mask), base)
    torch.testing.assert_close(first_pass_betas(model, "initial_entropy", ids, answer_mask, model.config.mask_token_id), base)
    assert all(m.enabled for _, m in lora_layers(model))


# -----------------------------------------------------------------------------
# 7. Gradients, training smoke, zero masked tokens; the chunked CE and the global denominator


def test_chunked_cross_entropy_equals_full_logits_value_and_gradient():
    g = gen(13)
    N, D, V = 23, 8, 50
    head = nn.Linear(D, V, bias=False)
    nn.init.normal_(head.weight, generator=g)
    h = torch.randn(N, D, generator=g, requires_grad=True)
    y = torch.randint(0, V, (N,), generator=g)
    w = torch.rand(N, generator=g)
    loss = (chunked_cross_entropy(head, h, y, chunk_size=5) * w).sum()
    gh, gW = torch.autograd.grad(loss, (h, head.weight))
    ref = (F.cross_entropy(head(h), y, reduction="none") * w).sum()
    rh, rW = torch.autograd.grad(ref, (h, head.weight))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(gh, rh)
    torch.testing.assert_close(gW, rW)


def test_diffusion_loss_never_keeps_full_vocabulary_logits():
    model = tiny_model(6)  # V = 48, distinct from every other size below
    ids, answer_mask = tiny_batch(20, B=3, L=20)
    noisy, weight, norm = model_objective("sft", model, ids, answer_mask, gen(21))
    saved = []

    def pack(x):
        saved.append(tuple(x.shape))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = model_loss(model, ids, noisy, weight, answer_mask, norm, chunk_size=4)
    assert saved and not any(48 in shape for shape in saved)  # no logits (or head weight) held for backward
    loss.backward()


def test_global_denominator_makes_micro_batches_add_up():
    model = tiny_model(3)
    ids, answer_mask = tiny_batch(14, B=6, L=16)
    noisy, weight, _ = model_objective("gift", model, ids, answer_mask, gen(15))
    n_masked = ((noisy == model.config.mask_token_id) & answer_mask).sum()
    assert 0 < n_masked < answer_mask.sum()
    for norm, denom in (("answer", len(ids)), ("masked", n_masked)):
        full = model_loss(model, ids, noisy, weight, answer_mask, norm)
        parts = sum(model_loss(model, ids[s], noisy[s], weight[s], answer_mask[s], norm, denominator=denom)
                    for s in (slice(0, 2), slice(2, 6)))
        torch.testing.assert_close(parts, full)


def test_explicit_mask_id_overrides_the_config():
    """mask_id= is what the loss functions mask with (Part I never reads a config): a model whose config names a
    wrong mask id, given the right one explicitly, computes exactly what the model with the right config computes
    (and with the config's, not)."""
    model = tiny_model(8)
    wrong = copy.deepcopy(model)
    wrong.config.mask_token_id = 5  # an ordinary token of tiny_batch's ids
    m = model.config.mask_token_id
    ids, answer_mask = tiny_batch(22, B=3, L=14)
    H, nll = model_entropy_and_nll(model, ids, answer_mask)
    H_w, nll_w = model_entropy_and_nll(wrong, ids, answer_mask, mask_id=m)
    assert torch.equal(H_w, H) and torch.equal(nll_w, nll) and H_w.dtype == nll_w.dtype == torch.float32
    beta = model_betas(model, ids, answer_mask)
    assert torch.equal(model_betas(wrong, ids, answer_mask, mask_id=m), beta)
    assert not torch.equal(model_betas(wrong, ids, answer_mask), beta)
    for name in ("sft", "gift", "nll"):
        noisy, weight, norm = model_objective(name, model, ids, answer_mask, gen(23))
        noisy_w, weight_w, _ = model_objective(name, wrong, ids, answer_mask, gen(23), mask_id=m)
        assert torch.equal(noisy_w, noisy) and torch.equal(weight_w, weight), name
        loss = model_loss(model, ids, noisy, weight, answer_mask, norm)
        assert torch.equal(model_loss(wrong, ids, noisy, weight, answer_mask, norm, mask_id=m), loss), name
        assert model_loss(wrong, ids, noisy, weight, answer_mask, norm) != loss  # the config's id would differ
        assert not torch.equal(model_objective(name, wrong, ids, answer_mask, gen(23))[0], noisy)


def test_gradient_only_through_second_pass():
    model = tiny_model(4)
    ids, answer_mask = tiny_batch(16)
    for name in ("gift", "gift-elbo", "gift-sw", "nll"):
        noisy, weight, norm = model_objective(name, model, ids, answer_mask, gen(17))
        assert not weight.requires_grad
        assert all(p.grad is None for p in model.parameters())  # the first pass left no graph behind
        model_loss(model, ids, noisy, weight, answer_mask, norm).backward()
        assert all(p.grad is not None for p in model.parameters())
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", LOSSES)
def test_each_objective_trains_and_survives_zero_masked(name):
    torch.manual_seed(0)  # the optimiser is deterministic anyway; belt and braces
    model = tiny_model(5)
    ids, answer_mask = tiny_batch(18, B=8, L=16)
    ids = torch.where(answer_mask, 3 + ids % 3, ids)  # answers over 3 tokens: learnable in a few steps
    ref = model_betas(model, ids, answer_mask) if name == "gift-star" else None

    def eval_loss():  # the objective itself, averaged over 4 fixed draws
        total = 0.0
        with torch.no_grad():
            for s in range(4):
                noisy, weight, norm = model_objective(name, model, ids, answer_mask, gen(1000 + s), ref_betas=ref)
                total += model_loss(model, ids, noisy, weight, answer_mask, norm).item() / 4
        return total

    before = eval_loss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(20):
        noisy, weight, norm = model_objective(name, model, ids, answer_mask, gen(step), ref_betas=ref)
        loss = model_loss(model, ids, noisy, weight, answer_mask, norm)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert eval_loss() < 0.7 * before

    # nothing masked (no answer here): a finite 0 that still reaches every parameter, so DDP does not hang
    none = torch.zeros_like(answer_mask)
    noisy, weight, norm = model_objective(name, model, ids, none, gen(0),
                                                 ref_betas=torch.zeros(ids.shape) if ref is not None else None)
    assert not (noisy == model.config.mask_token_id).any() and torch.isfinite(weight).all()
    loss = model_loss(model, ids, noisy, weight, none, norm)
    assert loss.item() == 0 and loss.requires_grad
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert all(p.grad is not None and (p.grad == 0).all() for p in model.parameters())


def test_cart_weights_match_the_formula():
    unmasked = torch.rand(2, 9, generator=gen(19)) < 0.5
    w = cart_weights(unmasked, p=0.3)
    for b, i in itertools.product(range(2), range(9)):
        ref = 0.5 * sum(0.3 * 0.7 ** (abs(i - j) - 1) for j in range(9) if j != i and unmasked[b, j])
        assert abs(w[b, i].item() - ref) < 1e-6


# -----------------------------------------------------------------------------
# Every objective pinned: p_i and w_i against values computed by hand, in float64, from the table of gift.py

# the table, written out again: where each objective's betas come from, its p_i, its w_i (at masked answer tokens)
HAND_TABLE = {
    "sft": (None, "p", "1/p"),
    "gift": ("sqrt H", "t_i", "1/t_i"),
    "gift-elbo": ("sqrt H", "t_i", "r (1-p)^(r-1) / t_i"),
    "gift-sw": ("sqrt H", "p", "sqrt H / p"),
    "nll": ("-log p(x0)", "t_i", "1/t_i"),
    "cart": (None, "p", "cart / p"),
    "gift-star": ("sqrt H0", "t_i", "1/t_i"),
}


def hand_p_and_w(name, t, u, H, nll, H0, prompt_lengths, L, eps):
    """p_i and w_i of one objective with plain Python floats and loops (no gift.py function): (B, L) float64."""
    source, p_rule, w_rule = HAND_TABLE[name]
    P, W = torch.zeros(len(t), L, dtype=torch.float64), torch.zeros(len(t), L, dtype=torch.float64)
    for b in range(len(t)):
        p = (1 - eps) * float(t[b]) + eps
        answer = range(int(prompt_lengths[b]), L)
        beta = {"sqrt H": [float(H[b, i]) ** 0.5 for i in range(L)],
                "sqrt H0": [float(H0[b, i]) ** 0.5 for i in range(L)],
                "-log p(x0)": [float(nll[b, i]) for i in range(L)], None: [0.0] * L}[source]
        beta_ref = sum(beta[i] for i in answer) / len(answer)
        for i in answer:
            r = beta[i] / beta_ref if beta_ref > 0 else 1.0
            t_i = min(max(1 - (1 - p) ** r, eps), 1.0)
            P[b, i] = p if p_rule == "p" else t_i
        for i in answer:
            clean = [j for j in range(L) if not float(u[b, j]) < P[b, j]]  # the prompt is always clean
            cart = 0.5 * sum(0.3 * 0.7 ** (abs(i - j) - 1) for j in clean if j != i)
            r = beta[i] / beta_ref if beta_ref > 0 else 1.0
            W[b, i] = {"1/p": 1 / p, "1/t_i": 1 / P[b, i], "r (1-p)^(r-1) / t_i": r * (1 - p) ** (r - 1) / P[b, i],
                       "sqrt H / p": float(H[b, i]) ** 0.5 / p, "cart / p": cart / p}[w_rule]
    return P, W


@pytest.mark.parametrize("name", LOSSES)
def test_each_objective_gives_the_hand_computed_p_and_w(name):
    """objective_batch end to end (its betas, its draws, its p_i and w_i) against hand_p_and_w on fresh inputs: a
    wrong beta source, factor, exponent or normaliser in any row of the table fails here."""
    import gift
    assert set(HAND_TABLE) == set(LOSSES)
    model = tiny_model(11)
    L, eps = 12, 1e-3
    ids, _ = tiny_batch(12, B=3, L=L)
    prompt_lengths = torch.tensor([2, 5, 7])
    answer_mask = torch.arange(L)[None] >= prompt_lengths[:, None]
    H, nll = model_entropy_and_nll(model, ids, answer_mask)
    H0 = H.flip(1).roll(3, 1)  # some other model's entropies, for gift-star's cached betas
    ref = torch.where(answer_mask, H0.clamp_min(0).sqrt(), 0.0) if name == "gift-star" else None
    g = gen(77)
    copy = torch.Generator().set_state(g.get_state())
    t, u = torch.rand(3, generator=copy), torch.rand(3, L, generator=copy)  # objective_batch's draws, in order
    noisy, weight, norm = model_objective(name, model, ids, answer_mask, g, eps=eps, ref_betas=ref)
    P, W = hand_p_and_w(name, t, u, H, nll, H0, prompt_lengths, L, eps)
    masked = noisy == model.config.mask_token_id
    assert torch.equal(masked, u.double() < P)  # the mask is Bernoulli(p_i) with these draws, never the prompt
    torch.testing.assert_close(weight[answer_mask].double(), W[answer_mask], rtol=1e-5, atol=1e-6)
    assert norm == gift.DEFAULT_NORM[name] == {"sft": "answer", "gift": "masked", "gift-elbo": "answer",
                                               "gift-sw": "answer", "nll": "masked", "cart": "answer",
                                               "gift-star": "masked"}[name]
