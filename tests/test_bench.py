"""bench/: every script runs in its smoke mode (tiny shapes, one repetition), and the pieces the figures
rest on are checked: the naive loss and entropy pass of bench/memory.py compute what gift.py computes (so the
memory comparison is like for like), and the FLOP counters count what the code does. The chunked loss against the
plain one is tests/test_losses.py::test_chunked_cross_entropy_equals_full_logits_value_and_gradient; the cached
GIFT* betas against fresh ones is tests/test_train.py::test_gift_star_betas_cached_from_the_initial_model."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from conftest import REPO

from gift import diffusion_loss, entropy_betas, objective_batch
from model import LLaDA, LLaDAConfig
from sample import generate

SCRIPTS = ("train_step", "memory", "sampler")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a busy shared CPU spinning threads slow them 10x."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def bench_module(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke_runs():
    """The three smoke runs, started together (they are mostly interpreter start-up) and awaited by each test."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    procs = {name: subprocess.Popen([sys.executable, str(REPO / "bench" / f"{name}.py"), "--smoke"], cwd=REPO,
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in SCRIPTS}
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()


def finished(proc):
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return out


def test_train_step_smoke(smoke_runs):
    out = finished(smoke_runs["train_step"])
    for mode in ("lora", "full"):
        for loss in ("sft", "gift", "gift-elbo", "gift-star"):
            assert f"\n{mode:5} {loss:10} " in out
    assert "targets" in out


def test_memory_smoke(smoke_runs):
    out = finished(smoke_runs["memory"])
    assert "\ngift-ours " in out and "\ngift-naive " in out and "targets" in out


def test_sampler_smoke(smoke_runs):
    out = finished(smoke_runs["sampler"])  # the script itself asserts identical tokens
    assert "\nhead-heavy " in out and "\nbody-heavy " in out and "projection for LLaDA-8B" in out


# -----------------------------------------------------------------------------
# What the figures rest on


def tiny_model(seed=0, V=64):
    cfg = LLaDAConfig(d_model=32, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=48, vocab_size=V,
                      embedding_size=V, mask_token_id=V - 1, eos_token_id=V - 2, pad_token_id=V - 2)
    return LLaDA(cfg).init_weights(torch.Generator().manual_seed(seed), std=0.2)


def tiny_batch(seed=1, B=3, L=20, V=64):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 2, (B, L), generator=g)
    answer_mask = torch.arange(L)[None] >= torch.tensor([4, 10, 7])[:, None]
    return ids, answer_mask


@pytest.mark.parametrize("loss_name", ["sft", "gift"])
def test_naive_loss_equals_ours_value_and_gradient(loss_name):
    memory = bench_module("memory")
    model = tiny_model()
    ids, answer_mask = tiny_batch()
    noisy, weight, norm, _ = objective_batch(loss_name, model, ids, answer_mask, torch.Generator().manual_seed(2))
    ours = diffusion_loss(model, ids, noisy, weight, answer_mask, norm, chunk_size=5)
    g_ours = torch.autograd.grad(ours, list(model.parameters()))
    naive, _ = memory.naive_diffusion_loss(model, ids, noisy, weight, answer_mask, norm)
    g_naive = torch.autograd.grad(naive, list(model.parameters()))
    torch.testing.assert_close(naive, ours)
    for a, b in zip(g_naive, g_ours):
        torch.testing.assert_close(a, b)


def test_naive_entropy_equals_ours():
    memory = bench_module("memory")
    model = tiny_model(3).train()
    ids, answer_mask = tiny_batch(4)
    torch.testing.assert_close(memory.naive_entropy_betas(model, ids, answer_mask),
                               entropy_betas(model, ids, answer_mask, chunk_size=7))
    assert model.training


def test_matmul_params_count_the_block_linears():
    train_step = bench_module("train_step")
    model = tiny_model()
    linears = sum(m.weight.numel() for m in model.model.transformer.blocks.modules() if isinstance(m, nn.Linear))
    assert train_step.matmul_params(model.config) == linears


def test_sampler_flops_count_the_head_rows_generate_computes():
    sampler = bench_module("sampler")
    model = tiny_model(5).eval()
    rows = []
    head = model.model.transformer.ff_out

    class CountingHead(nn.Module):  # records how many positions the LM head runs on
        def forward(self, h):
            rows.append(h.reshape(-1, h.shape[-1]).shape[0])
            return head(h)

    model.model.transformer.ff_out = CountingHead()
    B, P, G, blk, steps = 2, 5, 24, 8, 9  # 3 tokens per step per block: uneven shrinkage is counted too
    prompt = torch.randint(0, 62, (B, P), generator=torch.Generator().manual_seed(6))
    generate(model, prompt, steps=steps, gen_length=G, block_length=blk)
    shapes = dict(vocab=64, d_model=32, n_layers=2, mlp=48)
    ref, ours = sampler.sampler_flops(shapes, B, P, G, blk, steps)
    no_head = dict(shapes, vocab=0)
    ref0, ours0 = sampler.sampler_flops(no_head, B, P, G, blk, steps)
    assert ref0 == ours0  # without a head both do the same work
    assert (ours - ours0) == 2 * 64 * 32 * sum(rows)  # ours: the head on exactly the rows generate() computes
    assert (ref - ref0) == 2 * 64 * 32 * steps * B * (P + G)  # the reference: every position, every step
