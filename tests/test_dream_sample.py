"""Dream's sampler (dream.py diffusion_generate) against the official Dream diffusion_generate: all 52 generations
of tests/golden/dream/generate.json token for token (greedy maskgit_plus / topk_margin / entropy, origin, sampled,
left-padded and unpadded), the random draws matched by an explicit generator, the legacy-defaults trap, and the
small pieces (filters, the Categorical draw, the tokens-per-step rule) on closed forms."""

import json

import pytest
import torch
import torch.distributions as dists
from conftest import GOLDEN

from model import LLaDA
from dream import diffusion_generate, dream_confidence, dream_num_transfer, sample_tokens, top_k_logits, top_p_logits

pytestmark = pytest.mark.numerics  # float32 against goldens and other code paths (conftest.py)


DREAM = GOLDEN / "dream"
CASES = json.loads((DREAM / "generate.json").read_text())["cases"]
MODELS = {}


def dream(name):
    if name not in MODELS:
        MODELS[name] = LLaDA.from_pretrained(DREAM / f"tiny_dream_{name}").eval()
    return MODELS[name]


def run_case(case, generator=None):
    """Our diffusion_generate with exactly the settings the official call had in force (config_in_force: for the
    TRAP case, the legacy defaults temperature 1.0 / top_k 50 it inherited, passed explicitly here)."""
    c = case["config_in_force"]
    return diffusion_generate(dream(case["checkpoint"]), torch.tensor(case["input_ids"]),
                              torch.tensor(case["attention_mask"]), max_new_tokens=c["max_new_tokens"],
                              steps=c["steps"], eps=c["eps"], alg=c["alg"], alg_temp=c["alg_temp"],
                              temperature=c["temperature"], top_p=c["top_p"], top_k=c["top_k"], generator=generator)


def case_id(case):
    return f"{case['checkpoint']}-{case['case']}-{case['prompt']}"


def find(checkpoint, name, prompt):
    return next(c for c in CASES if (c["checkpoint"], c["case"], c["prompt"]) == (checkpoint, name, prompt))


# -----------------------------------------------------------------------------
# Golden generations from the official code (tests/golden/README.md, "generate.json")


@pytest.mark.parametrize("case", [c for c in CASES if c["seed"] is None], ids=case_id)
def test_greedy_matches_official(case):
    """Greedy maskgit_plus / topk_margin / entropy draw nothing: token-identical, padded (positions cumsum(mask) - 1,
    pads invisible) and unpadded ("full" attention), steps = and < max_new_tokens."""
    assert case["rng_calls"] == []
    assert run_case(case).tolist() == case["sequences"]


@pytest.mark.parametrize("case", [c for c in CASES if c["seed"] is not None], ids=case_id)
def test_random_draws_match_official(case):
    """origin (torch.rand per step, even at temperature 0) and sampled runs: torch.Generator().manual_seed(S) gives
    the tokens the official code gave after torch.manual_seed(S), the same draws in the same order."""
    assert case["rng_calls"], "a seeded case draws"
    out = run_case(case, torch.Generator().manual_seed(case["seed"]))
    assert out.tolist() == case["sequences"]


def test_global_rng_when_no_generator():
    """generator=None draws from torch's global RNG, as the official code: seeding it gives the official tokens."""
    case = find("tied", "entropy.sampled.t1.0.topp0.95.algtemp0.5.steps4", "batch2_leftpad")
    torch.manual_seed(case["seed"])
    assert run_case(case).tolist() == case["sequences"]


def test_sampled_mask_id_stays_masked():
    """The mask id is a token like any other to the sampler: a drawn mask leaves its position masked (golden:
    tied origin.sampled, row 0 ends in the mask id 75), and ours does the same."""
    case = find("tied", "origin.sampled.t0.8.topp0.9.steps4", "batch2_leftpad")
    out = run_case(case, torch.Generator().manual_seed(case["seed"]))
    assert out[0, -1].item() == dream("tied").config.mask_token_id == case["sequences"][0][-1]


def test_legacy_defaults_trap():
    """Called with no generation_config, the official method inherits temperature 1.0 / top_k 50 and samples
    (TRAP case). Ours takes what it is given: the defaults are greedy, draw nothing from the global RNG, and give the
    official greedy tokens, not the TRAP ones; the TRAP tokens need temperature 1.0 and top_k 50 said explicitly."""
    trap = find("tied", "TRAP.no_generation_config.maskgit_plus.steps8", "batch2_leftpad")
    greedy = find("tied", "maskgit_plus.greedy.steps8", "batch2_leftpad")
    ids, mask = torch.tensor(trap["input_ids"]), torch.tensor(trap["attention_mask"])
    state = torch.get_rng_state()
    out = diffusion_generate(dream("tied"), ids, mask, max_new_tokens=8, steps=8, alg="maskgit_plus")  # TRAP's kwargs
    assert torch.equal(torch.get_rng_state(), state)
    assert out.tolist() == greedy["sequences"] != trap["sequences"]
    sampled = diffusion_generate(dream("tied"), ids, mask, max_new_tokens=8, steps=8, alg="maskgit_plus",
                                 temperature=1.0, top_k=50, generator=torch.Generator().manual_seed(trap["seed"]))
    assert sampled.tolist() == trap["sequences"]


@pytest.mark.parametrize("checkpoint, name, prompt", [("gqa", "entropy.greedy.steps8", "batch2_leftpad"),
                                                      ("tied", "entropy.greedy.steps3", "batch2_leftpad")])
def test_legacy_top_k_applies_at_temperature_zero_too(checkpoint, name, prompt):
    """The official method called with temperature=0 but no top_k keeps from_model_config's legacy top_k = 50, and
    top_k filters the logits before the softmax at every temperature: the argmax tokens are the same, but the
    confidences (here the entropy) are those of the 50 kept logits, so the unmasking order and the tokens can differ.
    The stored greedy case passed top_k=None: ours gives its tokens with top_k=None (our default), and other tokens
    with top_k=50, the value such a call has in force."""
    case = find(checkpoint, name, prompt)
    c = case["config_in_force"]
    assert c["temperature"] == 0.0 and c["top_k"] is None and dream(checkpoint).config.vocab_size > 50
    kw = dict(max_new_tokens=c["max_new_tokens"], steps=c["steps"], eps=c["eps"], alg=c["alg"])
    ids, mask = torch.tensor(case["input_ids"]), torch.tensor(case["attention_mask"])
    assert diffusion_generate(dream(checkpoint), ids, mask, **kw).tolist() == case["sequences"]
    assert diffusion_generate(dream(checkpoint), ids, mask, top_k=50, **kw).tolist() != case["sequences"]


# -----------------------------------------------------------------------------
# The pieces


def test_top_p_and_top_k_filters():
    """Closed forms: top_p keeps the tokens up to and including the one whose cumulative probability first passes
    top_p; top_k keeps the logits not below the k-th largest, ties included."""
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]], dtype=torch.float64)
    low = torch.finfo(torch.float64).min
    kept = top_p_logits(probs.log(), 0.7) > low  # sorted: 0.5 (0.5), 0.3 (0.8 > 0.7, kept), then dropped
    assert kept.tolist() == [[False, True, False, True]]
    assert (top_p_logits(probs.log(), 0.4) > low).tolist() == [[False, True, False, False]]  # the top one always
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    assert (top_k_logits(logits, 2) > torch.finfo(torch.float32).min).tolist() == [[False, True, True, True, False]]
    assert torch.equal(top_k_logits(logits, 99), logits)


def test_categorical_draw_equals_official():
    """temperature > 0: our multinomial over renormalised probs is the draw Categorical(probs).sample() makes,
    with an explicit generator instead of the global one (fresh random logits, several seeds)."""
    for seed in range(5):
        logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(100 + seed)) * 3
        probs, x0 = sample_tokens(logits, 0.8, top_p=0.9, generator=torch.Generator().manual_seed(seed))
        torch.manual_seed(seed)
        assert torch.equal(x0, dists.Categorical(probs=probs).sample())


def test_confidences():
    """maskgit_plus: p(x0); topk_margin: top1 - top2; entropy: sum p log(p + 1e-10) (closed forms)."""
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]], dtype=torch.float64)
    x0 = torch.tensor([1, 2])
    assert torch.allclose(dream_confidence(probs, x0, "maskgit_plus"), torch.tensor([0.3, 0.6], dtype=torch.float64))
    assert torch.allclose(dream_confidence(probs, x0, "topk_margin"), torch.tensor([0.3, 0.4], dtype=torch.float64))
    neg_entropy = (probs * (probs + 1e-10).log()).sum(-1)
    assert torch.allclose(dream_confidence(probs, x0, "entropy"), neg_entropy)


def test_tokens_per_step_rule():
    """The batch-average mask count, truncated: 8 masks, 8 steps unmask 0, 1 x 6, then 2 (the golden history);
    rows with 3 and 6 masks both unmask int(4.5) = 4 at the last step."""
    eps, steps = 1e-3, 8
    ts = torch.linspace(1, eps, steps + 1)
    masks, ks = 8, []
    for i in range(steps):
        k = dream_num_transfer(torch.arange(8)[None] < masks, ts[i], ts[i + 1], i == steps - 1)
        ks.append(k)
        masks -= k
    assert ks == [0, 1, 1, 1, 1, 1, 1, 2]
    rows = torch.arange(8)[None] < torch.tensor([[3], [6]])
    assert dream_num_transfer(rows, ts[6], ts[7], last=True) == 4


def test_refuses_bad_arguments():
    model, ids = dream("gqa"), torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="alg='greedy'"):
        diffusion_generate(model, ids, max_new_tokens=4, steps=4, alg="greedy")
    with pytest.raises(ValueError, match="prompt must be"):
        diffusion_generate(model, ids[0], max_new_tokens=4, steps=4)
    with pytest.raises(ValueError, match="top_p"):
        diffusion_generate(model, ids, max_new_tokens=4, steps=4, top_p=0.0)
    with pytest.raises(ValueError, match="one torch.Generator"):
        diffusion_generate(model, ids, max_new_tokens=4, steps=4, generator=1)
    with pytest.raises(ValueError, match="2 generators for 1 rows"):  # one per row, or one for the batch
        diffusion_generate(model, ids, max_new_tokens=4, steps=4, generator=[torch.Generator()] * 2)
    llada = LLaDA.from_pretrained(GOLDEN / "tiny_llada_mha").eval()  # LLaDA's logits at i predict token i: refused
    with pytest.raises(ValueError, match="not Dream"):
        diffusion_generate(llada, ids, max_new_tokens=4, steps=4)
