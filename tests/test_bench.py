"""bench/: every script runs in its smoke mode (tiny shapes, one repetition), and the pieces the figures
rest on are checked: the naive loss and entropy pass of bench/memory.py compute what gift.py computes (so the
memory comparison is like for like), and the FLOP counters count what the code does. The chunked loss against the
plain one is tests/test_losses.py::test_chunked_cross_entropy_equals_full_logits_value_and_gradient; the cached
GIFT* betas against fresh ones is tests/test_train.py::test_gift_star_betas_cached_from_the_initial_model."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from conftest import REPO, tiny_model as tiny_llada

from gift import first_pass_betas
from on_model import model_loss, model_objective
from sample import generate

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread


def bench_module(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smoke_in_process(name, capsys):
    """What `python bench/<name>.py --smoke` prints, its main run in this process: the smoke tests need no fresh
    one (bench/memory.py measures each variant in a fresh worker process of its own all the same)."""
    bench_module(name).main(["--smoke"])
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def train_step_run():
    """`python bench/train_step.py --smoke`, started at the first smoke test (test_memory_smoke, whose workers it
    overlaps) and awaited by test_train_step_smoke: a subprocess, so that it runs beside this process."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "train_step.py"), "--smoke"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()


def finished(proc):
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return out


def positive(*values):
    return all(math.isfinite(v) and v > 0 for v in values)


def train_step_rows(out):
    """bench/train_step.py's table: {(mode, loss): its figures}; "-" (not measured) becomes None."""
    rows = {}
    for line in out.splitlines():
        f = line.split()  # mode loss ms/step min-max wall x-SFT min-max FLOP-x masked GFLOP/s peak-MB +step-MB
        if len(f) == 12 and f[0] in ("lora", "full"):
            (ms_min, ms_max), (r_min, r_max) = f[3].split("-"), f[6].split("-")
            number = [None if x == "-" else float(x) for x in (f[2], ms_min, ms_max, f[4], f[5], r_min, r_max, *f[7:])]
            rows[f[0], f[1]] = dict(zip(("ms", "ms_min", "ms_max", "wall_ms", "ratio", "ratio_min", "ratio_max",
                                         "flop_ratio", "masked", "gflops", "peak_mb", "step_mb"), number))
    return rows


def test_memory_smoke(train_step_run, monkeypatch, capsys):
    """Both variants measured, the ratios those of the printed figures (up to their rounding to whole MB), and the
    target line repeating them with the right verdicts."""
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")  # for its worker processes
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = smoke_in_process("memory", capsys)
    batch, seq, vocab = (int(re.search(rf"{k} (\d+)", out).group(1)) for k in ("batch", "seq", "vocab"))
    logits_mb = float(re.search(r"float32 logits tensor = (\S+) MB", out).group(1))
    assert abs(logits_mb - batch * seq * vocab * 4 / 2**20) <= 0.5
    rows = {f[0]: [float(x) for x in f[1:]] for f in map(str.split, out.splitlines())
            if f and f[0] in ("gift-ours", "gift-naive")}
    (peak, step, ratio, step_ratio), (naive_peak, naive_step) = rows["gift-ours"], rows["gift-naive"]
    for p, s in ((peak, step), (naive_peak, naive_step)):
        assert positive(p) and 0 <= s <= p, out
    for ours, naive, printed in ((peak, naive_peak, ratio), (step, naive_step, step_ratio)):
        # MB printed as integers, ratios to 3 decimals: within those roundings (and a float's margin)
        assert (ours - 0.5) / (naive + 0.5) - 0.0006 <= printed <= (ours + 0.5) / max(naive - 0.5, 1e-9) + 0.0006, out
    whole, v1, own, v2 = re.search(r"gift-ours: whole process (\S+) \((yes|NO)\), the step's own memory (\S+) "
                                   r"\((yes|NO)\)", out).groups()
    assert (float(whole), float(own)) == (ratio, step_ratio)
    assert (v1, v2) == tuple("yes" if x <= 0.25 else "NO" for x in (ratio, step_ratio))


def test_train_step_smoke(train_step_run):
    """Every variant has a row of sane figures: times within their min-max, SFT's ratios exactly 1, GIFT's predicted
    FLOP ratio above 1 (the entropy pass) and below 2, gift-elbo masking and costing what gift does, the measured
    memory consistent, and each target line repeating the table's figures with the right verdict."""
    out = finished(train_step_run)
    rows = train_step_rows(out)
    assert set(rows) == {(m, loss) for m in ("lora", "full")
                         for loss in ("sft", "gift", "gift-elbo", "gift-star", "gift-reuse")}
    seq, prompt, batch = map(int, re.search(r"seq (\d+) \(prompt (\d+)\), batch (\d+)", out).groups())
    for (mode, loss), r in rows.items():
        assert positive(r["ms"], r["wall_ms"], r["ratio"], r["flop_ratio"], r["gflops"]), (mode, loss, r)
        # min-max printed as integers / to 2 decimals: within half a unit of that rounding (and a float's margin)
        assert r["ms_min"] - 0.51 <= r["ms"] <= r["ms_max"] + 0.51, (mode, loss, r)
        assert r["ratio_min"] - 0.0051 <= r["ratio"] <= r["ratio_max"] + 0.0051, (mode, loss, r)
        assert 1 <= r["masked"] <= batch * (seq - prompt), (mode, loss, r)
        if loss == "sft":
            assert r["ratio"] == r["ratio_min"] == r["ratio_max"] == r["flop_ratio"] == 1.0, (mode, r)
        elif loss in ("gift-star", "gift-reuse"):  # no entropy pass: SFT's FLOPs up to the masked count
            assert 0.9 < r["flop_ratio"] < 1.1, (mode, r)
        else:  # one extra forward pass costs less than a training step
            assert 1.1 < r["flop_ratio"] < 2, (mode, loss, r)
        if r["peak_mb"] is not None:
            assert positive(r["peak_mb"]) and 0 <= r["step_mb"] <= r["peak_mb"], (mode, loss, r)
    assert any(r["peak_mb"] is not None for r in rows.values())  # --smoke measures the first variant's memory
    for mode in ("lora", "full"):  # gift-elbo masks exactly as gift: the same count, the same predicted FLOPs
        gift, elbo = rows[mode, "gift"], rows[mode, "gift-elbo"]
        assert (elbo["masked"], elbo["flop_ratio"]) == (gift["masked"], gift["flop_ratio"]), mode
    targets = re.findall(r"\n  (\w+) (\S+?) *: measured (\S+) <= (?:predicted (\S+) \+ 0\.10|(1\.05)): (yes|NO)", out)
    assert len(targets) == 6, out
    for mode, loss, measured, predicted, bound, verdict in targets:
        r = rows[mode, loss]
        limit = float(bound) if bound else float(predicted) + 0.10
        assert float(measured) == r["ratio"] and (bound or float(predicted) == r["flop_ratio"]), (mode, loss, out)
        if abs(float(measured) - limit) > 0.0011:  # the printed figures are rounded: no verdict at the boundary
            assert verdict == ("yes" if float(measured) <= limit else "NO"), (mode, loss, measured, limit, verdict)
    reuse = re.findall(r"\n  (\w+) gift --beta-refresh-epochs 4: \(gift \+ 3 x gift-reuse\) / 4 = (\S+) x SFT "
                       r"<= 1\.10: (yes|NO) \(K = 1: (\S+), K = infinity: (\S+)\)", out)
    assert len(reuse) == 2, out
    for mode, k4, verdict, k1, kinf in reuse:  # the K = 4 average from the table's own ratios
        gift, cached = rows[mode, "gift"]["ratio"], rows[mode, "gift-reuse"]["ratio"]
        assert (float(k1), float(kinf)) == (gift, cached)
        assert abs(float(k4) - (gift + 3 * cached) / 4) <= 0.0011  # three figures rounded to 3 decimals
        if abs(float(k4) - 1.10) > 0.0006:
            assert verdict == ("yes" if float(k4) <= 1.10 else "NO")


def test_sampler_smoke(capsys):
    """The exact sampler's table (tokens asserted identical by the script itself): speed-up = ours / reference
    tokens/s within its min-max; the fast sampler's table: every mode once per shape, exact at 1.00 with agreement
    1, every figure in range, and the target line repeating the best body-heavy speed-up."""
    out = smoke_in_process("sampler", capsys)
    assert "projection for LLaDA-8B" in out
    exact = {f[0]: [float(x) for x in f[4:7]] + [float(x) for x in f[7].split("-")]
             for f in map(str.split, out.splitlines()) if len(f) == 9 and f[0] in ("head-heavy", "body-heavy")}
    assert set(exact) == {"head-heavy", "body-heavy"}
    for ref_tps, ours_tps, speedup, low, high in exact.values():  # one repeat: the ratio of the two rates
        assert positive(ref_tps, ours_tps) and low <= speedup <= high
        assert abs(speedup - ours_tps / ref_tps) <= 0.01 * speedup + 0.01
    fast = [line.split() for line in out.splitlines() if line.startswith("body-heavy ") and len(line.split()) == 7]
    modes = [f[3] for f in fast]
    assert modes == [m for m, *_ in bench_module("sampler").FAST_MODES]
    assert modes[:3] == ["exact", "prefix", "dual"] and "dual+refresh4" in modes and "dual+threshold" in modes
    for f in fast:
        tps, speedup, agreement = map(float, f[4:])
        assert positive(tps, speedup) and 0 <= agreement <= 1
        if f[3] == "exact":
            assert speedup == 1.0 and agreement == 1.0
    best = max(float(f[5]) for f in fast)
    assert f"at the body-heavy shape: {best:.2f}" in out


# -----------------------------------------------------------------------------
# What the figures rest on


def tiny_model(seed=0, V=64):
    """std 0.2: entropies (GIFT's betas) that differ from token to token."""
    return tiny_llada(seed, std=0.2, vocab=V, mlp_hidden_size=48)


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
    noisy, weight, norm = model_objective(loss_name, model, ids, answer_mask, torch.Generator().manual_seed(2))
    ours = model_loss(model, ids, noisy, weight, answer_mask, norm, chunk_size=5)
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
                               first_pass_betas(model, "entropy", ids, answer_mask, model.config.mask_token_id,
                                                chunk_size=7))
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


def test_early_exit_smoke(tmp_path, capsys):
    """bench/early_exit.py --smoke: every setting with and without the early exit, the same graded text."""
    rows = bench_module("early_exit").main(["--smoke", "--out-dir", str(tmp_path)])
    assert len(rows) == 10 and all(r["same_text"] for r in rows[1::2])
    assert (tmp_path / "early_exit-smoke.md").is_file() and "x exact" in capsys.readouterr().out


def test_rl_step_smoke(tmp_path, capsys):
    """bench/rl_step.py --smoke: a rollout batch with and without the early exit and the updates it serves, split
    into their parts; the exit skips tokens and the parts add up to the whole."""
    seconds = bench_module("rl_step").main(["--smoke", "--out-dir", str(tmp_path)])
    parts = [seconds[k] for k in ("rollout, every block", "likelihood pass", "backward", "optimizer step")]
    assert abs(sum(parts) - seconds["whole, every block"]) < 1e-9 and all(s >= 0 for s in parts)
    record = json.loads((tmp_path / "rl_step-smoke.json").read_text())
    assert record["tokens"]["generated"] == 2 * 2 * 64 and record["tokens"]["skipped"] >= 0
    assert "x whole step" in capsys.readouterr().out
