"""Sampling in the harness does not depend on --batch-size: GiftLM gives every request its own generator, with either
sampler; Dream's diffusion_generate takes one generator per row (dream.py), each row then stepping as it would alone,
and a list of one is still the official run (tests/golden/dream/generate.json). Skipped without lm-eval for GiftLM's
part (pip install -r requirements-extras.txt)."""

import json

import pytest
import torch
from conftest import GOLDEN

from dream import diffusion_generate
from model import LLaDA

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread

CASES = json.loads((GOLDEN / "dream" / "generate.json").read_text())["cases"]
SEEDED = [c for c in CASES if c["seed"] is not None]


def run(case, model, ids, mask, generator):
    c = case["config_in_force"]
    return diffusion_generate(model, ids, mask, max_new_tokens=c["max_new_tokens"], steps=c["steps"], eps=c["eps"],
                              alg=c["alg"], alg_temp=c["alg_temp"], temperature=c["temperature"], top_p=c["top_p"],
                              top_k=c["top_k"], generator=generator)


@pytest.mark.parametrize("case", [c for c in SEEDED if c["prompt"] == "batch1"],
                         ids=[f"{c['checkpoint']}-{c['case']}" for c in SEEDED if c["prompt"] == "batch1"])
def test_a_list_of_one_generator_is_the_official_run(case):
    """Every seeded batch-1 golden case (origin, maskgit_plus, entropy with alg_temp; sampled and greedy): the list
    [torch.Generator().manual_seed(S)] gives the official tokens, as the single generator does."""
    model = LLaDA.from_pretrained(GOLDEN / "dream" / f"tiny_dream_{case['checkpoint']}").eval()
    out = run(case, model, torch.tensor(case["input_ids"]), torch.tensor(case["attention_mask"]),
              [torch.Generator().manual_seed(case["seed"])])
    assert out.tolist() == case["sequences"]


@pytest.mark.parametrize("case", [c for c in SEEDED if c["prompt"] == "batch2_leftpad"],
                         ids=[f"{c['checkpoint']}-{c['case']}" for c in SEEDED if c["prompt"] == "batch2_leftpad"])
def test_each_row_of_a_batch_is_the_row_alone(case):
    """A left-padded batch of two with a generator per row: each row's tokens are those of the row run alone
    (unpadded) from its generator, in float64 (a batched forward pass rounds otherwise, ~1e-16: no tie at the tiny
    model's scale)."""
    model = LLaDA.from_pretrained(GOLDEN / "dream" / f"tiny_dream_{case['checkpoint']}").double().eval()
    ids, mask = torch.tensor(case["input_ids"]), torch.tensor(case["attention_mask"])
    seeds = (case["seed"], case["seed"] + 1)
    batch = run(case, model, ids, mask, [torch.Generator().manual_seed(s) for s in seeds])
    P = ids.shape[1]
    for row, seed in enumerate(seeds):
        own = ids[row][mask[row].bool()][None]  # (1, P_row): its tokens, no pads
        alone = run(case, model, own, None, [torch.Generator().manual_seed(seed)])
        assert batch[row, P:].tolist() == alone[0, own.shape[1]:].tolist(), row


# -----------------------------------------------------------------------------
# GiftLM: the same answers at any --batch-size


@pytest.mark.parametrize("family, model_args", [
    ("dream", "sampler=dream,alg=entropy,temperature=0.7,top_p=0.95"),
    ("dream", "sampler=dream,alg=origin"),  # origin draws even when greedy
    ("dream", "sampler=block,temperature=0.7"),
    ("llada", "temperature=0.7,remasking=random"),
])
def test_giftlm_samples_the_same_at_any_batch_size(family, model_args, tmp_path):
    """Six requests at batch_size 1, 3 and 6: the same six answers, in float64; they differ from another seed's."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is optional: pip install -r requirements-extras.txt")
    import harness as H
    from test_harness import requests_of, tiny_folder
    tiny_folder(tmp_path, family, seed=1)
    requests = requests_of("generate_until", [(q, {"until": [], "max_gen_toks": 12}) for q in
                                              ("q: hi", "q: say one", "q: ok", "q: no", "q: cat", "q: say two")])
    answers = {}
    for b in (1, 3, 6):
        lm = H.GiftLM.create_from_arg_string(f"model={tmp_path},dtype=float64,batch_size={b},seed=2,{model_args}")
        answers[b] = lm.generate_until(requests)
    assert answers[1] == answers[3] == answers[6], answers
    other = H.GiftLM.create_from_arg_string(f"model={tmp_path},dtype=float64,batch_size=6,seed=3,{model_args}")
    assert other.generate_until(requests) != answers[1]
