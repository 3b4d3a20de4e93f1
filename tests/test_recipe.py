"""docs/gift_in_your_trainer.md's recipe (GIFT in a Hugging Face Trainer's compute_loss) cannot go stale: its ```python
block, executed as printed (no transformers needed), computes gift_loss's and train_step's number on the same draws,
within float32 rounding (conftest.py's rule), on a tiny LoRA LLaDA left in train mode with dropout 0.05, from
Hugging Face-style inputs (labels: input_ids with -100 on the prompt); alone and in a process group of one."""

import re

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, float32_atol, model_depth
from test_gift_loss import batch, lora_model

from gift import MicroBatch, gift_loss, train_step

pytestmark = pytest.mark.numerics  # float32 through two code paths (conftest.py)
DOC = REPO / "docs" / "gift_in_your_trainer.md"


def recipe():
    """The doc's one ```python block, executed: its compute_loss(model, inputs, mask_id)."""
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M)
    assert len(blocks) == 1, f"{DOC}: {len(blocks)} python blocks, expected one"
    namespace = {}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)
    return namespace["compute_loss"]


@pytest.mark.parametrize("process_group", [False, True])
def test_recipe_is_gift_loss_and_train_steps_loss(process_group):
    compute_loss = recipe()
    model = lora_model(seed=5)
    config, mask_id = model.config, model.config.mask_token_id
    ids, answer_mask = batch(config, seed=3)
    inputs = dict(input_ids=ids, labels=ids.masked_fill(~answer_mask, -100))  # Hugging Face style
    if process_group:  # the DDP branch (all_reduce of N, times the world size) in a world of one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(300)  # t, u and the second pass's dropout, all from torch's global generator, in this order
        loss = compute_loss(model, inputs, mask_id)
        assert model.training
        torch.manual_seed(300)
        plain = gift_loss(model, ids, answer_mask, mask_id)
        torch.manual_seed(300)
        result = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [MicroBatch(ids, answer_mask, None)],
                            "gift")
    finally:
        if process_group:
            dist.destroy_process_group()
    expected = torch.tensor(result["loss"])
    atol = float32_atol(expected, model_depth(config))
    assert result["n_masked"] > 0 and loss.requires_grad
    torch.testing.assert_close(loss.detach(), expected, rtol=0, atol=atol)
    torch.testing.assert_close(plain.detach(), expected, rtol=0, atol=atol)
    torch.manual_seed(301)  # the check can fail: other draws give another number
    assert abs(compute_loss(model, inputs, mask_id).item() - expected.item()) > 100 * atol
