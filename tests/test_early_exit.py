"""The block samplers' early exit (sample.generate's stop_ids, SamplerOptions.early_exit): a row leaves the batch once
the blocks it has finished hold its first stop token with nothing masked before it. Its text up to that stop is then
final (the sampler never changes an unmasked token), so every row's text up to its first stop equals the text without
the option, and its ids after the stop come back as EOS. Checked in float64 (no rounding can flip a token between the
two batch shapes) for every block-sampler mode, LLaDA and Dream, several prompts, lengths, batch sizes and paddings."""

import pytest
import torch
from test_dream_cli import tiny_dream
from test_sample import EOS, left_pad, tiny_model
from torch import nn

from cached_sample import generate_with_options
from sample import SamplerOptions, eos_after_stop, generate

EOT = 45  # a second stop token of the LLaDA test vocabulary (its <|eot_id|>)

MODES = {  # name: SamplerOptions fields besides the lengths
    "exact": {},
    "prefix": dict(cache="prefix"),
    "dual": dict(cache="dual"),
    "threshold": dict(threshold=0.3),
    "window": dict(cache="dual", cache_window=4),
    "prefix_window_cfg": dict(cache="prefix", cache_window=4, cfg_scale=0.5),
    "dual_threshold_drift": dict(cache="dual", threshold=0.5, cache_drift=0.9),
}


class StopBiasHead(nn.Module):
    """The LM head with the stop tokens' logits raised by `bias` and the mask's (`mask_bias`): a random model then ends
    its answers at various positions, and sometimes proposes the mask itself (a mask left in a finished block)."""

    def __init__(self, head, stops, bias, mask_id, mask_bias):
        super().__init__()
        self.head, self.stops, self.bias, self.mask_id, self.mask_bias = head, stops, bias, mask_id, mask_bias

    def forward(self, h):
        logits = self.head(h).clone()
        logits[..., self.stops] += self.bias
        logits[..., self.mask_id] += self.mask_bias
        return logits


def model_and_stops(family, seed, bias=2.0, mask_bias=0.0):
    if family == "llada":
        model, stops = tiny_model(seed).double(), [EOT, EOS]
    else:
        model, tokenizer = tiny_dream(seed)
        stops = [tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
    t = model.model.transformer
    t.ff_out = StopBiasHead(t.ff_out, stops, bias, model.config.mask_token_id, mask_bias)
    return model, stops


def prompts(family, B, seed):
    g = torch.Generator().manual_seed(seed)
    high = EOT if family == "llada" else 45  # ordinary tokens (below the special ones)
    return left_pad([torch.randint(1, high, (int(n),), generator=g) for n in torch.randint(2, 9, (B,), generator=g)])


def text_until_stop(row, stops):
    """A row's answer ids up to and including its first stop token."""
    ends = [i for i, t in enumerate(row) if t in stops]
    return row[:ends[0] + 1] if ends else row


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("mode", list(MODES))
def test_the_text_up_to_the_first_stop_is_the_same(family, mode):
    left_early = ran_on = 0
    for seed, (B, gen_length, block, steps, temperature) in enumerate(
            [(1, 16, 4, 8, 0.0), (3, 24, 8, 12, 0.0), (5, 24, 4, 12, 0.0), (4, 16, 4, 16, 0.8)]):
        model, stops = model_and_stops(family, seed)
        ids, attention_mask = prompts(family, B, seed)
        options = SamplerOptions(gen_length=gen_length, steps=steps, block_length=block, temperature=temperature,
                                 **MODES[mode])
        gens = lambda: [torch.Generator().manual_seed(100 + b) for b in range(B)] if temperature else None  # noqa: E731
        without = generate_with_options(model, ids, attention_mask, options, gens())
        stats = {}
        with_exit = generate_with_options(model, ids, attention_mask, options, gens(), stop_ids=stops, stats=stats)
        P = ids.shape[1]
        for a, b in zip(without[:, P:].tolist(), with_exit[:, P:].tolist()):
            head = text_until_stop(a, stops)
            assert b[:len(head)] == head
            assert all(t == model.config.eos_token_id for t in b[len(head):])
        assert torch.equal(with_exit, eos_after_stop(without.clone(), P, torch.tensor(stops),
                                                     model.config.eos_token_id))
        left_early += stats.get("skipped", 0) > 0
        ran_on += any(len(text_until_stop(r, stops)) > block for r in without[:, P:].tolist())
    assert left_early >= 2 and ran_on >= 2  # the cases test something: rows left early, and rows went on


def test_official_calls_are_unchanged_and_a_shared_generator_is_refused():
    """Without stop_ids generate() is the official loop (the golden tests pin its tokens); with random draws on a
    batch the early exit needs a generator per row, since one generator's draws span the batch."""
    model, stops = model_and_stops("llada", 0)
    ids, attention_mask = prompts("llada", 3, 0)
    kw = dict(steps=8, gen_length=16, block_length=4, temperature=0.5)
    with pytest.raises(ValueError, match="one generator per row"):
        generate(model, ids, attention_mask, generator=torch.Generator().manual_seed(0), stop_ids=stops, **kw)
    one = generate(model, ids[:1], attention_mask[:1], generator=torch.Generator().manual_seed(0), stop_ids=stops, **kw)
    alone = generate(model, ids[:1], attention_mask[:1], generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(one, eos_after_stop(alone.clone(), ids.shape[1], torch.tensor(stops), EOS))


def test_dreams_own_sampler_refuses_it_by_name(capsys):
    import sample
    model, _ = model_and_stops("dream", 0)
    ids, attention_mask = prompts("dream", 2, 0)
    with pytest.raises(ValueError, match="early_exit with sampler 'dream'"):
        generate_with_options(model, ids, attention_mask, SamplerOptions(sampler="dream", gen_length=8, steps=8,
                                                                         early_exit=True), stop_ids=[45])
    with pytest.raises(SystemExit):  # the flag: check_sampler_choice names it
        sample.parse_args(["--model", "x", "--sampler", "dream", "--early-exit"])
    assert "--early-exit" in capsys.readouterr().err
    options = sample.options_from_flags(sample.make_parser().parse_args(["--model", "x", "--no-early-exit"]))
    assert options.early_exit is False


def test_evaluate_counts_skipped_tokens_and_grades_the_same():
    """eval.evaluate samples with the early exit when asked (early_exit=True; off by default: tests/test_exit_grades.py):
    here the same graded records, the answer tokens it generated and skipped counted (together every item's
    gen_length)."""
    import eval as E
    from test_eval import _countdown_items, tiny_model_and_tokenizer
    items = _countdown_items()
    model, tokenizer = tiny_model_and_tokenizer("".join(it["question"] for it in items))
    model = model.double()
    t = model.model.transformer
    stops = sample_stop_ids(tokenizer)
    t.ff_out = StopBiasHead(t.ff_out, stops, 3.0, model.config.mask_token_id, 0.0)
    runs = {}
    for early_exit in (True, False):
        run = E.SeedRun()
        o = SamplerOptions(gen_length=32, steps=16, block_length=4, early_exit=early_exit)
        runs[early_exit] = E.evaluate(model, tokenizer, items, "countdown", o, batch_size=3, prompt_style="plain",
                                      run=run), run.tokens
    (acc, records), tokens = runs[True]
    (acc_off, records_off), tokens_off = runs[False]
    assert acc == acc_off and [r["correct"] for r in records] == [r["correct"] for r in records_off]
    assert tokens["skipped"] > 0 and tokens_off == dict(generated=len(items) * 32, skipped=0)
    assert tokens["generated"] + tokens["skipped"] == len(items) * 32


def sample_stop_ids(tokenizer):
    from sample import stop_ids
    return stop_ids(tokenizer)
