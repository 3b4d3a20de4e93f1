"""rl.py Part I from its definitions (issue 54, wd1's `wll_d1_neg` trainer and d1's reward_func.py): wd1's loss and
weights in closed form and against a float64 re-implementation of the formula, its gradient through a tiny model
against a finite difference of that formula, d1's one-step likelihood estimate against the model's own logits (LLaDA
and Dream's shifted head), the completion's end and mask on hand-made rows, d1's rewards on hand-written cases beside
d1's rules re-implemented here in a few lines, and the rollout's seeds and prompt order."""

import math
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import REPO, tiny_model

import model as M
import rl
from model import add_lora, lora_layers

f64 = torch.float64


def gen(seed):
    return torch.Generator().manual_seed(seed)


# -----------------------------------------------------------------------------
# The formula, written again in float64 Python: A_i = r_i - mean of the group, w+ = softmax(A),
# w- = softmax(-A), the group's loss sum_i (w-_i - w+_i) l_i, and the mean over the groups


def reference_weights(rewards):
    """(w+, w-) of one group, lists of Python floats."""
    mean = math.fsum(rewards) / len(rewards)
    A = [r - mean for r in rewards]
    e_pos, e_neg = [math.exp(a) for a in A], [math.exp(-a) for a in A]
    return [e / math.fsum(e_pos) for e in e_pos], [e / math.fsum(e_neg) for e in e_neg]


def reference_loss(logp_sums, rewards, G):
    losses = []
    for s in range(0, len(rewards), G):
        w_pos, w_neg = reference_weights(rewards[s:s + G])
        losses.append(math.fsum((wn - wp) * l for wn, wp, l in zip(w_neg, w_pos, logp_sums[s:s + G])))
    return math.fsum(losses) / len(losses)


def close64(actual, expected, scale):
    """float64 sums of a few terms of magnitude <= scale: a few hundred ulps of it is far above their rounding and far
    below what a wrong weight, sign or reduction changes (those move the result by a sizeable share of scale)."""
    actual = actual.detach() if torch.is_tensor(actual) else actual
    assert abs(float(actual) - float(expected)) <= 1e-13 * max(scale, 1.0), (float(actual), float(expected))


# -----------------------------------------------------------------------------
# wd1_loss, wd1_weights, group_advantages


@pytest.mark.parametrize("value", [0.1, 0.7, 0.0, 1.0])
def test_equal_rewards_give_exactly_zero_loss_and_gradient(value):
    G = 6
    rewards = torch.full((G,), value, dtype=f64)
    if value in (0.1, 0.7):  # the float mean of six 0.1s (0.7s) is not 0.1: the rule, not the rounding, makes A = 0
        assert (rewards - rewards.mean()).abs().max() > 0
    A = rl.group_advantages(rewards, G)
    assert A.shape == (1, G) and torch.equal(A, torch.zeros(1, G, dtype=f64))
    w_pos, w_neg = rl.wd1_weights(rewards, G)
    assert torch.equal(w_pos, w_neg) and torch.equal(w_pos, torch.full((1, G), 1 / G, dtype=f64))
    logp_sums = (-10 * torch.rand(G, dtype=f64, generator=gen(0))).requires_grad_()
    loss = rl.wd1_loss(logp_sums, rewards, G)
    loss.backward()
    assert torch.equal(loss.detach(), torch.zeros((), dtype=f64))
    assert torch.equal(logp_sums.grad, torch.zeros(G, dtype=f64))


def test_equal_rewards_of_float32_rollouts_give_exactly_zero():
    """The rollout's rewards are float32 (Group.rewards) and the loss float32 or float64: the group still gives 0."""
    G = 6
    for dtype in (torch.float32, f64):
        rewards = torch.full((2 * G,), 0.1, dtype=torch.float32)
        rewards[G:] = torch.tensor([0.1, 1.0, 0.1, 0.0, 0.1, 0.1])
        logp_sums = (-5 * torch.rand(2 * G, dtype=dtype, generator=gen(1))).requires_grad_()
        rl.wd1_loss(logp_sums, rewards, G).backward()
        assert torch.equal(logp_sums.grad[:G], torch.zeros(G, dtype=dtype))  # the equal group
        assert (logp_sums.grad[G:] != 0).all()  # the other one pulls


@pytest.mark.parametrize("G,gap,winner", [(6, 1.0, 2), (6, 0.9, 0), (4, 2.0, 3), (2, 1.0, 1)])
def test_one_winner_closed_form(G, gap, winner):
    """One reward `gap` above the G - 1 others: A = gap (G - 1) / G for the winner, -gap / G for the losers, so
    w+ = e^gap / (e^gap + G - 1) (winner), 1 / (e^gap + G - 1) (each loser); w- = 1 / (1 + (G - 1) e^gap) (winner),
    e^gap / (1 + (G - 1) e^gap) (each loser). The losers' base reward (0.1, countdown's format score) cancels."""
    e = math.exp(gap)
    wp_win, wp_lose = e / (e + G - 1), 1 / (e + G - 1)
    wn_win, wn_lose = 1 / (1 + (G - 1) * e), e / (1 + (G - 1) * e)
    rewards = torch.full((G,), 0.1, dtype=f64)
    rewards[winner] += gap
    w_pos, w_neg = rl.wd1_weights(rewards, G)
    expected_pos = torch.full((1, G), wp_lose, dtype=f64)
    expected_neg = torch.full((1, G), wn_lose, dtype=f64)
    expected_pos[0, winner], expected_neg[0, winner] = wp_win, wn_win
    torch.testing.assert_close(w_pos, expected_pos, rtol=0, atol=1e-15)  # softmax of G float64 terms: a few ulps
    torch.testing.assert_close(w_neg, expected_neg, rtol=0, atol=1e-15)

    logp_sums = (-20 * torch.rand(G, dtype=f64, generator=gen(G))).requires_grad_()
    loss = rl.wd1_loss(logp_sums, rewards, G)
    l = logp_sums.detach().tolist()
    expected = (wn_win - wp_win) * l[winner] + (wn_lose - wp_lose) * (sum(l) - l[winner])
    close64(loss, expected, 20 * G)
    loss.backward()
    grad = logp_sums.grad
    close64(grad[winner], wn_win - wp_win, 1)
    assert grad[winner] < 0 and (grad[torch.arange(G) != winner] > 0).all()  # descent raises the winner's l only
    close64(grad.sum(), 0.0, 1)  # both weight vectors sum to 1


def test_weights_sum_to_one_per_group_and_order_with_the_rewards():
    G, P = 6, 5
    rewards = torch.rand(P * G, dtype=f64, generator=gen(3))
    w_pos, w_neg = rl.wd1_weights(rewards, G)
    assert w_pos.shape == w_neg.shape == (P, G) and (w_pos > 0).all() and (w_neg > 0).all()
    torch.testing.assert_close(w_pos.sum(dim=1), torch.ones(P, dtype=f64), rtol=0, atol=1e-15)
    torch.testing.assert_close(w_neg.sum(dim=1), torch.ones(P, dtype=f64), rtol=0, atol=1e-15)
    r = rewards.view(P, G)
    order = r.argsort(dim=1)  # the larger the reward, the larger w+ and the smaller w-
    assert (w_pos.gather(1, order).diff(dim=1) > 0).all() and (w_neg.gather(1, order).diff(dim=1) < 0).all()
    for p in range(P):  # against the formula, group by group
        ref_pos, ref_neg = reference_weights(r[p].tolist())
        torch.testing.assert_close(w_pos[p], torch.tensor(ref_pos, dtype=f64), rtol=0, atol=1e-15)
        torch.testing.assert_close(w_neg[p], torch.tensor(ref_neg, dtype=f64), rtol=0, atol=1e-15)
    # A: r minus its own group's mean, no division by the standard deviation
    torch.testing.assert_close(rl.group_advantages(rewards, G), r - r.mean(dim=1, keepdim=True), rtol=0, atol=1e-15)


@pytest.mark.parametrize("G,P", [(6, 1), (6, 4), (2, 3), (8, 2)])
def test_loss_is_the_mean_over_groups_of_the_formula(G, P):
    g = gen(10 * G + P)
    rewards = torch.rand(P * G, dtype=f64, generator=g) * torch.randint(0, 3, (P * G,), generator=g)  # ties, zeros
    rewards[:G] = torch.tensor([0.0] * (G - 1) + [1.0], dtype=f64)  # one winner in the first group
    logp_sums = -30 * torch.rand(P * G, dtype=f64, generator=g)
    loss = rl.wd1_loss(logp_sums, rewards, G)
    close64(loss, reference_loss(logp_sums.tolist(), rewards.tolist(), G), 30 * G)
    per_group = [rl.wd1_loss(logp_sums[s:s + G], rewards[s:s + G], G) for s in range(0, P * G, G)]
    close64(loss, sum(per_group) / P, 30 * G)  # the mean, not the sum, over the groups


def test_a_group_of_equal_rewards_counts_in_the_mean_as_zero():
    G = 4
    rewards = torch.tensor([0.7] * G + [0.0, 1.0, 0.0, 0.0], dtype=f64)
    logp_sums = torch.tensor([-3.0, -9.0, -1.0, -4.0, -2.0, -5.0, -7.0, -6.0], dtype=f64)
    loss = rl.wd1_loss(logp_sums, rewards, G)
    assert loss == rl.wd1_loss(logp_sums[G:], rewards[G:], G) / 2  # 0 and the other group's loss, halved


@pytest.mark.numerics
def test_float32_loss_matches_the_formula():
    """A float32 loss (the autocast path) casts the rewards to float32: G products of magnitude <= 30, summed."""
    G, P = 6, 3
    rewards = torch.rand(P * G, generator=gen(5))
    logp_sums = -30 * torch.rand(P * G, generator=gen(6))
    loss = rl.wd1_loss(logp_sums, rewards, G)
    assert loss.dtype == torch.float32
    expected = reference_loss(logp_sums.double().tolist(), rewards.double().tolist(), G)
    assert abs(float(loss) - expected) <= 8 * G * 2 ** -24 * 30  # a few float32 roundings of each term


@pytest.mark.parametrize("logp_shape,reward_shape,G", [((2, 6), (2, 6), 6), ((12,), (6,), 6), ((7,), (7,), 6),
                                                       ((12,), (12, 1), 6)])
def test_shape_errors_raise(logp_shape, reward_shape, G):
    with pytest.raises(ValueError, match="wd1_loss"):
        rl.wd1_loss(torch.zeros(logp_shape), torch.zeros(reward_shape), G)


# -----------------------------------------------------------------------------
# The likelihood estimate: d1's one-step input, log p at the completion positions, the sums over the mask

LLADA, DREAM = dict(), dict(model_type="Dream", include_qkv_bias=True, rope_theta=1e6, rms_norm_eps=1e-6)


def tiny(family, seed=1):
    """A tiny float64 model in eval mode (no dropout): last id the mask token, the one before it EOS."""
    return tiny_model(seed=seed, std=0.2, **family).double().eval()


def direct_logps(model, noisy, completions):
    """log_softmax(logits)[o_t] at the completion positions, from the model's whole logits (B, L, V); Dream's logits at
    i - 1 predict token i (the shift its official generation code applies, as tests/test_dream_model.py writes it)."""
    logits = model(noisy)  # (G, P + C, V)
    if model.predicts_shifted:
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    C = completions.shape[1]
    return logits[:, -C:].log_softmax(dim=-1).gather(-1, completions[..., None])[..., 0]  # (G, C)


def rollout_like(G, P, C, seed, eos_id=46, mask_id=47):
    """A prompt (P,) and G completions (G, C) ended at their first EOS (a row without one, a row ending at once)."""
    g = gen(seed)
    prompt = torch.randint(0, 40, (P,), generator=g)
    completions = torch.randint(0, 46, (G, C), generator=g)
    ends = torch.randint(1, C, (G,), generator=g)
    ends[0], ends[-1] = C, 0  # the first row without EOS, the last one all EOS
    completions = completions.masked_fill(torch.arange(C)[None] >= ends[:, None], eos_id)
    assert not (completions == mask_id).any()
    return prompt, completions


@pytest.mark.parametrize("prompt_mask", [0.0, 0.15, 0.5, 1.0])
def test_likelihood_input_masks_the_completion_and_each_prompt_token_where_u_is_below_the_rate(prompt_mask):
    G, P, C, mask_id = 5, 40, 7, 47
    prompt, completions = rollout_like(G, P, C, 0)
    noisy = rl.likelihood_input(prompt, completions, prompt_mask, gen(123), mask_id)
    u = torch.rand((G, P), generator=gen(123))  # the same draws: one U(0, 1) per prompt token of each row
    expected = torch.cat([torch.where(u < prompt_mask, mask_id, prompt.expand(G, P)), torch.full((G, C), mask_id)], 1)
    assert noisy.shape == (G, P + C) and noisy.dtype == prompt.dtype and torch.equal(noisy, expected)
    masked = (noisy[:, :P] == mask_id).float().mean()
    if prompt_mask == 0.0:
        assert masked == 0
    elif prompt_mask == 1.0:
        assert masked == 1
    else:  # each row its own draws: rows differ
        assert 0 < masked < 1 and not all(torch.equal(noisy[0], row) for row in noisy[1:])


def test_likelihood_input_masks_prompts_at_the_rate():
    """200 x 500 independent draws at 0.15: the share masked lies within 4 standard deviations (0.005) of 0.15."""
    noisy = rl.likelihood_input(torch.zeros(500, dtype=torch.long), torch.zeros(200, 3, dtype=torch.long), 0.15,
                                gen(7), 47)
    assert abs(float((noisy[:, :500] == 47).float().mean()) - 0.15) < 0.005


def test_likelihood_input_draws_afresh_from_its_generator():
    prompt, completions = rollout_like(3, 30, 4, 1)
    g = gen(5)
    first, second = (rl.likelihood_input(prompt, completions, 0.5, g, 47) for _ in range(2))
    assert not torch.equal(first, second)  # each optimizer step a fresh prompt mask
    assert torch.equal(rl.likelihood_input(prompt, completions, 0.5, gen(5), 47), first)


@pytest.mark.parametrize("family", [LLADA, DREAM], ids=["llada", "dream"])
def test_completion_logps_are_the_models_log_softmax_at_the_completion(family, one_thread):
    """G * C = 270 targets: more than one chunk of gift.CE_CHUNK (256), so the chunk boundary is crossed."""
    model = tiny(family)
    G, P, C = 3, 5, 90
    prompt, completions = rollout_like(G, P, C, 2)
    noisy = rl.likelihood_input(prompt, completions, 0.3, gen(9), 47)
    with torch.no_grad():
        logps = rl.completion_logps(model, noisy, completions)
        expected = direct_logps(model, noisy, completions)
    assert logps.shape == (G, C) and logps.dtype == f64
    # the same forward pass; the head and log-softmax in float64 either way (another order: rounding ~1e-15)
    torch.testing.assert_close(logps, expected, rtol=0, atol=1e-12)
    with_grad = rl.completion_logps(model, noisy, completions)  # the checkpointed chunks the update runs
    assert with_grad.requires_grad and torch.equal(with_grad.detach(), logps)
    if model.predicts_shifted:  # without the shift the numbers are another position's: the test sees the shift
        with torch.no_grad():
            unshifted = model(noisy)[:, -C:].log_softmax(-1).gather(-1, completions[..., None])[..., 0]
        assert (unshifted - expected).abs().max() > 1e-3


@pytest.mark.parametrize("family", [LLADA, DREAM], ids=["llada", "dream"])
def test_group_loss_sums_log_p_over_the_completion_mask_only(family, one_thread):
    model = tiny(family)
    G, P, C, eos = 4, 6, 9, 46
    prompt, completions = rollout_like(G, P, C, 3)
    completions[1] = torch.tensor([3, 4, eos, eos, eos, 11, eos, 12, 13])  # tokens after the first EOS: outside
    mask = rl.completion_mask(completions, eos)
    assert mask[0].all() and mask[1].sum() == 3 and mask[-1].sum() == 1  # no EOS; EOS third; EOS first
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.25])
    with torch.no_grad():
        loss, logp_sums = rl.group_loss(model, prompt, completions, mask, rewards, 0.5, gen(4), 47)
        noisy = rl.likelihood_input(prompt, completions, 0.5, gen(4), 47)
        expected_sums = torch.where(mask, direct_logps(model, noisy, completions), 0.0).sum(dim=1)
    torch.testing.assert_close(logp_sums, expected_sums, rtol=0, atol=1e-12)
    close64(loss, reference_loss(expected_sums.tolist(), rewards.tolist(), G), float(expected_sums.abs().sum()))


# -----------------------------------------------------------------------------
# The gradient of group_loss through a tiny model against a central difference of the formula


def reference_group_loss(model, prompt, completions, mask, rewards, prompt_mask, seed, mask_id):
    """The issue's loss of one group from its definitions alone: d1's input (u < prompt_mask on the prompt, every
    completion token masked), log_softmax of the model's logits, l_i over the mask, the float64 formula."""
    G, P = completions.shape[0], len(prompt)
    u = torch.rand((G, P), generator=gen(seed))
    noisy = torch.cat([torch.where(u < prompt_mask, mask_id, prompt.expand(G, P)), torch.full_like(completions,
                                                                                                   mask_id)], 1)
    with torch.no_grad():
        l = torch.where(mask, direct_logps(model, noisy, completions), 0.0).sum(dim=1)
    return reference_loss(l.tolist(), rewards.tolist(), G)


def check_gradient_against_finite_difference(model, names, h=1e-5):
    """rl.group_loss's autograd gradient at the largest entry of each named parameter, and at one more, against the
    central difference (L(theta + h) - L(theta - h)) / 2h of reference_group_loss. In float64 its error is
    h^2 |L'''| / 6 + eps |L| / h, about 1e-10 here: a 1e-6 tolerance relative to the gradient's size."""
    G, P, C, mask_id, seed, rate = 4, 6, 5, 47, 11, 0.5
    prompt, completions = rollout_like(G, P, C, 4)
    mask = rl.completion_mask(completions, 46)
    rewards = torch.tensor([0.0, 1.0, 0.1, 0.1])
    params = dict(model.named_parameters())
    model.zero_grad()
    loss, _ = rl.group_loss(model, prompt, completions, mask, rewards, rate, gen(seed), mask_id)
    loss.backward()
    close64(loss, reference_group_loss(model, prompt, completions, mask, rewards, rate, seed, mask_id), 100)
    checked = 0
    for name in names:
        p = params[name]
        g = p.grad.flatten()
        for i in (int(g.abs().argmax()), len(g) // 3):
            orig = float(p.data.view(-1)[i])
            values = []
            for x in (orig + h, orig - h):
                p.data.view(-1)[i] = x
                values.append(reference_group_loss(model, prompt, completions, mask, rewards, rate, seed, mask_id))
            p.data.view(-1)[i] = orig
            fd = (values[0] - values[1]) / (2 * h)
            assert abs(float(g[i]) - fd) <= 1e-6 * max(abs(fd), 1e-2), (name, i, float(g[i]), fd)
            checked += abs(fd) > 1e-4
    assert checked >= len(names)  # the largest entries at least carry a gradient worth checking


@pytest.fixture
def all_float64(monkeypatch):
    """RMSNorm and LLaDA's RoPE in the activations' dtype: model.py computes them in float32 even in a float64 model,
    whose loss then carries float32 rounding (1e-7 relative), far above what a finite difference can resolve."""
    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
    monkeypatch.setattr(M.RMSNorm, "forward", rms_norm)
    apply_rope = M.apply_rope
    monkeypatch.setattr(M, "apply_rope", lambda x, cos, sin, in_float32=True: apply_rope(x, cos, sin, False))


def test_group_loss_gradient_matches_finite_difference(one_thread, all_float64):
    model = tiny(LLADA)
    names = ["model.transformer.wte.weight", "model.transformer.blocks.0.q_proj.weight",
             "model.transformer.blocks.1.ff_out.weight", "model.transformer.ln_f.weight",
             "model.transformer.ff_out.weight"]
    check_gradient_against_finite_difference(model, names)


def test_group_loss_gradient_matches_finite_difference_with_lora(one_thread, all_float64):
    model = tiny_model(seed=2, std=0.2)
    add_lora(model, r=2, alpha=4, dropout=0.0, generator=gen(8))
    g = gen(9)
    for _, m in lora_layers(model):  # non-zero B, so that A's gradient is not 0
        with torch.no_grad():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.3)
    model = model.double().eval()
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n for n in lora)
    check_gradient_against_finite_difference(model, [lora[0], lora[1], lora[-2], lora[-1]])


def test_equal_rewards_give_exactly_zero_gradient_through_the_model(one_thread):
    model = tiny(LLADA)
    prompt, completions = rollout_like(6, 5, 7, 5)
    mask = rl.completion_mask(completions, 46)
    loss, logp_sums = rl.group_loss(model, prompt, completions, mask, torch.full((6,), 0.1), 0.15, gen(0), 47)
    loss.backward()
    assert torch.equal(loss.detach(), torch.zeros((), dtype=f64)) and (logp_sums.detach() < 0).all()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p)), name


# -----------------------------------------------------------------------------
# end_at_stop and completion_mask on hand-made rows (8 a turn end, 9 EOS)

TURN_END, EOS = 8, 9


@pytest.mark.parametrize("row,expected", [
    ([8, 1, 2, 3, 4, 5], [8, 9, 9, 9, 9, 9]),  # a stop at the first position
    ([1, 2, 8, 3, 4, 5], [1, 2, 8, 9, 9, 9]),  # in the middle
    ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]),  # none
    ([1, 2, 8, 3, 9, 8], [1, 2, 8, 9, 9, 9]),  # several stops: the first one counts
    ([1, 9, 2, 8, 3, 4], [1, 9, 9, 9, 9, 9]),  # EOS is a stop too
    ([1, 2, 3, 4, 5, 8], [1, 2, 3, 4, 5, 8]),  # a stop at the last position
    ([9, 9, 9, 9, 9, 9], [9, 9, 9, 9, 9, 9]),
])
def test_end_at_stop(row, expected):
    rows = torch.tensor([row, [1, 2, 3, 4, 5, 6]])  # beside a row without a stop: rows are independent
    before = rows.clone()
    out = rl.end_at_stop(rows, [TURN_END, EOS], EOS)
    assert torch.equal(out, torch.tensor([expected, [1, 2, 3, 4, 5, 6]])) and torch.equal(rows, before)


@pytest.mark.parametrize("row,expected", [
    ([9, 1, 2, 3], [1, 0, 0, 0]),  # EOS first: only it
    ([1, 2, 9, 3], [1, 1, 1, 0]),  # up to and including the first EOS
    ([1, 9, 9, 9], [1, 1, 0, 0]),
    ([1, 9, 2, 9], [1, 1, 0, 0]),  # a second EOS is outside
    ([1, 2, 3, 4], [1, 1, 1, 1]),  # no EOS: all of it
    ([1, 2, 3, 9], [1, 1, 1, 1]),
    ([1, 8, 9, 9], [1, 1, 1, 0]),  # a turn end is a token of the completion, the EOS after it too (wd1's mask)
])
def test_completion_mask(row, expected):
    mask = rl.completion_mask(torch.tensor([row]), EOS)
    assert mask.dtype == torch.bool and torch.equal(mask, torch.tensor([expected], dtype=torch.bool))


# -----------------------------------------------------------------------------
# d1's rewards (reward_func.py as wd1 imports it), each rule re-implemented here in a few lines, d1's regexes


def d1_answer(text):
    found = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    return found[-1].strip() if found else None


def d1_sudoku(text, puzzle, solution):
    """extract_answer_sudoku + validate_sudoku_solution."""
    answer = d1_answer(text)
    digits = None if answer is None else "".join(c for c in answer if c.isdigit())
    if not digits:
        return 0.0
    digits = digits + "0" * (16 - len(digits)) if len(digits) < 16 else digits[:16]
    empty = [i for i in range(16) if puzzle[i] == "0"]
    return sum(1 for i in empty if digits[i] == solution[i]) / len(empty) if empty else 0.0


def d1_countdown(text, numbers, target):
    """compute_score (format score 0.1, score 1.0): validate_equation, then evaluate_equation (Python's eval of a
    hand-written arithmetic string, d1's own call), then the 1e-5 test."""
    equation = d1_answer(text)
    if equation is None:
        return 0
    if sorted(int(n) for n in re.findall(r"\d+", equation)) != sorted(numbers):
        return 0.1
    try:
        if not re.match(r"^[\d+\-*/().\s]+$", equation):
            raise ValueError
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "(3)(4)": a SyntaxWarning before the TypeError
            result = eval(equation, {"__builtins__": None}, {})
    except Exception:
        return 0.1
    try:
        return 1.0 if abs(result - target) < 1e-5 else 0.1
    except Exception:
        return 0.1


def d1_count_xml(text):
    count = 0.0
    if text.count("<reasoning>\n") == 1:
        count += 0.125
    if text.count("\n</reasoning>\n") == 1:
        count += 0.125
    if text.count("\n<answer>\n") == 1:
        count += 0.125
        count -= len(text.split("\n</answer>\n")[-1]) * 0.001
    if text.count("\n</answer>") == 1:
        count += 0.125
        count -= (len(text.split("\n</answer>")[-1]) - 1) * 0.001
    return count


def d1_gsm8k(text, answer):
    """correctness + int + strict format + soft format + xmlcount, each as d1 writes it."""
    extracted = text.split("<answer>")[-1].split("</answer>")[0].strip()
    strict = re.match(r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n$", text)
    soft = re.match(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", text)
    return ((2.0 if extracted == answer else 0.0) + (0.5 if extracted.isdigit() else 0.0) + (0.5 if strict else 0.0)
            + (0.5 if soft else 0.0) + d1_count_xml(text))


def d1_boxed_in_answer(text):
    """boxed_in_answer: 1 if the text holds "<answer>", then + 1 if its answer part (the whole text without a tag)
    holds "\\b" "oxed" as d1 wrote it, a backspace and "oxed" (its string is not raw), else + 0.5."""
    part = text.split("<answer>")[1].split("</answer>")[0] if "<answer>" in text else text
    return (1.0 if "<answer>" in text else 0.0) + (1.0 if "\boxed" in part else 0.5)


SOLUTION = "1234341221434321"  # rows 1234 / 3412 / 2143 / 4321
EMPTY = (1, 4, 6, 11, 12, 15)
PUZZLE = "".join("0" if i in EMPTY else c for i, c in enumerate(SOLUTION))
WRONG = "".join(str(5 - int(c)) if i in EMPTY else c for i, c in enumerate(SOLUTION))  # every empty cell wrong


def tag(text):
    return f"<answer>{text}</answer>"


SUDOKU_CASES = [
    (SOLUTION, 0.0),  # no tag
    ("<answer>" + SOLUTION, 0.0),  # no closing tag
    (tag(SOLUTION), 1.0),
    ("<reasoning>\nfill it\n</reasoning>\n" + tag("\n" + SOLUTION + "\n") + "\n", 1.0),
    (tag(WRONG) + " no, rather " + tag(SOLUTION), 1.0),  # several answers: the LAST
    (tag(SOLUTION) + " no, rather " + tag(WRONG), 0.0),
    (tag(SOLUTION) + " " + tag("none"), 0.0),  # the last tag holds no digit: 0, the earlier one is not read
    (tag("1234"), 1 / 6),  # too few: padded with "0", which matches no cell; cell 1 of the empty ones is right
    (tag(SOLUTION + "4321"), 1.0),  # too many: cut to 16
    (tag("1" + SOLUTION), 0.0),  # one too many at the front: cut at the end, so shifted, no empty cell matches
    (tag(SOLUTION[1:]), 0.0),  # one too few: shifted the other way, padded
    (tag("12 34\n34-12|21,43 43.21"), 1.0),  # non-digits dropped, across lines
    (tag("1 2 3 4 / 3 4 1 2 / 2 1 4 3 / 4 3 2 1"), 1.0),
    (tag(SOLUTION[:1] + "\u0662" + SOLUTION[2:]), 5 / 6),  # ARABIC-INDIC TWO: a digit (str.isdigit), not "2"
    (tag(SOLUTION[:1] + "\u00b2" + SOLUTION[2:]), 5 / 6),  # SUPERSCRIPT TWO: isdigit too
    (tag("0" * 16), 0.0),
    (tag(""), 0.0),
    (tag("   \n "), 0.0),
    (tag("".join(SOLUTION[i] if i in (1, 4, 6) else c for i, c in enumerate(WRONG))), 3 / 6),
]


@pytest.mark.parametrize("text,expected", SUDOKU_CASES)
def test_sudoku_reward(text, expected):
    assert rl.sudoku_reward(text, PUZZLE, SOLUTION) == d1_sudoku(text, PUZZLE, SOLUTION) == expected


def test_sudoku_reward_is_zero_without_an_empty_cell():
    assert rl.sudoku_reward(tag(SOLUTION), SOLUTION, SOLUTION) == d1_sudoku(tag(SOLUTION), SOLUTION, SOLUTION) == 0.0


def test_sudoku_reward_counts_only_the_empty_cells():
    """The given cells are not scored: an answer that contradicts every given cell but fills the empty ones right."""
    answer = "".join(c if i in EMPTY else str(5 - int(c)) for i, c in enumerate(SOLUTION))
    assert rl.sudoku_reward(tag(answer), PUZZLE, SOLUTION) == 1.0
    one_empty = "".join("0" if i == 7 else c for i, c in enumerate(SOLUTION))
    assert rl.sudoku_reward(tag(SOLUTION[:7] + "9" + SOLUTION[8:]), one_empty, SOLUTION) == 0.0


NUMBERS, TARGET = [3, 4, 5], 17
COUNTDOWN_CASES = [
    ("3*4+5", 0.0),  # no tag
    ("<answer>3*4+5", 0.0),
    (tag("3*4+5"), 1.0),
    (tag("\n 5 + 4 * 3 \n"), 1.0),
    (tag("(3*4)+5."), 1.0),  # "5." is 5.0
    (tag("3*5+4"), 0.1),  # wrong value
    (tag("3*4+6"), 0.1),  # wrong numbers
    (tag("3*4+5+5-5"), 0.1),  # a number twice
    (tag("3*4"), 0.1),  # one missing
    (tag("3*4+5=17"), 0.1),  # the target written: a number too many
    (tag("3×4+5"), 0.1),  # a disallowed character
    (tag("3*4+5 # ok"), 0.1),
    (tag("3*4+5)"), 0.1),  # a syntax error
    (tag("(3)(4)+5"), 0.1),  # not arithmetic (a call)
    (tag("03*4+5"), 0.1),  # "03": a syntax error in Python
    (tag("\u0663*4+5"), 0.1),  # ARABIC-INDIC THREE: \d and int() read it as 3, Python's eval does not
    (tag(""), 0.1),
    (tag("3*5+4") + " rather " + tag("3*4+5"), 1.0),  # several tags: the last
    (tag("3*4+5") + " rather " + tag("3*5+4"), 0.1),
]


@pytest.mark.parametrize("text,expected", COUNTDOWN_CASES)
def test_countdown_reward(text, expected):
    assert rl.countdown_reward(text, NUMBERS, TARGET) == d1_countdown(text, NUMBERS, TARGET) == expected


@pytest.mark.parametrize("text,numbers,target,expected", [
    (tag("5/(4-4)"), [4, 4, 5], 5, 0.1),  # division by zero
    (tag("5//(4-4)"), [4, 4, 5], 5, 0.1),
    (tag("1/2"), [1, 2], 0.5, 1.0),  # true division, a float target
    (tag("7//2*1"), [7, 2, 1], 3, 1.0),  # "//" floor division
    (tag("3**2*1"), [3, 2, 1], 9, 1.0),  # "**" a power
    (tag("-3+4*5"), [3, 4, 5], 17, 1.0),  # a unary minus
    (tag("10/3*3"), [10, 3, 3], 10, 1.0),  # 10.000000000000002: within 1e-5
    (tag("2.5*4"), [2, 5, 4], 10, 1.0),  # "2.5" is the numbers 2 and 5
    (tag("2.5*4"), [2.5, 4], 10, 0.1),
])
def test_countdown_reward_arithmetic(text, numbers, target, expected):
    assert rl.countdown_reward(text, numbers, target) == d1_countdown(text, numbers, target) == expected


STRICT = "<reasoning>\nsome steps\n</reasoning>\n<answer>\n{}\n</answer>\n"


@pytest.mark.parametrize("text,answer,expected", [
    ("<answer>-3</answer>", "-3", 2.0),  # correctness alone (not all digits, no format)
    ("-3", "-3", 2.0),  # no tag: the whole text, stripped, is the extracted answer
    ("<answer>7</answer>", "8", 0.5),  # the int reward alone
    ("12", "12", 2.5),  # correct and all digits
    ("<reasoning>r</reasoning> <answer>A</answer>", "8", 0.5),  # the soft format alone (one line each: no DOTALL)
    ("<reasoning>\nr", "8", 0.125),  # xmlcount alone: one tag line
    ("<reasoning>\nr\n</reasoning>\n", "8", 0.25),
    (STRICT.format("A"), "8", 1.0),  # the strict format (0.5) and its four tag lines (0.5), not the soft one
    (STRICT.format("8"), "8", 3.5),  # correct, all digits, strict, xmlcount: 2 + 0.5 + 0.5 + 0.5
    ("<reasoning>r</reasoning>\n<answer>8</answer>", "8", 3.0),  # correct, all digits, soft
    # no final newline: no strict format; no "\n</answer>\n", so d1 charges 0.001 per character of the WHOLE text (56)
    (STRICT.format("8").removesuffix("\n"), "8", 2.0 + 0.5 + 0.125 + 0.125 + (0.125 - 56 * 0.001) + (0.125 + 0.001)),
])
def test_gsm8k_reward_parts(text, answer, expected):
    # abs 1e-12: float sums of a few parts (exact but for the 0.001 penalties); a part missing moves it by >= 0.001
    assert rl.gsm8k_reward(text, answer) == pytest.approx(expected, rel=0, abs=1e-12)
    assert d1_gsm8k(text, answer) == pytest.approx(expected, rel=0, abs=1e-12)


def test_gsm8k_reward_penalises_text_after_the_answer():
    """xmlcount: 0.001 per character after "\\n</answer>\\n" and after "\\n</answer>" (less its newline)."""
    for k in (1, 8, 40):
        text = STRICT.format("A") + "x" * k  # neither format matches any more ($, and the soft one's one line)
        expected = 0.5 - 2 * k * 0.001
        assert abs(rl.gsm8k_reward(text, "8") - expected) < 1e-12 and abs(d1_gsm8k(text, "8") - expected) < 1e-12
        assert abs(rl.xml_count(text) - d1_count_xml(text)) < 1e-15


def test_xml_count_is_d1s_count_xml_bit_for_bit():
    texts = [STRICT.format("A") + "x" * k for k in range(60)]
    assert [rl.xml_count(t) for t in texts] == [d1_count_xml(t) for t in texts]


def test_gsm8k_reward_compares_with_the_gold_as_gsm8k_writes_it(tmp_path):
    from eval import load_gsm8k
    path = tmp_path / "gsm8k.jsonl"
    path.write_text('{"question": "How much?", "answer": "It costs 114,200.\\n#### 114,200"}\n')
    item = load_gsm8k(path)[0]
    for text in ["<answer>114,200</answer>", "<answer>114200</answer>"]:
        assert rl.reward("gsm8k", text, item) == d1_gsm8k(text, "114,200")


@pytest.mark.parametrize("text,gold,expected", [
    ("so \\boxed{\\frac12}", "\\frac{1}{2}", 2.25),  # equivalent (Hendrycks' \frac fix), no answer tag
    ("<answer>\\boxed{0.5}</answer>", "\\frac{1}{2}", 2.75),  # "0.5" is \frac{1}{2}; a tag: 2 + 0.5 * (1 + 0.5)
    ("<answer>\\boxed{1/2}", "\\frac{1}{2}", 2.75),  # an open tag counts; a/b is \frac{a}{b}
    ("1/2", "\\frac{1}{2}", 2.25),  # no box: the whole text is compared
    ("\\boxed{2}", "\\frac{1}{2}", 0.25),
    ("<answer>2</answer>", "2", 0.75),  # no box: the whole text, tags and all, is compared with "2"
    ("\\boxed{2} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 2.25),  # the last box
    ("\\boxed{\\frac{1}{2}} then \\boxed{2}", "\\frac{1}{2}", 0.25),
    ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", 0.25),  # a box never closed: the whole text, not equivalent
    ("the answer is \\boxed 5$.", "5", 2.25),  # "\boxed " up to "$"
    ("<answer>\\boxed{5}</answer>", "5", 2.75),  # a real "\boxed" in the tag: d1 tests "\b" (a backspace), 0.5
])
def test_math_reward(text, gold, expected):
    assert rl.math_reward(text, gold) == expected
    assert rl.math_reward(text, gold) - (2.0 if expected >= 2 else 0.0) == 0.5 * d1_boxed_in_answer(text)


def test_math_reward_format_part_is_d1s_even_with_a_backspace():
    for text in ["<answer>x\boxed</answer>", "x\boxed"]:
        assert rl.math_reward(text, "y") == 0.5 * d1_boxed_in_answer(text)


def test_reward_dispatch():
    assert rl.reward("sudoku", tag(SOLUTION), dict(puzzle=PUZZLE, solution=SOLUTION)) == 1.0
    assert rl.reward("sudoku", tag("1234"), dict(puzzle=PUZZLE, solution=SOLUTION)) == 1 / 6
    assert rl.reward("countdown", tag("3*4+5"), dict(numbers=NUMBERS, target=TARGET)) == 1.0
    assert rl.reward("countdown", tag("3*5+4"), dict(numbers=NUMBERS, target=TARGET)) == 0.1
    assert rl.reward("gsm8k", "<answer>18</answer>", dict(gold=18.0, answer_text="18")) == 2.5
    assert rl.reward("gsm8k", "<answer>18.0</answer>", dict(gold=18.0, answer_text="18")) == 0.0
    assert rl.reward("gsm8k", "<answer>2.5</answer>", dict(gold=2.5, answer_text="2.5")) == 2.0
    assert rl.reward("math500", "\\boxed{\\frac12}", dict(gold="\\frac{1}{2}")) == 2.25
    with pytest.raises(ValueError, match="unknown task"):
        rl.reward("sudoku4", "", {})


# -----------------------------------------------------------------------------
# stream_seed and rollout_prompts


def test_stream_seed_is_deterministic_and_distinct():
    seeds = {rl.stream_seed(s, kind, i, j) for s in (0, 1) for kind in ("rollout", "prompt mask")
             for i in range(20) for j in range(10)}
    assert len(seeds) == 2 * 2 * 20 * 10  # no two streams share a seed
    assert all(isinstance(s, int) and 0 <= s < 2 ** 63 for s in seeds)  # a valid torch.Generator seed
    assert rl.stream_seed(0, "rollout", 1, 2) == rl.stream_seed(0, "rollout", 1, 2)
    assert rl.stream_seed(0, "rollout", 1, 2) != rl.stream_seed(0, "rollout", 2, 1)
    assert rl.stream_seed(0, "order", 0) != rl.stream_seed(1, "order", 0)


def test_stream_seed_is_the_same_in_another_process():
    """Not Python's hash() of the index, which changes with PYTHONHASHSEED from process to process."""
    code = "import rl; print(rl.stream_seed(3, 'rollout', 4, 5), rl.stream_seed(0, 'order', 7))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.split()
    assert [int(v) for v in out] == [rl.stream_seed(3, "rollout", 4, 5), rl.stream_seed(0, "order", 7)]


@pytest.mark.parametrize("n_items,P", [(12, 4), (10, 4), (8, 8), (30, 7)])
def test_rollout_prompts_is_a_permutation_per_pass(n_items, P):
    per_pass = n_items // P
    passes = [[rl.rollout_prompts(n_items, k, P, seed=3) for k in range(p * per_pass, (p + 1) * per_pass)]
              for p in range(3)]
    for rollouts in passes:
        assert all(len(r) == P and len(set(r)) == P for r in rollouts)  # P distinct prompts per rollout
        seen = [i for r in rollouts for i in r]
        assert len(set(seen)) == per_pass * P and set(seen) <= set(range(n_items))  # no repeat within a pass
        if n_items % P == 0:
            assert sorted(seen) == list(range(n_items))
    flat = [[i for r in rollouts for i in r] for rollouts in passes]
    assert flat[0] != flat[1] and flat[1] != flat[2]  # each pass its own order
    assert rl.rollout_prompts(n_items, 0, P, seed=3) == passes[0][0]  # deterministic
    assert [rl.rollout_prompts(n_items, k, P, seed=4) for k in range(per_pass)] != passes[0]  # the seed matters
