"""gift.py's Part I run on this repo's LLaDA the way train_step runs it: the model's final hidden states and its
head, the mask id from its config unless given. A shorthand for the tests; Part I itself never sees a model."""

import torch

import gift
from gift import BETA_POWER, CE_CHUNK, EPS


def _mask_id(model, mask_id):
    return model.config.mask_token_id if mask_id is None else mask_id


def model_entropy_and_nll(model, input_ids, answer_mask, chunk_size=CE_CHUNK, mask_id=None):
    """Algorithm 1 on `model` in eval mode (its mode restored): H, nll (B, L) float32."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            hidden = model(gift.mask_answer(input_ids, answer_mask, _mask_id(model, mask_id)), return_hidden=True)
        return gift.answer_entropy_and_nll(hidden, model.head, input_ids, answer_mask, chunk_size)
    finally:
        model.train(was_training)


def model_betas(model, input_ids, answer_mask, power=BETA_POWER, chunk_size=CE_CHUNK, mask_id=None):
    """beta_i = H_i^power of `model` (Algorithm 1)."""
    H, _ = model_entropy_and_nll(model, input_ids, answer_mask, chunk_size, mask_id)
    return gift.entropy_betas(H, answer_mask, power)


def model_objective(loss_name, model, input_ids, answer_mask, generator, eps=EPS, ref_betas=None, norm=None,
                    mask_id=None):
    """train_step's pass 1 for one micro-batch: the betas (first_pass_betas, unless ref_betas), then
    objective_batch. Returns noisy_ids, weight, norm."""
    mask_id, beta = _mask_id(model, mask_id), ref_betas
    betas_from = gift.OBJECTIVES[loss_name][1]
    if beta is None and betas_from is not None:
        beta = gift.first_pass_betas(model, betas_from, input_ids, answer_mask, mask_id)
    noisy, weight = gift.objective_batch(loss_name, input_ids, answer_mask, generator, mask_id, beta, eps)
    return noisy, weight, norm or gift.DEFAULT_NORM[loss_name]


def model_loss(model, input_ids, noisy_ids, weight, answer_mask, norm="answer", denominator=None,
               chunk_size=CE_CHUNK, mask_id=None):
    """train_step's pass 2 for one micro-batch: the model on noisy_ids, then diffusion_loss."""
    hidden = model(noisy_ids, return_hidden=True)  # (B, L, D)
    return gift.diffusion_loss(hidden, model.head, input_ids, noisy_ids, weight, answer_mask,
                               _mask_id(model, mask_id), norm, denominator, chunk_size)
