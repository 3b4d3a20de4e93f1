"""harness.py's GiftLM, the model "gift" of lm-evaluation-harness (optional: pip install -r requirements-extras.txt;
skipped without it). Offline: the tasks are the local YAMLs of tests/data/harness over small JSONL files, on tiny
random LLaDA and Dream folders. The likelihood estimator is checked against the exact ELBO, a finite sum over the
mask sets of a 3-token continuation; generate_until against eval.py's own generations."""

import itertools
import json
import math
import os
import subprocess
import sys
import tempfile

os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                  HF_DATASETS_CACHE=os.path.join(tempfile.mkdtemp(prefix="gift-harness-"), "datasets"))

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is optional: pip install -r requirements-extras.txt")

import lm_eval  # noqa: E402
from conftest import REPO  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import data  # noqa: E402
import embedded  # noqa: E402
import eval as E  # noqa: E402
import harness as H  # noqa: E402
from model import LLaDA  # noqa: E402
from model import shift_right  # noqa: E402
from sample import SamplerOptions  # noqa: E402

TASKS = REPO / "tests" / "data" / "harness"


def elbo_draws(model, context, continuation, mc_num, batch_size, generator, paired=False):
    """mc_num unbiased draws of the continuation's ELBO (harness.py's estimator), float64 (mc_num,): one request's
    elbo_rows through elbo_passes (as GiftLM runs them, each request from its own generator)."""
    rows = H.elbo_rows(context, continuation, mc_num, generator, paired)
    return torch.tensor(list(H.elbo_passes(model, rows, batch_size)), dtype=torch.float64)


@pytest.fixture(autouse=True)
def at_repo_root(monkeypatch):
    """The task YAMLs name their data files from the repository root, as a user's own YAMLs would from theirs."""
    monkeypatch.chdir(REPO)


def tiny_folder(path, family="llada", seed=0):
    """A tiny random model folder (std 0.2: its likelihoods differ from choice to choice) with its character
    tokenizer; returns the model in float64 and the tokenizer."""
    tokenizer = embedded.make_char_tokenizer(family=family)
    config = embedded.tiny_config_for(tokenizer, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=64,
                                      max_sequence_length=256)
    model = LLaDA(config).init_weights(torch.Generator().manual_seed(seed), std=0.2)
    model.save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    return model.double().eval(), tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    return {family: (root / family, *tiny_folder(root / family, family)) for family in ("llada", "dream")}


def exact_elbo(model, context, continuation):
    """The ELBO of the continuation, by enumeration: the mean over l in 1..L, and over the C(L, l) sets M of l
    positions, of (L / l) sum_{i in M} log p(y_i | context, y with M masked); the full logits, Dream's shifted by
    model.shift_right (not elbo_draws' own indexing)."""
    P, L = len(context), len(continuation)
    total = 0.0
    for l in range(1, L + 1):
        for M in itertools.combinations(range(L), l):
            x = torch.tensor([context + continuation])
            x[0, [P + i for i in M]] = model.config.mask_token_id
            logits = model(x)
            logits = shift_right(logits) if model.predicts_shifted else logits
            logp = torch.log_softmax(logits[0].double(), dim=-1)
            total += (L / l) * sum(logp[P + i, continuation[i]].item() for i in M) / (L * math.comb(L, l))
    return total


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_the_mc_mean_meets_the_exact_elbo(folders, family, one_thread):
    """4096 draws (stratified, 256 per pass) of a 3-token continuation: their mean is within 4 standard errors of the
    exact ELBO (the draws are seeded: the same numbers every run). A weight other than L / l, or Dream read at i, misses
    it by many."""
    _, model, tokenizer = folders[family]
    context, continuation = data.encode(tokenizer, "say hi"), data.encode(tokenizer, "hi ")
    exact = exact_elbo(model, context, continuation)
    draws = elbo_draws(model, context, continuation, 4096, 256, torch.Generator().manual_seed(0))
    se = draws.std().item() / math.sqrt(len(draws))
    assert abs(draws.mean().item() - exact) < 4 * se, (draws.mean().item(), exact, se)
    assert se < 0.05 * abs(exact)  # the check has teeth: the standard error is small beside the ELBO


def test_stratified_counts_are_uniform_and_spread():
    """Each draw's l is exactly uniform on 1..L (its count over every k equal); with b = L draws per pass the counts
    are 1..L each once."""
    g = torch.Generator().manual_seed(0)
    for L, b in ((3, 2), (5, 3), (4, 8)):
        counts = torch.stack([H.stratified_mask_counts(L, b, g) for _ in range(600)])  # (600, b)
        assert counts.min() >= 1 and counts.max() <= L
        for j in range(b):
            freq = torch.bincount(counts[:, j], minlength=L + 1)[1:] / 600
            assert (freq - 1 / L).abs().max() < 0.08, (L, b, j, freq)
    assert sorted(H.stratified_mask_counts(7, 7, g).tolist()) == list(range(1, 8))
    masks = H.continuation_masks(6, torch.tensor([1, 3, 6]), g)
    assert masks.sum(1).tolist() == [1, 3, 6]


def requests_of(kind, args, task="t"):
    return [Instance(kind, {}, a, i, (task, i, 1)) for i, a in enumerate(args)]


def test_loglikelihood_is_seeded_and_reads_is_greedy(folders, one_thread):
    """A rerun gives the same numbers, in any order; is_greedy is True exactly for the greedy continuation."""
    folder, model, tokenizer = folders["llada"]
    lm = H.GiftLM(model=str(folder), dtype="float64", mc_num=16, batch_size=8)
    for context in ("q: hi\na:", "q: say hi\na:", "q: is ten even\na:", "q: spell cat\na:", "q: name a color\na:"):
        ids = H.greedy_continuation(model, data.encode(tokenizer, context), 3)  # random weights: ids past the text's
        greedy = tokenizer.decode(ids, skip_special_tokens=False)            # vocabulary too; take one that reads
        if data.encode(tokenizer, greedy) == ids:
            break
    assert data.encode(tokenizer, greedy) == ids
    args = [(context, greedy), (context, "zzz"), ("q: say\na:", " ab")]
    first = lm.loglikelihood(requests_of("loglikelihood", args))
    assert lm.loglikelihood(requests_of("loglikelihood", args[::-1])) == first[::-1]
    assert [g for _, g in first] == [True, greedy == "zzz", False] and first[0][0] != first[1][0]


def test_simple_evaluate_multiple_choice_gives_the_exact_likelihoods(folders, one_thread):
    """The local multiple-choice YAML through lm_eval.simple_evaluate(model="gift"), on LLaDA and Dream: each choice is
    one token, whose ELBO is its exact log p (the enumeration), and acc is the share of documents whose gold choice
    has the highest."""
    for family in ("llada", "dream"):
        folder, model, tokenizer = folders[family]
        out = lm_eval.simple_evaluate(model="gift", model_args=f"model={folder},dtype=float64,mc_num=4",
                                      tasks=["gift_mc"], task_manager=TaskManager(include_path=str(TASKS),
                                                                                 include_defaults=False))
        samples = out["samples"]["gift_mc"]
        correct = []
        for s in samples:
            context = data.encode(tokenizer, f"q: {s['doc']['question']}\na:")
            got = [r[0][0] for r in s["resps"]]
            want = [exact_elbo(model, context, data.encode(tokenizer, c)) for c in s["doc"]["choices"]]
            assert got == pytest.approx(want, abs=1e-9), family
            correct.append(max(range(len(want)), key=want.__getitem__) == s["doc"]["label"])
        assert len(samples) == 3 and out["results"]["gift_mc"]["acc,none"] == pytest.approx(sum(correct) / 3)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_generate_until_gives_eval_pys_generations(folders, temperature, one_thread):
    """The local generation YAML (the chat template on, the plain prompt style) with d1's sampler settings gives, item
    for item, eval.py's generation of the same puzzle, cut at the turn end and the task's "</answer>"; sampled too,
    each document's noise from eval.py's generator of its item (item_generator(seed, index))."""
    folder, model, tokenizer = folders["llada"]
    out = lm_eval.simple_evaluate(model="gift", model_args=f"model={folder},dtype=float64,gen_length=16,steps=8,"
                                  f"block_length=8,batch_size=2,temperature={temperature},seed=3", tasks=["gift_gen"],
                                  apply_chat_template=True,
                                  task_manager=TaskManager(include_path=str(TASKS), include_defaults=False))
    items = [json.loads(line) for line in (TASKS / "gift_gen.jsonl").read_text().splitlines()]
    options = SamplerOptions(gen_length=16, steps=8, block_length=8, temperature=temperature)
    _, records = E.evaluate(model, tokenizer, items, "sudoku", options, batch_size=2, prompt_style="plain",
                            run=E.SeedRun(seed=3))
    want = [H.cut_at_stops(r["generation"], ["<|eot_id|>", "<|endoftext|>", "</answer>"]) for r in records]
    got = [s["resps"][0][0] for s in sorted(out["samples"]["gift_gen"], key=lambda s: s["doc_id"])]
    assert got == want and any(want)
    prompt = out["samples"]["gift_gen"][0]["arguments"][0][0]
    assert prompt == E.build_prompt("sudoku", items[out["samples"]["gift_gen"][0]["doc_id"]], "plain")


def test_the_command_line(folders, tmp_path, capsys, one_thread):
    """python harness.py: the harness's table printed, its results written."""
    folder, _, _ = folders["dream"]
    H.harness_main(["--model", str(folder), "--tasks", "gift_mc", "--include-path", str(TASKS), "--mc-num", "2",
                    "--dtype", "float64", "--no-check-greedy", "--out", str(tmp_path / "r.json")])
    assert "gift_mc" in capsys.readouterr().out
    assert "acc,none" in json.loads((tmp_path / "r.json").read_text())["results"]["gift_mc"]


def test_what_is_not_supported_is_refused_by_name(folders):
    """A task that needs images is refused naming it (the harness's check of the model's MULTIMODAL); a request
    shaped for another model (images after the text) names its task; unknown model_args are named."""
    folder, _, _ = folders["llada"]
    lm = H.GiftLM(model=str(folder), mc_num=2, max_batch_size=4)  # lm-eval's own key is taken (and not read)
    with pytest.raises(ValueError, match="batch_size 'auto': expected an integer"):
        H.GiftLM(model=str(folder), batch_size="auto")
    with pytest.raises(ValueError, match="gift_image"):
        lm_eval.simple_evaluate(model=lm, tasks=["gift_image"], task_manager=TaskManager(include_path=str(TASKS),
                                                                                         include_defaults=False))
    with pytest.raises(ValueError, match="task 'pictures'.*not supported"):
        lm.generate_until(requests_of("generate_until", [("hi", {"until": []}, {"visual": []})], "pictures"))
    with pytest.raises(ValueError, match="unknown model_args mc_nun"):
        H.GiftLM(model=str(folder), mc_nun=2)


def test_without_lm_eval_one_line_says_how_to_install_it():
    """lm-eval hidden: `import eval` and `import harness` work, harness.GiftLM and harness.py's command line say the
    pip command in one line."""
    code = ("import sys; sys.modules['lm_eval'] = None; sys.path.insert(0, {repo!r}); import eval, harness\n"
            "try:\n    harness.GiftLM\nexcept ImportError as e:\n    print(e)\n"
            "harness.harness_main(['--model', 'x', '--tasks', 'y'])").format(repo=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "pip install -r requirements-extras.txt" in r.stdout, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "pip install -r requirements-extras.txt" in r.stderr
