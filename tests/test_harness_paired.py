"""harness.py's likelihood draws beyond one request: paired draws (model_arg paired, harness.py --paired-draws: the
choices of a question share their l and masks) keep each choice's estimate unbiased and cut the noise of a difference;
the draws of several requests share forward passes with the numbers of one row per pass (float64). Skipped without
lm-eval (pip install -r requirements-extras.txt)."""

import importlib.util
import math

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is optional: pip install -r requirements-extras.txt")

from conftest import REPO  # noqa: E402
from test_harness import TASKS, elbo_draws, exact_elbo, requests_of  # noqa: E402  (it sets the offline variables)
from test_harness_checks import at_repo_root, folders  # noqa: E402, F401  (the fixtures: the repo root, tiny folders)

import data  # noqa: E402
import harness as H  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread



def paired_draws(model, tokenizer, context, continuations, n, seed=0, paired=True):
    """Each continuation's n draws, all from generators of one seed (paired: a question's choices, as GiftLM draws)."""
    return [elbo_draws(model, data.encode(tokenizer, context), data.encode(tokenizer, c), n, 256,
                       torch.Generator().manual_seed(seed), paired) for c in continuations]


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_paired_draws_keep_each_choice_unbiased(folders, family):
    """Paired draws of three choices, two of 3 tokens and one of 4: each mean within 4 standard errors of its exact ELBO
    (the enumeration over every mask set); the two of equal length share every l and mask; each l is uniform on 1..L
    and each mask uniform given l (the 6 sets of 2 of 4 positions equally often)."""
    _, model, tokenizer = folders[family]
    context, choices = "say hi", ("hi ", "ho ", "hey ")
    draws = paired_draws(model, tokenizer, context, choices, 2048)
    for choice, d in zip(choices, draws):
        exact = exact_elbo(model, data.encode(tokenizer, context), data.encode(tokenizer, choice))
        se = d.std().item() / math.sqrt(len(d))
        assert abs(d.mean().item() - exact) < 4 * se and se < 0.05 * abs(exact), (choice, d.mean().item(), exact, se)
    rows = [H.elbo_rows([1], [2] * L, 64, torch.Generator().manual_seed(3), paired=True) for L in (3, 3, 4)]
    assert all(torch.equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(*rows[:2]))  # equal lengths: the same draws
    g = torch.Generator().manual_seed(0)
    for L, b in ((3, 2), (5, 3), (4, 8)):
        counts = torch.stack([H.stratified_mask_counts(L, b, g, paired=True) for _ in range(600)])  # (600, b)
        freq = torch.stack([torch.bincount(counts[:, j], minlength=L + 1)[1:] / 600 for j in range(b)])  # (b, L)
        assert counts.min() >= 1 and (freq - 1 / L).abs().max() < 0.08, (L, b, freq)
    masks = H.continuation_masks(4, torch.full((3000,), 2), g, paired=True)  # (3000, 4)
    freq = torch.unique(masks, dim=0, return_counts=True)[1] / 3000
    assert len(freq) == 6 and (freq - 1 / 6).abs().max() < 0.03, freq


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_paired_draws_cut_the_variance_of_a_difference(folders, family):
    """The variance of a draw of A minus a draw of B, paired against LLaDA's unpaired draws (each its own generator):
    below a quarter for choices of equal length (one token apart), below a half for lengths 9 and 11 (a common
    prefix: the same fraction of each masked, through keys drawn per position)."""
    _, model, tokenizer = folders[family]
    for a, b, most in ((" hi there", " ho there", 0.25), (" hi there", " hi there a", 0.5)):
        pa, pb = paired_draws(model, tokenizer, "q: say hi\na:", (a, b), 1024)
        ua, ub = (paired_draws(model, tokenizer, "q: say hi\na:", (c,), 1024, seed, paired=False)[0]
                  for c, seed in ((a, 1), (b, 2)))
        assert (pa - pb).var() < most * (ua - ub).var(), (a, b, (pa - pb).var(), (ua - ub).var())


def test_giftlm_pairs_the_choices_of_a_question(folders, monkeypatch):
    """model_arg paired: the requests of one context draw the same masks (another context, of the same length, its
    own); unpaired (the default) each request its own. harness.py --paired-draws sets it; a paired that is no bool is
    refused naming it."""
    folder = folders["llada"][0]
    real, masks = H.elbo_rows, []
    monkeypatch.setattr(H, "elbo_rows", lambda *a: masks.append(torch.stack([r[1] for r in real(*a)])) or real(*a))
    args = [("q: hi\na:", " yes"), ("q: hi\na:", " nop"), ("q: ho\na:", " yes")]
    for paired in (False, True):
        masks.clear()
        H.GiftLM(model=str(folder), dtype="float64", mc_num=8, check_greedy=False, paired=paired).loglikelihood(
            requests_of("loglikelihood", args))
        assert torch.equal(masks[0], masks[1]) is paired and not torch.equal(masks[0], masks[2])

    class Stop(Exception):
        pass

    def stop(**model_args):
        raise Stop(model_args["paired"])
    monkeypatch.setattr(H, "GiftLM", stop)
    for flags, paired in (([], False), (["--paired-draws"], True)):
        with pytest.raises(Stop) as info:
            H.harness_main(["--model", str(folder), "--tasks", "gift_mc", "--include-path", str(TASKS), *flags])
        assert info.value.args == (paired,)
    with pytest.raises(ValueError, match="GiftLM: paired 'maybe': expected true or false"):
        H.HarnessOptions(str(folder), paired="maybe")


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_requests_share_forward_passes_with_the_numbers_of_one_row_per_pass(folders, family, monkeypatch):
    """float64, 5 draws per request, 8 rows per pass: the 20 draws of 4 requests (contexts and continuations of other
    lengths: right-padded) run in 3 passes, and loglikelihood_rolling's 4 windows (one text in 3: longer than the
    model's 256) in 3 more; each estimate is the one of 1 row per pass (no neighbour, no padding) to 1e-12."""
    folder = folders[family][0]
    args = [("q: hi\na:", " x"), ("q: hi\na:", " yes"), ("q: is ten even\na:", " no it is odd"), ("q\na:", " z")]
    texts = [("some text",), ("a" * 300,)]
    got = {}
    for b in (1, 8):
        lm, passes = H.GiftLM(model=str(folder), dtype="float64", mc_num=5, batch_size=b, check_greedy=False), []
        forward = lm.model.forward
        monkeypatch.setattr(lm.model, "forward", lambda *a, **k: passes.append(len(a[0])) or forward(*a, **k))
        got[b] = ([e for e, _ in lm.loglikelihood(requests_of("loglikelihood", args))]
                  + lm.loglikelihood_rolling(requests_of("loglikelihood_rolling", texts)), passes)
    assert got[8][1] == [8, 8, 4, 8, 8, 4] and got[1][1] == [1] * 40
    assert got[8][0] == pytest.approx(got[1][0], rel=1e-12, abs=0) and len(set(got[8][0])) == 6


def test_bench_likelihood_smoke(tmp_path, capsys):
    """bench/likelihood.py --smoke: the multiple-choice table and requests/s, on a random tiny model."""
    spec = importlib.util.spec_from_file_location("bench_likelihood", REPO / "bench" / "likelihood.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--smoke", "--out-dir", str(tmp_path)])
    assert (tmp_path / "likelihood-smoke.md").is_file() and "paired" in capsys.readouterr().out
