"""ML-GSAI/LLaDA's generate.py (github.com/ML-GSAI/LLaDA), transcribed line for line: the oracle that
tests/test_sample.py checks sample.generate against, and the reference bench/sampler.py times."""

import numpy as np
import torch
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# The reference: the official generate.py, line for line. Changed, marked "# changed": the random draws take a
# generator; CFG without an attention mask passes None (the official code raises a NameError there); the model
# returns logits itself instead of an output object with .logits; tensors go to the prompt's device; the hard-coded
# EOS 126081 and EoT 126348 of logits_eos_inf / confidence_eos_eot_inf are the arguments eos_id / eot_id.


def official_add_gumbel_noise(logits, temperature, generator=None):
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    noise = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)  # changed
    gumbel_noise = (- torch.log(noise)) ** temperature
    return logits.exp() / gumbel_noise


def official_get_num_transfer_tokens(mask_index, steps):
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base = mask_num // steps
    remainder = mask_num % steps
    num_transfer_tokens = torch.zeros(mask_num.size(0), steps, device=mask_index.device, dtype=torch.int64) + base
    for i in range(mask_num.size(0)):
        num_transfer_tokens[i, :remainder[i]] += 1
    return num_transfer_tokens


@torch.no_grad()
def official_generate(model, prompt, attention_mask=None, steps=128, gen_length=128, block_length=128,
                      temperature=0., cfg_scale=0., remasking='low_confidence', mask_id=126336, logits_eos_inf=False,
                      confidence_eos_eot_inf=False, generator=None, eos_id=126081, eot_id=126348):  # changed
    device = prompt.device  # changed: model.device
    x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long).to(device)
    x[:, :prompt.shape[1]] = prompt.clone()
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, torch.ones((prompt.shape[0], gen_length),
                                                               dtype=attention_mask.dtype, device=device)], dim=-1)
    prompt_index = (x != mask_id)
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps = steps // num_blocks
    for num_block in range(num_blocks):
        block_mask_index = (x[:, prompt.shape[1] + num_block * block_length:
                              prompt.shape[1] + (num_block + 1) * block_length:] == mask_id)
        num_transfer_tokens = official_get_num_transfer_tokens(block_mask_index, steps)
        for i in range(steps):
            mask_index = (x == mask_id)
            if cfg_scale > 0.:
                un_x = x.clone()
                un_x[prompt_index] = mask_id
                x_ = torch.cat([x, un_x], dim=0)
                attention_mask_ = None  # changed
                if attention_mask is not None:
                    attention_mask_ = torch.cat([attention_mask, attention_mask], dim=0)
                logits = model(x_, attention_mask=attention_mask_)  # changed: no .logits
                logits, un_logits = torch.chunk(logits, 2, dim=0)
                logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
            else:
                logits = model(x, attention_mask=attention_mask)  # changed: no .logits
            if logits_eos_inf:
                logits[:, :, eos_id] = -torch.inf  # changed: 126081
            logits_with_noise = official_add_gumbel_noise(logits, temperature=temperature, generator=generator)
            x0 = torch.argmax(logits_with_noise, dim=-1)  # b, l
            if confidence_eos_eot_inf:
                logits_with_noise[:, :, eos_id] = logits[:, :, eot_id] = -torch.inf  # changed: 126081, 126348
            if remasking == 'low_confidence':
                p = F.softmax(logits, dim=-1)
                x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)  # b, l
            elif remasking == 'random':
                x0_p = torch.rand((x0.shape[0], x0.shape[1]), device=x0.device, generator=generator)  # changed
            else:
                raise NotImplementedError(remasking)
            x0_p[:, prompt.shape[1] + (num_block + 1) * block_length:] = -np.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -np.inf)
            transfer_index = torch.zeros_like(x0, dtype=torch.bool, device=x0.device)
            for j in range(confidence.shape[0]):
                _, select_index = torch.topk(confidence[j], k=num_transfer_tokens[j, i])
                transfer_index[j, select_index] = True
            x[transfer_index] = x0[transfer_index]
    return x
