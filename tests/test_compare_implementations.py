"""experiments/compare_implementations.py: each variant equals this code's loss where a closed form says so."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import compare_implementations as ci  # noqa: E402

pytestmark = pytest.mark.numerics  # float32 against goldens and other code paths (conftest.py)


def setup(micro):
    old = ci.MICRO
    ci.MICRO = micro
    try:
        model, mbs = ci.tiny_lora_model(0), ci.make_batch(0)
    finally:
        ci.MICRO = old
    return model, mbs, ci.make_draws(mbs, 1)


def test_every_choice_set_to_ours_is_gift_py():
    model, mbs, draws = setup(ci.MICRO)
    ours = ci.ours_gift(model, mbs, draws)
    assert torch.allclose(ci.gift_variant(model, mbs, draws, **ci.OURS), ours, rtol=1e-6)
    assert torch.allclose(ci.sft_variant(model, mbs, draws, **ci.OURS), ci.ours_sft(model, mbs, draws), rtol=1e-6)


def test_at_batch_one_the_micro_batch_choices_are_ours():
    """One row per micro-batch: LIFT's micro-batch beta_ref is the row's, and d1's / dllm's micro-batch token
    normalisation averaged over micro-batches is ours (each row / its answer length, / B)."""
    model, mbs, draws = setup([[0], [1], [2], [3]])
    g0 = ci.ours_gift(model, mbs, draws)
    assert torch.allclose(ci.gift_variant(model, mbs, draws, beta_ref="micro-batch"), g0, rtol=1e-6)
    s0 = ci.ours_sft(model, mbs, draws)
    assert torch.allclose(ci.sft_variant(model, mbs, draws, sft_norm="micro-batch-tokens"), s0, rtol=1e-6)


def test_lift_t_division_equals_ours_without_clamp_or_empty_mask_and_nans_on_a_zero_entropy():
    model, mbs, draws = setup(ci.MICRO)
    g0 = ci.ours_gift(model, mbs, draws)
    assert torch.allclose(ci.gift_variant(model, mbs, draws, t_div="lift"), g0, rtol=1e-5)

    def zero(H):
        H = H.clone()
        H[0, 0] = 0.0
        return H
    assert torch.isnan(ci.gift_variant(model, mbs, draws, t_div="lift", entropy_hook=zero))
    assert torch.allclose(ci.gift_variant(model, mbs, draws, entropy_hook=zero), g0, rtol=1e-6)


def test_per_micro_batch_norm_is_global_with_one_micro_batch():
    model, mbs, draws = setup([[0, 1, 2, 3]])
    assert torch.allclose(ci.gift_variant(model, mbs, draws, norm="per-micro-batch"), ci.ours_gift(model, mbs, draws),
                          rtol=1e-6)


def test_excluding_the_padding_changes_the_loss():
    model, mbs, draws = setup(ci.MICRO)
    g0 = ci.ours_gift(model, mbs, draws)
    assert abs(float(ci.gift_variant(model, mbs, draws, pad="excluded") / g0) - 1) > 0.01
