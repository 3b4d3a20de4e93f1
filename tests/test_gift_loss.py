"""gift.gift_loss, GIFT's step written once plainly (one batch, one process, full logits), is the number train_step
minimises: the same entropy pass, betas, t_i, mask, 1 / t_i weights and division by the masked count, for LLaDA and
for Dream (whose logits are read one position to the left), within float32 rounding (conftest.py's rule)."""

import pytest
import torch
from conftest import float32_atol, model_depth, tiny_model

import embedded
from gift import MicroBatch, gift_loss, predicting_hidden, train_step
from model import LLaDA

pytestmark = pytest.mark.numerics  # float32 through two code paths (conftest.py)


def tiny_dream(seed=0):
    tokenizer = embedded.make_char_tokenizer(family="dream")
    config = embedded.tiny_config_for(tokenizer, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=64,
                                      max_sequence_length=64)
    model = LLaDA(config).init_weights(torch.Generator().manual_seed(seed), std=0.2)
    assert model.predicts_shifted
    return model


def batch(config, seed=0, B=4, L=14):
    """Random ids (no mask token) and an answer mask after prompts of 3 .. 8 tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.mask_token_id, (B, L), generator=g)
    prompt = torch.randint(3, 9, (B,), generator=g)
    return ids, torch.arange(L)[None] >= prompt[:, None]


def generators(B, seed=7):
    return [torch.Generator().manual_seed(seed + r) for r in range(B)]


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_plain_gift_step_is_train_steps_loss(family):
    model = (tiny_model(seed=3, std=0.2) if family == "llada" else tiny_dream(seed=3)).eval()
    config = model.config
    mask_id = config.mask_token_id
    for seed in range(3):
        ids, answer_mask = batch(config, seed)
        plain = gift_loss(lambda x: model.head(predicting_hidden(model, x)), ids, answer_mask, mask_id,
                          generators(len(ids), 10 * seed))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        result = train_step(model, optimizer, [MicroBatch(ids, answer_mask, generators(len(ids), 10 * seed))], "gift")
        expected = torch.tensor(result["loss"])
        assert result["n_masked"] > 0
        torch.testing.assert_close(plain.detach(), expected, rtol=0,
                                   atol=float32_atol(expected, model_depth(config)))


def test_plain_gift_step_depends_on_the_entropies():
    """The check above can fail: SFT's loss (no betas, per-answer normalisation) on the same draws is another
    number, and so is GIFT's with the raw entropy (beta_power 1)."""
    model = tiny_model(seed=3, std=0.2).eval()
    ids, answer_mask = batch(model.config)
    logits = lambda x: model.head(predicting_hidden(model, x))  # noqa: E731
    with torch.no_grad():
        gift = gift_loss(logits, ids, answer_mask, model.config.mask_token_id, generators(len(ids)))
        raw = gift_loss(logits, ids, answer_mask, model.config.mask_token_id, generators(len(ids)), beta_power=1.0)
    sft = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0),
                     [MicroBatch(ids, answer_mask, generators(len(ids)))], "sft")["loss"]
    assert abs(gift.item() - sft) > 1e-3 and abs(gift.item() - raw.item()) > 1e-4
