"""gift.gift_loss, GIFT's step written once plainly (one batch, one process, full logits), is the number train_step
minimises: the same entropy pass (dropout off), betas, t_i, mask, 1 / t_i weights, dropout in the second pass and
division by the masked count, for LLaDA and for Dream (whose logits are read one position to the left), within
float32 rounding (conftest.py's rule); with the global masked count passed, micro-batches add up to the whole step."""

import pytest
import torch
from conftest import float32_atol, model_depth, tiny_model

import embedded
from gift import MicroBatch, gift_loss, predicting_hidden, train_step
from model import LLaDA, add_lora, lora_layers

pytestmark = pytest.mark.numerics  # float32 through two code paths (conftest.py)


def tiny_dream(seed=0):
    tokenizer = embedded.make_char_tokenizer(family="dream")
    config = embedded.tiny_config_for(tokenizer, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=64,
                                      max_sequence_length=64)
    model = LLaDA(config).init_weights(torch.Generator().manual_seed(seed), std=0.2)
    assert model.predicts_shifted
    return model


def dream_logits(m, x):
    """Dream's logits at position i - 1 predict token i: read them at token i's position (gift_loss's docstring)."""
    return m.head(predicting_hidden(m, x))


def lora_model(seed=3, dropout=0.05):
    """A tiny LLaDA with the paper's LoRA targets (q, k, v) and dropout 0.05, left in train mode as a trainer leaves
    it; its B matrices are drawn (not PEFT's zeros), so that the adapters, and their dropout, change the logits."""
    model = add_lora(tiny_model(seed=seed, std=0.2), r=4, alpha=8, dropout=dropout,
                     generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, m in lora_layers(model):
            m.lora_B.normal_(0.0, 0.5, generator=g)
    assert model.training
    return model


def batch(config, seed=0, B=4, L=14):
    """Random ids (no mask token) and an answer mask after prompts of 3 .. 8 tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.mask_token_id, (B, L), generator=g)
    prompt = torch.randint(3, 9, (B,), generator=g)
    return ids, torch.arange(L)[None] >= prompt[:, None]


def generators(B, seed=7):
    return [torch.Generator().manual_seed(seed + r) for r in range(B)]


def one_step(model, micro_batches, objective="gift"):
    """train_step's result on (ids, answer_mask, generators) micro-batches, the weights left as they are (lr 0)."""
    return train_step(model, torch.optim.SGD(model.parameters(), lr=0.0),
                      [MicroBatch(ids, answer_mask, gens) for ids, answer_mask, gens in micro_batches], objective)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_plain_gift_step_is_train_steps_loss(family):
    model = (tiny_model(seed=3, std=0.2) if family == "llada" else tiny_dream(seed=3)).eval()
    config = model.config
    mask_id = config.mask_token_id
    kw = {} if family == "llada" else dict(logits=dream_logits)  # LLaDA's default: model(ids)
    for seed in range(3):
        ids, answer_mask = batch(config, seed)
        plain = gift_loss(model, ids, answer_mask, mask_id, generators(len(ids), 10 * seed), **kw)
        result = one_step(model, [(ids, answer_mask, generators(len(ids), 10 * seed))])
        expected = torch.tensor(result["loss"])
        assert result["n_masked"] > 0 and not model.training
        torch.testing.assert_close(plain.detach(), expected, rtol=0,
                                   atol=float32_atol(expected, model_depth(config)))


def test_plain_gift_step_in_train_mode_with_lora_dropout_is_train_steps_loss():
    """A model left in train mode with LoRA dropout 0.05 (the paper's): gift_loss's entropy pass runs with dropout
    off, as train_step's first pass, and its second pass with dropout on, drawing the masks train_step draws: both
    take t and u from the rows' generators and dropout from torch's global generator in the second forward only, so
    the global generator, seeded alike before each, gives both the same dropout masks. Before gift_loss switched
    dropout off, its entropy pass drew dropout (other betas) and moved the global generator (other masks)."""
    model = lora_model()
    config, mask_id = model.config, model.config.mask_token_id
    for seed in range(2):
        ids, answer_mask = batch(config, seed)
        torch.manual_seed(100 + seed)
        plain = gift_loss(model, ids, answer_mask, mask_id, generators(len(ids), 10 * seed))
        assert model.training  # the model's mode is restored after the entropy pass
        torch.manual_seed(100 + seed)
        result = one_step(model, [(ids, answer_mask, generators(len(ids), 10 * seed))])
        expected = torch.tensor(result["loss"])
        atol = float32_atol(expected, model_depth(config))
        torch.testing.assert_close(plain.detach(), expected, rtol=0, atol=atol)
        # the check can fail: the second pass's dropout changes the loss by far more than float32 rounding
        model.eval()
        without_dropout = gift_loss(model, ids, answer_mask, mask_id, generators(len(ids), 10 * seed))
        model.train()
        assert abs(without_dropout.item() - expected.item()) > 100 * atol


def test_micro_batches_given_the_global_masked_count_add_up_to_train_steps_loss():
    """Gradient accumulation (2 micro-batches, dropout on): each micro-batch's gift_loss over n_masked = the masked
    count of the WHOLE step (Algorithm 2's N, which train_step sums over micro-batches and ranks) adds up to
    train_step's loss; over each micro-batch's own count it does not."""
    model = lora_model(seed=4)
    config, mask_id = model.config, model.config.mask_token_id
    micro = [(*batch(config, seed), generators(4, 10 * seed)) for seed in (1, 2)]
    torch.manual_seed(200)
    result = one_step(model, micro)
    expected, n_masked = torch.tensor(result["loss"]), result["n_masked"]
    atol = float32_atol(expected, model_depth(config))
    regenerate = lambda j: generators(4, 10 * (j + 1))  # noqa: E731  the same rows' generators, freshly seeded
    torch.manual_seed(200)
    total = sum(gift_loss(model, ids, answer_mask, mask_id, regenerate(j), n_masked=n_masked)
                for j, (ids, answer_mask, _) in enumerate(micro))
    torch.testing.assert_close(total.detach(), expected, rtol=0, atol=atol)
    torch.manual_seed(200)
    local = sum(gift_loss(model, ids, answer_mask, mask_id, regenerate(j)) for j, (ids, answer_mask, _) in
                enumerate(micro))
    assert abs(local.item() - expected.item()) > 100 * atol


def test_plain_gift_step_depends_on_the_entropies():
    """The checks above can fail: SFT's loss (no betas, per-answer normalisation) on the same draws is another
    number, and so is GIFT's with the raw entropy (beta_power 1)."""
    model = tiny_model(seed=3, std=0.2).eval()
    ids, answer_mask = batch(model.config)
    with torch.no_grad():
        gift = gift_loss(model, ids, answer_mask, model.config.mask_token_id, generators(len(ids)))
        raw = gift_loss(model, ids, answer_mask, model.config.mask_token_id, generators(len(ids)), beta_power=1.0)
    sft = one_step(model, [(ids, answer_mask, generators(len(ids)))], "sft")["loss"]
    assert abs(gift.item() - sft) > 1e-3 and abs(gift.item() - raw.item()) > 1e-4
