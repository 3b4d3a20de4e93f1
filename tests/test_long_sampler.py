"""The cached sampler on long answers (bench/long_sampler.py, experiments/longform.py): refreshed at every step it is
the exact sampler over many blocks, with every option (the windowed rebuild, SamplerOptions.cache_window, included),
for LLaDA and Dream; the windowed rebuild writes exactly the window; the new option is checked where the options are;
the long-answer task's grader on exact cases; the bench's --smoke and --gpu --smoke."""

import contextlib
import functools
import sys
from pathlib import Path

import pytest
import torch
from test_dream_cli import tiny_dream
from test_sample import EOS, no_mask_model

import sample
from sample import SamplerOptions, generate
from cached_sample import KVCache, generate_cached

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
sys.path.insert(0, str(REPO / "bench"))
import long_sampler  # noqa: E402
import longform  # noqa: E402

LONG = dict(gen_length=256, steps=128, block_length=32)  # 8 blocks, d1's steps = length / 2
WHOLE = 10 ** 6  # a window that covers any sequence here
# the cached options refreshed at every step, each with the exact sampler's tokens (a window covering the sequence
# is a full rebuild written into the cache; the drift test only adds rebuilds of rows already rebuilt)
EXACT_WHEN_REFRESHED = {"dual+refresh": dict(cache="dual", cache_refresh=1),
                        "dual+window": dict(cache="dual", cache_refresh=1, cache_window=WHOLE),
                        "prefix+window": dict(cache="prefix", cache_refresh=1, cache_window=WHOLE),
                        "dual+window+drift": dict(cache="dual", cache_refresh=1, cache_window=WHOLE, cache_drift=0.9)}


def prompts(B, P, seed, high=EOS):
    return torch.randint(0, high, (B, P), generator=torch.Generator().manual_seed(seed))


@functools.cache
def long_case(family):
    """(model, prompt, the exact sampler's tokens) of gen 256 in 8 blocks of 32, float64 (no near-tie flips), a model
    that never proposes the mask (so every block ends unmasked); computed once for the tests below."""
    model = tiny_dream(no_mask=True)[0] if family == "dream" else no_mask_model(seed=2).double()
    ids = prompts(1, 6, seed=5, high=40)
    with threads(1):
        return model, ids, generate(model, ids, **LONG)


@contextlib.contextmanager
def threads(n):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("option", list(EXACT_WHEN_REFRESHED))
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_refreshed_every_step_it_is_the_exact_sampler_on_a_long_answer(family, option, one_thread):
    """Every cached option, refreshed at every step, gives the exact sampler's tokens over 8 blocks; for Dream too
    (its span runs from one position before the block, and the windowed rebuild writes that position), through
    generate_cached (--sampler block, the paper's protocol for Dream)."""
    model, ids, exact = long_case(family)
    cached = generate_cached(model, ids, options=SamplerOptions(**EXACT_WHEN_REFRESHED[option], **LONG))
    assert torch.equal(cached, exact)


@pytest.mark.parametrize("refresh", [None, 2])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_window_covering_the_sequence_is_the_full_rebuild(cache, refresh, one_thread):
    """A windowed rebuild whose window covers the sequence writes every position's fresh keys and values: the
    steps that read the cache then see what a full rebuild left there, and the tokens are the unwindowed sampler's,
    whatever the rebuild schedule (without the write they would read the block's first step of an earlier block)."""
    model, ids, _ = long_case("llada")
    kw = dict(cache=cache, cache_refresh=refresh, **LONG)
    windowed = generate_cached(model, ids, options=SamplerOptions(cache_window=WHOLE, **kw))
    assert torch.equal(windowed, generate_cached(model, ids, options=SamplerOptions(**kw)))


def test_a_small_window_is_not_the_exact_sampler(one_thread):
    """The check above can fail: a window of one block leaves the prompt's keys and values as the first block's
    step built them, and the tokens move (this random model is sensitive to its whole context)."""
    model, ids, exact = long_case("llada")
    windowed = generate_cached(model, ids, options=SamplerOptions(cache="dual", cache_refresh=1, cache_window=32,
                                                                  **LONG))
    assert not torch.equal(windowed, exact)


@pytest.mark.parametrize("shifted", [False, True], ids=["llada", "dream"])
def test_the_windowed_rebuild_writes_the_window_and_keeps_the_rest(shifted, one_thread):
    """A span forward with write set: the span's keys and values are those a plain span forward computes from the
    same cache, written into it; every other position keeps its cached ones; the hidden states are the plain span
    forward's."""
    model = tiny_dream()[0] if shifted else no_mask_model(seed=3).double()
    x = prompts(2, 40, seed=1, high=40)
    cache = KVCache()
    model(x, return_hidden=True, cache=cache)
    x2 = x.clone()
    x2[:, 10:30] = prompts(2, 20, seed=9, high=40)  # the tokens change inside the span
    before = [(k.clone(), v.clone()) for k, v in cache.layers]
    cache.start = 10
    plain = model(x2[:, 10:30], return_hidden=True, cache=cache)
    cache.write = True
    written = model(x2[:, 10:30], return_hidden=True, cache=cache)
    assert torch.equal(written, plain)
    for (k, v), (k0, v0) in zip(cache.layers, before):
        assert torch.equal(k[:, :, :10], k0[:, :, :10]) and torch.equal(v[:, :, 30:], v0[:, :, 30:])
        assert not torch.equal(k[:, :, 10:30], k0[:, :, 10:30])
    # layer 0's keys depend on the token and its position only: those written are a fresh forward's
    full = KVCache()
    model(x2, return_hidden=True, cache=full)
    assert torch.allclose(cache.layers[0][0][:, :, 10:30], full.layers[0][0][:, :, 10:30], rtol=0, atol=1e-12)


def test_the_window_is_checked_where_the_options_are():
    """cache_window: a whole number >= 1 with a cache; refused in one line where SamplerOptions is built, by a
    command line or a library call; --cache-window is a flag of sample.py and eval.py."""
    for bad in (dict(cache_window=32), dict(cache="dual", cache_window=0), dict(cache="dual", cache_window=2.5)):
        with pytest.raises(ValueError, match="--cache-window"):
            SamplerOptions(**bad, source="flags")  # as the command lines build them
        with pytest.raises(ValueError, match="cache_window="):
            generate_cached(no_mask_model(), prompts(1, 3, 0), options=SamplerOptions(**bad, **LONG))
    SamplerOptions(cache="prefix", cache_window=32)
    assert "cache_window" in sample.BLOCK_ONLY  # --sampler dream refuses it (check_sampler_choice)
    import eval as E
    for parser in (sample.make_parser(), E.make_parser()):
        flag, = (a for a in parser._actions if a.dest == "cache_window")
        assert flag.option_strings == ["--cache-window"] and flag.type is int and flag.default is None


# -----------------------------------------------------------------------------
# The long-answer task and the bench


def test_the_trace_and_its_grader_on_exact_cases():
    assert longform.trace("381940", 7) == "01: 819403\n02: 194038\n03: 940381\n04: 403819\n05: 038194\n06: 381940\n" \
                                          "07: 819403"
    assert longform.trace("000001", 2) == "01: 000010\n02: 000100"
    ref = longform.trace("123456", 21)
    assert len(ref) == 21 * 11 - 1 and ref.split("\n")[-1] == "21: 456123"  # 21 = 3 (mod 6)
    assert longform.grade(ref, "123456", 21) == (21, 21, True)
    assert longform.grade(ref + "\n", "123456", 21) == (21, 21, True)  # whitespace around is stripped
    lines = ref.split("\n")
    # graded step by step: a slip in line 6 costs line 6 and the link to line 7; lines 8.. follow line 7 again
    assert longform.grade("\n".join(lines[:5] + ["06: 123465"] + lines[6:]), "123456", 21) == (19, 21, False)
    # a miscopied first line, then every step right from it: only line 1 is wrong
    assert longform.grade(longform.trace("923456", 21), "123456", 21) == (20, 21, False)
    assert longform.grade("\n".join(lines[:5] + ["05: 123456"] + lines[6:]), "123456", 21) == (20, 21, False)
    assert longform.grade("\n".join(lines[:20]), "123456", 21) == (20, 21, False)  # a line missing
    assert longform.grade(ref + "\n22: 561234", "123456", 21) == (21, 21, False)  # a line too many
    assert longform.grade("\n".join(lines[1:]), "123456", 21) == (0, 21, False)  # shifted by a line: all wrong
    assert longform.grade("", "123456", 21) == (0, 21, False)


def test_the_split_and_the_accuracy_interval():
    train, heldout = longform.items("train"), longform.items("heldout")
    assert len(train) == 2000 and len(heldout) == 100 and heldout == longform.items("heldout")
    assert not {i["s"] for i in train} & {i["s"] for i in heldout}
    assert all(18 <= i["n"] <= 22 and len(longform.trace(i["s"], i["n"])) < 256 for i in train + heldout)
    # two items of 20 lines, 10 and 20 right: 75%; the ratio estimator's residuals -5, +5: variance 50 / (k - 1),
    # se = sqrt(50 / 2) / 20 lines
    acc, half, whole = longform.accuracy([dict(lines=10, n=20, exact=False), dict(lines=20, n=20, exact=True)])
    assert acc == 75.0 and whole == 50.0 and half == pytest.approx(100 * 1.96 * 5 / 20)


def test_the_pareto_front():
    rows = [dict(speedup=1, acc=90), dict(speedup=5, acc=90), dict(speedup=3, acc=95), dict(speedup=2, acc=80)]
    long_sampler.pareto(rows)
    assert [r["front"] for r in rows] == [False, True, True, False]


def test_the_bench_smoke(tmp_path, one_thread):
    rows = long_sampler.main(["--smoke", "--out-dir", str(tmp_path)])
    assert {r["length"] for r in rows} == {64, 128} and rows[0]["speedup"] == 1.0
    assert (tmp_path / "long_sampler-smoke.md").is_file() and (tmp_path / "long_sampler-smoke.json").is_file()
    rows = long_sampler.main(["--gpu", "--smoke", "--out-dir", str(tmp_path)])
    assert {r["table"] for r in rows} == {"settings", "exact sweep"}
    assert (tmp_path / "long_sampler-gpu-smoke.md").is_file()


def test_each_length_has_its_committed_model_and_a_length_without_one_is_refused(capsys):
    """bench/long_sampler.py's lengths each read the model trained at that length (longform.MODELS): it is there in
    the clone, answers the task's prompts within its context, and reads them with the task's tokenizer; a length with
    no model is refused in one line unless --model names one."""
    from data import load_tokenizer
    from model import LLaDAConfig
    assert set(longform.MODELS) == set(long_sampler.LENGTHS)
    item = longform.items("heldout")[0]
    for length, folder in longform.MODELS.items():
        config = LLaDAConfig.from_json(folder / "config.json")
        ids = longform.prompt_ids(load_tokenizer(folder), item)
        assert len(ids) + length <= config.max_sequence_length and max(ids) < config.vocab_size
    with pytest.raises(SystemExit):
        long_sampler.parse_args(["--lengths", "384"])
    assert "no model trained at [384]" in capsys.readouterr().err
    assert long_sampler.parse_args(["--lengths", "384", "--model", str(longform.MODEL_DIR)]).lengths == (384,)
