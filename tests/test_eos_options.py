"""The official generate()'s logits_eos_inf and confidence_eos_eot_inf (LLaDA Appendix B.4) in sample.generate, the
cached sampler and the command lines: token for token against the official code (tests/official_sampler.py, the two
options as its HEAD runs them), and from their definition: logits_eos_inf writes no EOS; confidence_eos_eot_inf
gives an EoT candidate confidence 0, and an EOS candidate too at temperature 0 only (the official chained assignment
`logits_with_noise[:, :, EOS] = logits[:, :, EOT] = -inf`: at temperature > 0 logits_with_noise is a float64 copy)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from official_sampler import official_generate  # the oracle, beside this file
from test_sample import EOS, MASK, left_pad, random_prompts, tiny_model

import sample
from cached_sample import generate_cached
from sample import SamplerOptions, candidates, generate, generate_with_options

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread

EOT = 45  # the tiny models' turn end (test_sample's vocabulary: 48 ids, EOS 46, mask 47)


class EosHead(nn.Module):
    """The LM head with EOS's and EoT's logits raised (by `eos` and `eot`: both frequent candidates, as in a model
    trained on EOS-padded answers) and the mask token's pushed to -1e9 (never proposed; finite, for CFG)."""

    def __init__(self, head, eos, eot):
        super().__init__()
        self.head, self.eos, self.eot = head, eos, eot

    def forward(self, h):
        logits = self.head(h)
        logits[..., EOS] += self.eos
        logits[..., EOT] += self.eot
        logits[..., MASK] = -1e9
        return logits


def eos_model(seed=1, eos=2.0, eot=2.5):
    """A random float32 LLaDA whose answers often hold EOS and EoT."""
    model = tiny_model(seed)
    model.model.transformer.ff_out = EosHead(model.model.transformer.ff_out, eos, eot)
    return model


def gen(seed):
    return torch.Generator().manual_seed(seed)


SETTINGS = {  # name: generate() keywords (besides the prompt and the options)
    "greedy": dict(steps=12, gen_length=24, block_length=8),
    "sampled": dict(steps=12, gen_length=24, block_length=8, temperature=0.8),
    "greedy_random": dict(steps=8, gen_length=16, block_length=8, remasking="random"),
    "sampled_random": dict(steps=8, gen_length=16, block_length=8, temperature=0.7, remasking="random"),
    "cfg_greedy": dict(steps=8, gen_length=16, block_length=8, cfg_scale=1.0),
    "cfg_sampled": dict(steps=8, gen_length=16, block_length=8, cfg_scale=0.5, temperature=0.5),
}
FLAGS = {
    "logits_eos_inf": dict(logits_eos_inf=True),
    "confidence_eos_eot_inf": dict(confidence_eos_eot_inf=True),
    "both": dict(logits_eos_inf=True, confidence_eos_eot_inf=True),
}


# -----------------------------------------------------------------------------
# Token for token against the official code


@pytest.mark.numerics  # float32 against the official code (its head over every position: conftest.py)
@pytest.mark.parametrize("padded", [False, True], ids=["no_pad", "left_padded"])
@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("name", list(SETTINGS))
def test_flags_equal_official(name, flags, padded):
    kw, fl = SETTINGS[name], FLAGS[flags]
    model = eos_model()
    if padded:  # rows of 3, 6 and 5 tokens, left-padded with EOS and an attention mask
        prompt, attention_mask = left_pad([random_prompts(1, n, seed=n)[0] for n in (3, 6, 5)])
    else:
        prompt, attention_mask = random_prompts(3, 6, seed=0), None
    ours = generate(model, prompt, attention_mask, **kw, **fl, eot_id=EOT, generator=gen(7))
    ref = official_generate(model, prompt, attention_mask, **kw, **fl, mask_id=MASK, eos_id=EOS, eot_id=EOT,
                            generator=gen(7))
    assert torch.equal(ours, ref)
    plain = generate(model, prompt, attention_mask, **kw, generator=gen(7))
    if flags == "confidence_eos_eot_inf" and kw.get("remasking") == "random":
        # the official code changes only the logits of the confidence softmax, after the draw: random remasking
        # reads neither, so the tokens are the flag-less ones
        assert torch.equal(ours, plain)
    else:  # the fixture makes the flag matter: a sampler that dropped it would fail the comparison above
        assert not torch.equal(ours, plain)


def test_per_row_generators_equal_official_row_by_row():
    """One generator per row (each row's draws over its own tokens): each row is what the official code gives that
    row alone with its generator, both flags set (float64: the left pads shift the positions, which changes only
    the rounding; test_sample.py's rule)."""
    model = eos_model().double()
    prompts = [random_prompts(1, n, seed=20 + n)[0] for n in (4, 6)]
    ids, attention_mask = left_pad(prompts)
    kw = dict(steps=12, gen_length=24, block_length=8, temperature=0.8, logits_eos_inf=True,
              confidence_eos_eot_inf=True)
    batch = generate(model, ids, attention_mask, **kw, eot_id=EOT, generator=[gen(3), gen(4)])
    for b, p in enumerate(prompts):
        alone = official_generate(model, p[None], **kw, mask_id=MASK, eos_id=EOS, eot_id=EOT, generator=gen(3 + b))
        assert torch.equal(batch[b, ids.shape[1]:], alone[0, len(p):])


# -----------------------------------------------------------------------------
# From the definition


@pytest.mark.parametrize("name", list(SETTINGS))
def test_logits_eos_inf_writes_no_eos(name):
    kw, model = SETTINGS[name], eos_model()
    prompt = random_prompts(3, 6, seed=0)
    plain = generate(model, prompt, **kw, generator=gen(7))[:, 6:]
    assert (plain == EOS).any()  # the model writes EOS
    out = generate(model, prompt, **kw, logits_eos_inf=True, generator=gen(7))[:, 6:]
    assert not (out == EOS).any() and not (out == MASK).any()
    assert (out == EOT).any()  # the turn end is not EOS: still written


def test_cached_sampler_logits_eos_inf_writes_no_eos():
    """The cached sampler (a dual cache, a threshold) reads the flag too: no EOS."""
    model, prompt = eos_model(), random_prompts(3, 6, seed=0)
    o = SamplerOptions(gen_length=16, steps=8, block_length=8, cache="dual", threshold=0.5)
    assert (generate_cached(model, prompt, None, o)[:, 6:] == EOS).any()
    o = SamplerOptions(gen_length=16, steps=8, block_length=8, cache="dual", threshold=0.5, logits_eos_inf=True)
    assert not (generate_cached(model, prompt, None, o)[:, 6:] == EOS).any()


class Recorder(nn.Module):
    """The model, called through a wrapper that records what the sampler shows it at each step (unwrap finds the
    model, its config and head, under .module)."""

    def __init__(self, module):
        super().__init__()
        self.module, self.seen = module, []

    def forward(self, x, **kw):
        self.seen.append(x.clone())
        return self.module(x, **kw)


def step_violations(model, prompt, out, seen, steps, block_length, held):
    """Replay a greedy run step by step from the states `seen` (then `out`): at each step the candidates are the
    argmax of the model's logits on the state; the step transfers the positions masked before and not after.
    Returns (violations, held_back, placed): the steps that transferred a candidate in `held` (ids) while an
    eligible position (masked, before the block's end) with a candidate not in `held` was left masked; the steps
    that left a `held` candidate masked; and how many `held` candidates were transferred."""
    P, gen_length = prompt.shape[1], out.shape[1] - prompt.shape[1]
    per_block = steps // (gen_length // block_length)
    held = torch.tensor(held)
    violations = held_back = placed = 0
    states = seen + [out]
    for t, (x, after) in enumerate(zip(states[:-1], states[1:])):
        block_end = P + (t // per_block + 1) * block_length
        c = model(x).argmax(-1)  # (B, L): the greedy candidates
        masked = x == MASK
        masked[:, block_end:] = False  # the eligible positions
        moved = masked & (after != MASK)
        assert torch.equal(after[moved], c[moved])  # the replay is the run's
        special = torch.isin(c, held)
        stays = masked & ~moved
        violations += int(((moved & special).any(1) & (stays & ~special).any(1)).sum())
        held_back += int((stays & special).any(1).sum())
        placed += int((moved & special).sum())
    return violations, held_back, placed


@pytest.mark.parametrize("cfg_scale", [0.0, 1.0], ids=["no_cfg", "cfg"])
def test_greedy_confidence_eos_eot_inf_places_eos_and_eot_last_in_their_block(cfg_scale):
    """Temperature 0: EOS's and EoT's logits are -inf in the confidence softmax (logits_with_noise IS the logits),
    so an EOS or EoT candidate has confidence 0, and is transferred only when its block has nothing else left to
    transfer. Counted step by step, replaying the candidates (float64: the replay's head over every position rounds
    as the sampler's over the eligible ones)."""
    model = eos_model().double()
    prompt = random_prompts(3, 6, seed=0)
    kw = dict(steps=12, gen_length=24, block_length=8, cfg_scale=cfg_scale)

    def guided(x):  # the official guidance, on the conditional states x (B, L)
        if cfg_scale == 0:
            return model(x)
        un_x = x.clone()
        un_x[:, :prompt.shape[1]] = MASK
        cond, uncond = model(torch.cat([x, un_x])).chunk(2)
        return uncond + (cfg_scale + 1) * (cond - uncond)

    def count(**flags):
        rec = Recorder(model)
        out = generate(rec, prompt, **kw, **flags)
        seen = [s[:len(prompt)] for s in rec.seen]  # under CFG each call sees [x; unconditional x]
        return step_violations(guided, prompt, out, seen, kw["steps"], kw["block_length"], [EOS, EOT])

    violations, _, _ = count()
    assert violations > 0  # without the flag EOS / EoT are placed early: the count below can fail
    violations, held_back, placed = count(confidence_eos_eot_inf=True, eot_id=EOT)
    assert violations == 0
    assert held_back > 0 and placed > 0  # they were held back, and placed last


def test_sampled_confidence_eos_eot_inf_is_eot_only():
    """Temperature > 0: the candidates are the flag-less draws (the same uniforms); an EoT candidate's confidence is
    0 and the others' are their probabilities with EoT's logit -inf (renormalised), an EOS candidate's included
    (the official logits_with_noise is a float64 copy: its -inf on EOS reaches no confidence). At temperature 0
    EOS's confidence is 0 too."""
    g = gen(0)
    B, L, N = 2, 10, 16
    x = torch.full((B, L), MASK)
    eligible = torch.zeros(B, L, dtype=torch.bool)
    eligible[:, 2:] = True
    logits = torch.randn(N, 48, generator=g)
    logits[:, MASK] = -1e9
    logits[:, [EOS, EOT]] += 1.5  # both frequent candidates
    for temperature, zero in ((0.0, [EOS, EOT]), (1.0, [EOT])):
        x0, conf = candidates(logits.clone(), x, eligible, temperature, "low_confidence", gen(5),
                              eos_eot_inf=(EOS, EOT))
        x0_plain, _ = candidates(logits.clone(), x, eligible, temperature, "low_confidence", gen(5))
        assert torch.equal(x0, x0_plain)  # the draw comes first
        c, p = x0[eligible], conf[eligible]
        assert set(c.tolist()) >= {EOS, EOT}  # both are candidates somewhere: the checks below bite
        masked = logits.clone()
        masked[:, zero] = float("-inf")
        expected = F.softmax(masked, -1).gather(-1, c[:, None]).squeeze(-1)
        torch.testing.assert_close(p, expected, rtol=1e-6, atol=0)
        assert (p[torch.isin(c, torch.tensor(zero))] == 0).all()
        if temperature > 0:
            assert (p[c == EOS] > 0).all()  # the official quirk: EOS keeps its confidence
        assert (conf[~eligible] == float("-inf")).all()


class ScriptedModel(nn.Module):
    """Logits dictated per call (tables[t] at call t, whatever the input), a fresh tensor each time (the official
    code writes -inf into the model's logits in place). Identity head: the hidden states are the logits."""

    def __init__(self, tables, mask_id, eos_id):
        super().__init__()
        self.tables, self.config = tables, SimpleNamespace(mask_token_id=mask_id, eos_token_id=eos_id)
        self.head, self.seen = nn.Identity(), []

    def forward(self, input_ids, attention_mask=None, return_hidden=False):
        self.seen.append(input_ids[0].tolist())
        return self.tables[len(self.seen) - 1].expand(input_ids.shape[0], -1, -1).clone()


@pytest.mark.parametrize("temperature", [0.0, 0.01], ids=["greedy", "sampled"])
def test_scripted_order_of_eos_and_eot(temperature):
    """Prompt [0, 1], one block of 3 answer tokens, one per step. Tokens 0-2, EoT 3, EOS 4, mask 5. Each table gives
    each answer position one candidate with the probability chosen (the rest spread evenly); at temperature 0.01 the
    Gumbel draw is the argmax on these tables (log-probability gaps >= 0.5, x100), so the orders are known."""
    Vs, T_EOT, T_EOS, M, P = 6, 3, 4, 5, 2

    def table(spec):  # spec: {position: (candidate, probability)}
        probs = torch.full((P + 3, Vs), 1.0 / Vs)
        for pos, (tok, p) in spec.items():
            probs[pos] = (1 - p) / (Vs - 1)
            probs[pos, tok] = p
        return probs.log()

    tables = [table({2: (T_EOS, 0.9), 3: (0, 0.3), 4: (T_EOT, 0.95)}),
              table({2: (1, 0.5), 3: (0, 0.3), 4: (T_EOT, 0.95)}),
              table({2: (1, 0.5), 3: (2, 0.3), 4: (T_EOT, 0.95)})]
    orders = {  # the states the model sees at each call, then the answer
        # without the flag: EoT (0.95), then 1 (0.5) at position 2, then 2 at position 3
        "plain": [[0, 1, M, M, M], [0, 1, M, M, T_EOT], [0, 1, 1, M, T_EOT], [0, 1, 1, 2, T_EOT]],
        # temperature 0: EOS and EoT have confidence 0, so 0 (0.3) at 3 first, 1 (0.5) at 2; EoT last, alone
        "greedy": [[0, 1, M, M, M], [0, 1, M, 0, M], [0, 1, 1, 0, M], [0, 1, 1, 0, T_EOT]],
        # temperature > 0: only EoT's confidence is 0: EOS (0.9) goes first, then 0 at 3; EoT last
        "sampled": [[0, 1, M, M, M], [0, 1, T_EOS, M, M], [0, 1, T_EOS, 0, M], [0, 1, T_EOS, 0, T_EOT]],
    }
    prompt = torch.tensor([[0, 1]])
    kw = dict(steps=3, gen_length=3, block_length=3, temperature=temperature)
    for flag, expected in ((False, orders["plain"]), (True, orders["greedy" if temperature == 0 else "sampled"])):
        model = ScriptedModel(tables, M, T_EOS)
        out = generate(model, prompt, **kw, confidence_eos_eot_inf=flag, eot_id=T_EOT, generator=gen(0))
        assert model.seen == expected[:3] and out[0].tolist() == expected[3]
        ref = official_generate(ScriptedModel(tables, M, T_EOS), prompt, **kw, mask_id=M,
                                confidence_eos_eot_inf=flag, eos_id=T_EOS, eot_id=T_EOT, generator=gen(0))
        assert torch.equal(out, ref)


# -----------------------------------------------------------------------------
# Refusals, the cached sampler, the command lines


def test_confidence_eos_eot_inf_without_eot_id_is_refused():
    model, prompt = eos_model(), random_prompts(1, 4, seed=0)
    kw = dict(steps=4, gen_length=8, block_length=8)
    o = SamplerOptions(**kw, confidence_eos_eot_inf=True)
    for call in (lambda: generate(model, prompt, **kw, confidence_eos_eot_inf=True),
                 lambda: generate_with_options(model, prompt, None, o),
                 lambda: generate_cached(model, prompt, None, o)):
        with pytest.raises(ValueError, match="eot_id") as info:
            call()
        assert "\n" not in str(info.value)
    generate(model, prompt, **kw, logits_eos_inf=True)  # logits_eos_inf alone needs no EoT


@pytest.mark.parametrize("name", list(SETTINGS))
def test_cached_sampler_without_cache_equals_generate(name):
    """generate_cached with cache=None, threshold=None is generate(), the flags included (they share candidates())."""
    kw, model = SETTINGS[name], eos_model()
    prompt, attention_mask = left_pad([random_prompts(1, n, seed=n)[0] for n in (3, 6, 5)])
    for fl in FLAGS.values():
        ours = generate(model, prompt, attention_mask, **kw, **fl, eot_id=EOT, generator=gen(7))
        cached = generate_cached(model, prompt, attention_mask, SamplerOptions(**kw, **fl), gen(7), eot_id=EOT)
        assert torch.equal(cached, ours)


@pytest.fixture
def folder(tmp_path):
    from test_sample_eval_refusals import model_folder
    return model_folder(tmp_path / "m")


def spy_on(monkeypatch, module, name):
    """Replace module.name by a wrapper that records its (args, keyword arguments), then calls it."""
    calls, real = [], getattr(module, name)

    def spy(*args, **kw):
        calls.append((args, kw))
        return real(*args, **kw)
    monkeypatch.setattr(module, name, spy)
    return calls


def test_sample_command_line_flags(folder, monkeypatch, capsys):
    """sample.py --logits-eos-inf / --confidence-eos-eot-inf reach generate(), with the tokenizer's <|eot_id|>; the
    same through cached_sample.py (--cache dual) to generate_cached()."""
    import cached_sample
    import data
    from test_sample_eval_refusals import sample_argv
    eot = data.load_tokenizer(folder).token_to_id(data.EOT)
    assert eot is not None
    calls = spy_on(monkeypatch, sample, "generate")
    sample.main(sample_argv(folder, "--confidence-eos-eot-inf"))
    sample.main(sample_argv(folder, "--logits-eos-inf", "--temperature", "0.5"))
    sample.main(sample_argv(folder))
    assert [(kw["logits_eos_inf"], kw["confidence_eos_eot_inf"], kw["eot_id"]) for _, kw in calls] == [
        (False, True, eot), (True, False, eot), (False, False, eot)]
    cached = spy_on(monkeypatch, cached_sample, "generate_cached")
    sample.main(sample_argv(folder, "--cache", "dual", "--confidence-eos-eot-inf", "--logits-eos-inf"),
                sampler=cached_sample.generate_with_options)
    (args, kw), = cached
    assert args[3].confidence_eos_eot_inf and args[3].logits_eos_inf and kw["eot_id"] == eot
    assert len(capsys.readouterr().out.splitlines()) >= 4  # one reply per call


def test_eval_records_the_flags_only_when_set(tmp_path):
    """eval.py's records name confidence_eos_eot_inf / logits_eos_inf only when set: a records file written without
    them (as before the options existed) continues; a rerun with a flag over it is refused, naming the option."""
    import eval as E
    from test_eval import record_lines
    from test_sample_eval_refusals import eval_argv
    argv = eval_argv(tmp_path, "--batch-size", "2")
    E.main(argv + ["--limit", "2"])
    path = tmp_path / "r.jsonl"
    assert not {"confidence_eos_eot_inf", "logits_eos_inf"} & set(record_lines(path)[0]["settings"])
    E.main(argv + ["--limit", "4"])  # continues the file
    assert [r["index"] for r in record_lines(path)] == [0, 1, 2, 3]
    with pytest.raises(SystemExit, match="confidence_eos_eot_inf None in the file, True now"):
        E.main(argv + ["--limit", "4", "--confidence-eos-eot-inf"])
    assert len(record_lines(path)) == 4  # nothing added
    E.main(argv + ["--out", str(tmp_path / "f.json"), "--limit", "2", "--confidence-eos-eot-inf", "--logits-eos-inf"])
    settings = record_lines(tmp_path / "f.jsonl")[0]["settings"]
    assert settings["confidence_eos_eot_inf"] is True and settings["logits_eos_inf"] is True


def test_eval_refuses_a_rerun_without_the_flags_over_records_made_with_them(tmp_path):
    """A setting recorded only when set, unset now, is a change too: a rerun without --confidence-eos-eot-inf over
    records made with it is refused naming it (longjob.read_records compares the settings both ways), not continued
    with generations of another sampler."""
    import eval as E
    from test_eval import record_lines
    from test_sample_eval_refusals import eval_argv
    argv = eval_argv(tmp_path, "--batch-size", "2")
    E.main(argv + ["--limit", "2", "--confidence-eos-eot-inf", "--logits-eos-inf"])
    with pytest.raises(SystemExit, match="confidence_eos_eot_inf True in the file, None now"):
        E.main(argv + ["--limit", "4", "--logits-eos-inf"])
    assert len(record_lines(tmp_path / "r.jsonl")) == 2  # nothing added
    E.main(argv + ["--limit", "4", "--confidence-eos-eot-inf", "--logits-eos-inf"])  # the same settings continue
    assert [r["index"] for r in record_lines(tmp_path / "r.jsonl")] == [0, 1, 2, 3]


def test_harness_generate_until_passes_the_turn_end(folder, monkeypatch):
    """The harness's GiftLM with confidence_eos_eot_inf (model_args, or harness.py's --confidence-eos-eot-inf)
    samples with the tokenizer's <|eot_id|> (it was not passed: the first generate_until raised)."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is optional: pip install -r requirements-extras.txt")
    from lm_eval.api.instance import Instance

    import data
    import harness as H
    calls = spy_on(monkeypatch, sample, "generate")
    lm = H.GiftLM(model=str(folder), gen_length=8, steps=4, block_length=8, confidence_eos_eot_inf=True)
    out = lm.generate_until([Instance("generate_until", {}, ("q: ok", {"until": []}), 0, ("t", 0, 1))])
    assert len(out) == 1
    (_, kw), = calls
    assert kw["confidence_eos_eot_inf"] and kw["eot_id"] == data.load_tokenizer(folder).token_to_id(data.EOT)
