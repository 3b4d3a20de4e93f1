"""GIFT on Dream-v0, the paper's second architecture: Part I unchanged on the hidden states that predict each token
(Dream's at position i - 1 predict token i), equal to dllm's Dream SFT loss on its own batch and draws; the betas
from the shifted logits; gift.py's LoRA and full runs on a tiny Dream, exported in Dream's own names, resumed bit for
bit, and two processes equal to one."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from conftest import GOLDEN, REPO, latest, metrics, train_args
from safetensors.torch import load_file
from test_resume import assert_same_weights, computed, preempt, wait_for_records
from test_train import torchrun

import gift
from embedded import make_char_tokenizer, tiny_config_for
from model import LLaDA

DREAM = GOLDEN / "dream"


def shifted(x):
    """Dream's generation code on its logits: position i gets position i - 1's, position 0 keeps its own."""
    return torch.cat([x[:, :1], x[:, :-1]], dim=1)


@pytest.fixture(scope="module")
def dream_base(base, tmp_path_factory):
    """A tiny Dream folder (config.json in Dream's names, Qwen's key names, a ChatML char tokenizer) and the 12-row
    JSONL of the LLaDA base; non-zero q/k/v biases and std 0.2 weights, so that the betas differ token to token."""
    root = tmp_path_factory.mktemp("dream")
    tokenizer = make_char_tokenizer(family="dream")
    config = tiny_config_for(tokenizer, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=64)
    g = torch.Generator().manual_seed(0)
    model = LLaDA(config).init_weights(g, std=0.2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2, generator=g)
    model.save_pretrained(root / "model")
    tokenizer.save(str(root / "model" / "tokenizer.json"))
    shutil.copy2(base / "data.jsonl", root / "data.jsonl")
    return root


# -----------------------------------------------------------------------------
# Part I on Dream: the shift is where the model runs


@pytest.mark.numerics
def test_part_one_on_shifted_hidden_states_equals_dllms_dream_loss():
    """dllm's Dream SFT loss (tests/golden/README.md: right-shifted logits, weights 1/(t + 1e-6) or CART, the sum
    over masked answer tokens, padded EOS included, divided by the batch's non-prompt tokens), on dllm's own batch,
    mask and model call (the 2-D attention mask), equals Part I's diffusion_loss on the shifted hidden states given
    dllm's weights and denominator; and Part I's cart_weights are dllm's CART weights."""
    g = load_file(DREAM / "golden.safetensors")
    model = LLaDA.from_pretrained(DREAM / "tiny_dream_gqa", dtype=torch.float32).eval()
    ids, noisy, answer = g["gqa.sft.input_ids"], g["gqa.sft.noised_input_ids"], g["gqa.sft.maskable"].bool()
    mask_id = model.config.mask_token_id
    assert torch.equal((noisy == mask_id) & answer, g["gqa.sft.masked"].bool())  # the same mask
    with torch.no_grad():
        hidden = shifted(model(noisy, attention_mask=g["gqa.sft.attention_mask"], return_hidden=True))  # (B, L, D)
        n_answer = answer.sum()  # dllm's denominator: every non-prompt token of the batch
        weight = g["gqa.sft.weights_scheduler"][:, None].expand_as(noisy)  # (B,) -> (B, L)
        loss = gift.diffusion_loss(hidden, model.head, ids, noisy, weight, answer, mask_id, "masked", n_answer)
        torch.testing.assert_close(loss.double(), g["gqa.sft.loss_scheduler_f64"][0], rtol=2e-6, atol=0)
        cart = gift.cart_weights(noisy != mask_id)  # Dream's context-adaptive weights, p = 0.3
        masked = g["gqa.sft.masked"].bool()
        torch.testing.assert_close(cart[masked], g["gqa.sft.weights_cart"][masked], rtol=1e-6, atol=1e-7)
        loss = gift.diffusion_loss(hidden, model.head, ids, noisy, cart, answer, mask_id, "masked", n_answer)
        torch.testing.assert_close(loss.double(), g["gqa.sft.loss_cart_f64"][0], rtol=2e-6, atol=0)
        unshifted = model(noisy, attention_mask=g["gqa.sft.attention_mask"], return_hidden=True)
        wrong = gift.diffusion_loss(unshifted, model.head, ids, noisy, weight, answer, mask_id, "masked", n_answer)
        assert abs(float(wrong) - float(loss)) > 1e-3 * float(loss)  # the shift matters here


@pytest.mark.numerics
def test_the_hidden_state_at_i_is_the_one_that_predicts_token_i():
    """gift.predicting_hidden: the head on it equals the official logits moved one right (Dream), and equals the
    plain logits for LLaDA; the first answer token is read from the last prompt position."""
    dream = LLaDA.from_pretrained(DREAM / "tiny_dream_tied", dtype=torch.float32).eval()
    ids = load_file(DREAM / "golden.safetensors")["tied.plain.input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(dream.head(gift.predicting_hidden(dream, ids)), shifted(dream(ids)),
                                   rtol=0, atol=1e-6)
    llada = LLaDA(tiny_config_for(make_char_tokenizer(), d_model=32, n_heads=4, n_kv_heads=4)).init_weights(
        torch.Generator().manual_seed(1))
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(llada.head(gift.predicting_hidden(llada, ids)), llada(ids))


@pytest.mark.numerics
def test_dream_betas_come_from_the_shifted_logits():
    """Algorithm 1 on Dream: beta_i = sqrt(H) of the softmax that predicts token i, i.e. of the official logits at
    i - 1 on the fully masked answer; the unshifted entropies differ (dropping the shift fails this test)."""
    model = LLaDA.from_pretrained(DREAM / "tiny_dream_gqa", dtype=torch.float32)
    g = load_file(DREAM / "golden.safetensors")
    ids = g["gqa.plain.input_ids"]
    answer = torch.arange(ids.shape[1])[None] >= torch.tensor([[5], [7]])  # (B, L) prompts of 5 and 7 tokens
    mask_id = model.config.mask_token_id
    betas = gift.first_pass_betas(model, "entropy", ids, answer, mask_id)
    with torch.no_grad():
        logits = model(ids.masked_fill(answer, mask_id)).double()  # (B, L, V), the official alignment

    def sqrt_entropy(z):
        logp = z.log_softmax(-1)
        return torch.where(answer, (-(logp.exp() * logp).sum(-1)).sqrt(), 0.0)
    torch.testing.assert_close(betas.double(), sqrt_entropy(shifted(logits)), rtol=1e-5, atol=1e-6)
    assert (betas.double() - sqrt_entropy(logits)).abs().max() > 1e-3


# -----------------------------------------------------------------------------
# gift.py on a tiny Dream

RUN = ("--epochs", "3", "--lora-dropout", "0.1", "--log-every", "2", "--loss", "gift")


BF16 = pytest.mark.bf16  # left out of the forced-kernel reruns (conftest.py)


@pytest.mark.parametrize("mode,dtype", [("full", "float32"), ("lora", "float32"),
                                        pytest.param("full", "bfloat16", marks=BF16),
                                        pytest.param("lora", "bfloat16", marks=BF16)])
def test_dream_runs_resume_bit_for_bit_and_export_in_dreams_names(dream_base, tmp_path, monkeypatch, mode, dtype):
    """LoRA (a PEFT adapter on Dream's module names) and full fine-tuning (a Dream Hugging Face folder): stopped by
    SIGTERM at step 2 and at the epoch boundary, resumed, the same weights bit for bit and the same metrics."""
    extra = RUN + ("--dtype", dtype) + (("--lora",) if mode == "lora" else ())
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    args = lambda out, *more: train_args(dream_base, out, *extra, *more)  # noqa: E731
    gift.main(args(straight))
    preempt(monkeypatch, args(cut), calls=2)
    preempt(monkeypatch, args(cut, "--resume"), calls=1)
    gift.main(args(cut, "--resume"))
    name = "adapter/adapter_model.safetensors" if mode == "lora" else "model/model.safetensors"
    a, b = load_file(latest(straight) / name), load_file(latest(cut) / name)
    assert_same_weights(a, b)
    assert computed(metrics(straight)) == computed(metrics(cut))
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in metrics(straight))
    if mode == "lora":
        assert all(k.startswith("base_model.model.model.layers.") and ".self_attn." in k for k in a)
    else:
        assert "model.layers.0.self_attn.q_proj.bias" in a and "lm_head.weight" in a
        config = json.loads((latest(straight) / "model" / "config.json").read_text())
        assert config["model_type"] == "Dream" and "hidden_size" in config
        assert LLaDA.from_pretrained(latest(straight) / "model").predicts_shifted


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_dream_two_processes_equal_one(dream_base, tmp_path, mode):
    """DDP (LoRA) and FSDP2 (full) over 2 gloo processes compute the one-process run on a Dream model."""
    extra = ["--loss", "gift", "--max-steps", "3"] + (["--lora"] if mode == "lora" else [])
    one, two = tmp_path / "one", tmp_path / "two"
    torchrun(1, train_args(dream_base, one, *extra, batch_size=2), tmp_path)
    torchrun(2, train_args(dream_base, two, *extra, batch_size=1), tmp_path)
    name = "adapter/adapter_model.safetensors" if mode == "lora" else "model/model.safetensors"
    wa, wb = load_file(latest(one) / name), load_file(latest(two) / name)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)
    for ra, rb in zip(metrics(one), metrics(two)):
        for key in ("loss", "grad_norm", "masked_fraction", "beta_mean", "beta_std"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-4), key


def test_dream_two_processes_sigterm_then_resume_equal_an_unstopped_run(dream_base, tmp_path):
    """Full fine-tuning of Dream under FSDP2 over 2 processes, in bf16: SIGTERM to torchrun after a few steps; the
    resumed run equals an unstopped one bit for bit (weights and metrics)."""
    extra = ("--loss", "gift", "--dtype", "bfloat16", "--schedule", "constant", "--warmup-steps", "0", "--epochs",
             "1000", "--save-every", "1000")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "gift.py")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    stopped = tmp_path / "stopped"
    proc = subprocess.Popen(cmd + train_args(dream_base, stopped, *extra, batch_size=1), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_records(stopped, 2, proc)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert "preempted by SIGTERM" in output, output[-3000:]
    steps = str(int(latest(stopped).name.split("-")[1]) + 2)
    for out, flags in ((stopped, ("--resume",)), (tmp_path / "straight", ())):
        result = subprocess.run(cmd + train_args(dream_base, out, *extra, "--max-steps", steps, *flags, batch_size=1),
                                env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    name = "model/model.safetensors"
    assert_same_weights(load_file(latest(tmp_path / "straight") / name), load_file(latest(stopped) / name))
    assert computed(metrics(tmp_path / "straight"), ["total_steps"]) == computed(metrics(stopped), ["total_steps"])
