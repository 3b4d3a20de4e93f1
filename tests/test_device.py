"""The model, the GIFT loss and the sampler on a device against a float64 CPU reference: `pytest tests/test_device.py
--device cuda` on a GPU (bench/gpu.py runs it there), the CPU by default. The reference is float64 on the CPU, so the
checks are not trivial on the CPU either: they bound float32's rounding (and bf16's) against exact-ish arithmetic."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from conftest import tiny_model

import gift
from gift import DEFAULT_NORM, diffusion_loss, first_pass_betas, objective_batch, wrap_model
from model import rope_cos_sin
from sample import generate


def on(model, device, dtype):
    return copy.deepcopy(model).to(device=device, dtype=dtype)


def batch(vocab, B=3, L=24, seed=0):
    """Random ids without mask / EOS, the first half of each row the prompt, and a padding mask with row 0 left-
    padded by 5 (so the attention mask reaches the kernels)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 2, (B, L), generator=g)
    answer_mask = torch.arange(L)[None].expand(B, -1) >= L // 2  # (B, L)
    attention_mask = torch.ones(B, L, dtype=torch.long)
    attention_mask[0, :5] = 0
    return ids, answer_mask, attention_mask


def rel_err(x, ref):
    return float((x.double().cpu() - ref).norm() / ref.norm())


def test_forward_float32_on_device_matches_float64_cpu(device):
    model = tiny_model(seed=1, std=0.2, n_kv_heads=2)
    ids, _, attention_mask = batch(model.config.vocab_size)
    ref = on(model, "cpu", torch.float64)(ids, attention_mask=attention_mask)  # (B, L, V)
    with torch.no_grad():
        out = on(model, device, torch.float32)(ids.to(device), attention_mask=attention_mask.to(device))
    assert out.device.type == device.type and out.dtype == torch.float32
    assert rel_err(out, ref.detach()) < 1e-5


def test_forward_bf16_on_device_is_finite_and_close(device):
    """bf16 weights under autocast, as gift.py trains a LoRA base on a GPU: finite, and within bf16's rounding."""
    model = tiny_model(seed=2, std=0.2)
    ids, _, attention_mask = batch(model.config.vocab_size, seed=1)
    ref = on(model, "cpu", torch.float64)(ids, attention_mask=attention_mask).detach()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        out = on(model, device, torch.bfloat16)(ids.to(device), attention_mask=attention_mask.to(device))
    assert torch.isfinite(out).all()
    assert 1e-4 < rel_err(out, ref) < 5e-2  # really bf16 (not float32 in disguise), and no worse than bf16


def test_lora_model_on_device_has_the_cpu_adapters(device):
    """gift.wrap_model's LoRA on the device draws the adapters' A from the same CPU generator as on the CPU (a CPU
    generator cannot fill a GPU tensor directly), and with B made nonzero the forward matches the float64 CPU's."""
    model = tiny_model(seed=5, std=0.2)
    lora = dict(r=4, alpha=8, dropout=0.0, targets=("q_proj", "k_proj", "v_proj"))
    ref = wrap_model(copy.deepcopy(model), torch.device("cpu"), torch.float64, 1, lora, seed=7)
    dev = wrap_model(copy.deepcopy(model), device, torch.float32, 1, lora, seed=7)
    g = torch.Generator().manual_seed(8)
    for (name, p), q in zip(ref.named_parameters(), dev.parameters()):
        if name.endswith("lora_A"):
            assert q.device.type == device.type and torch.equal(q.cpu(), p)
        if name.endswith("lora_B"):
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g))
                q.copy_(p)
    ids, _, attention_mask = batch(model.config.vocab_size, seed=3)
    with torch.no_grad():
        out = dev(ids.to(device), attention_mask=attention_mask.to(device))
        assert rel_err(out, ref(ids, attention_mask=attention_mask)) < 1e-5


def loss_of(model, ids, noisy, weight, answer_mask, norm):
    """gift.diffusion_loss of a model's hidden states on noisy (the second pass of Algorithm 2)."""
    mask_id = model.config.mask_token_id
    return diffusion_loss(model(noisy, return_hidden=True), model.head, ids, noisy, weight, answer_mask, mask_id, norm)


def test_gift_loss_and_gradient_on_device_match_float64_cpu(device):
    """The GIFT step's pieces on the device: the entropy pass's betas (Algorithm 1), then the weighted loss of
    Theorem 1 and its gradient, for the noise drawn once on the CPU (a device's generator draws other numbers)."""
    model = tiny_model(seed=3, std=0.2)
    ids, answer_mask, _ = batch(model.config.vocab_size, B=4, seed=2)
    mask_id, norm = model.config.mask_token_id, DEFAULT_NORM["gift"]
    ref_model = on(model, "cpu", torch.float64)
    ref_betas = first_pass_betas(ref_model, "entropy", ids, answer_mask, mask_id)
    noisy, weight = objective_batch("gift", ids, answer_mask, torch.Generator().manual_seed(3), mask_id, ref_betas)
    ref_loss = loss_of(ref_model, ids, noisy, weight, answer_mask, norm)
    ref_loss.backward()

    dev_model = on(model, device, torch.float32)
    betas = first_pass_betas(dev_model, "entropy", ids.to(device), answer_mask.to(device), mask_id)
    loss = loss_of(dev_model, ids.to(device), noisy.to(device), weight.to(device), answer_mask.to(device), norm)
    loss.backward()
    assert rel_err(betas, ref_betas) < 1e-5
    assert abs(loss.item() - ref_loss.item()) < 1e-5 * abs(ref_loss.item())
    for (name, p), q in zip(dev_model.named_parameters(), ref_model.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-4, name


@pytest.mark.parametrize("block_length", [8, 32])
def test_greedy_generate_on_device_gives_the_float64_cpu_tokens(device, block_length):
    """sample.generate, greedy (d1's setting), float32 on the device: the same tokens as float64 on the CPU (a flip
    needs two logits or confidences within float32's rounding of each other)."""
    model = tiny_model(seed=4, std=0.2)
    prompt = torch.randint(0, model.config.vocab_size - 2, (2, 7), generator=torch.Generator().manual_seed(4))
    kw = dict(steps=16, gen_length=32, block_length=block_length)
    ref = generate(on(model, "cpu", torch.float64).eval(), prompt, **kw)
    out = generate(on(model, device, torch.float32).eval(), prompt.to(device), **kw)
    assert (ref[:, 7:] != model.config.mask_token_id).all()  # every position decoded
    assert torch.equal(out.cpu(), ref)


def test_fsdp2_bf16_checkpointed_step_keeps_rope_float32(device, tmp_path, monkeypatch):
    """Full fine-tuning as the paper's recipe runs it: FSDP2 (a world of one) with bf16 mixed precision and activation
    checkpointing. FSDP2 casts a block's floating-point inputs to bf16; the RoPE tables must reach every block, in
    the forward and in checkpointing's recompute, as the float32 values (torch < 2.13 did not cast the recompute's
    inputs: backward stopped on a dtype mismatch). The loss is the float64 CPU model's within bf16 rounding."""
    model = tiny_model(seed=6, std=0.2)
    ids, answer_mask, _ = batch(model.config.vocab_size, B=2, seed=5)
    ref_model = on(model, "cpu", torch.float64)
    noisy, weight = objective_batch("sft", ids, answer_mask, torch.Generator().manual_seed(6),
                                    model.config.mask_token_id)
    ref_loss = loss_of(ref_model, ids, noisy, weight, answer_mask, DEFAULT_NORM["sft"]).item()
    cos = rope_cos_sin(ids.shape[1], model.config.head_dim, model.config.rope_theta, device)[0].cpu()  # float32

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp_path}/pg",
                            rank=0, world_size=1)
    try:
        # gift.wrap_model shards when world > 1; asking for 2 shards this world of one, one group per block as
        # for LLaDA-8B (this tiny model would otherwise be one group)
        monkeypatch.setattr(gift, "FSDP_ONE_GROUP_MAX_PARAMS", 0)
        fsdp = wrap_model(on(model, "cpu", torch.float32), device, torch.bfloat16, world=2,
                          activation_checkpointing=True).train()
        assert all(isinstance(block, FSDPModule) for block in fsdp.model.transformer.blocks)  # the patch took
        ropes = []
        for block in fsdp.model.transformer.blocks:
            block.register_forward_pre_hook(lambda module, args: ropes.append(args[1].real.cpu()))
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(fsdp, ids.to(device), noisy.to(device), weight.to(device), answer_mask.to(device),
                           DEFAULT_NORM["sft"])
        loss.backward()  # the recompute runs here
        grads_finite = all(torch.isfinite(p.grad.full_tensor()).all() for p in fsdp.parameters())
    finally:
        dist.destroy_process_group()
    assert len(ropes) == 2 * model.config.n_layers and grads_finite  # forward + recompute, every block
    assert all(r.dtype == torch.float32 for r in ropes) and all(torch.equal(r, cos) for r in ropes)
    assert abs(loss.item() - ref_loss) < 2e-2 * ref_loss
