"""The golden comparisons' float32 rule (conftest.float32_atol) is tight enough for what it must catch: each bug
planted here moves the golden logits past it, while the model as loaded stays within it. The margins, error / atol:
LLaDA's RoPE theta x 1.1, 172; Dream's, 623; LLaDA's RMSNorm eps x 10 (1e-5 -> 1e-4), 8; Dream's q bias dropped,
1.7e4. A rule 1000x looser lets the first three through, and these tests fail. (Dream's eps x 10, 1e-6 -> 1e-5,
moves its logits by 0.28 atol only: its golden activations are too large for eps to matter, so LLaDA's is used.)"""

import pytest
import torch
from conftest import GOLDEN, assert_float32_close, model_depth
from safetensors.torch import load_file

from model import LLaDA, RMSNorm

pytestmark = pytest.mark.numerics  # float32 against goldens (conftest.py)


def golden_case(family):
    """(model, input ids, the official code's logits) of a golden checkpoint (tests/golden/README.md)."""
    if family == "llada":
        g = load_file(GOLDEN / "golden_forward.safetensors")
        return LLaDA.from_pretrained(GOLDEN / "tiny_llada_mha").eval(), g["mha.input_ids"], g["mha.logits"]
    g = load_file(GOLDEN / "dream" / "golden.safetensors")
    dream = LLaDA.from_pretrained(GOLDEN / "dream" / "tiny_dream_gqa").eval()
    return dream, g["gqa.plain.input_ids"], g["gqa.plain.logits"]


def rope_theta_off(model):
    model.config.rope_theta *= 1.1  # read at each forward (rope_cos_sin)


def eps_off(model):
    for norm in (m for m in model.modules() if isinstance(m, RMSNorm)):
        norm.eps *= 10


def q_bias_dropped(model):
    for block in model.model.transformer.blocks:
        block.q_proj.bias = None


@pytest.mark.parametrize("family, plant", [("llada", rope_theta_off), ("dream", rope_theta_off), ("llada", eps_off),
                                           ("dream", q_bias_dropped)])
@torch.no_grad()
def test_the_float32_rule_catches_a_planted_bug(family, plant):
    model, ids, logits = golden_case(family)
    depth = model_depth(model.config)
    assert_float32_close(model(ids), logits, depth)
    plant(model)
    with pytest.raises(AssertionError):
        assert_float32_close(model(ids), logits, depth)
