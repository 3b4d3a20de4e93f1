"""GiftLM's generation lengths and temperature (harness.generation_options): each from model_args, else the task
(max_gen_toks, do_sample / temperature), else the model folder's generation_defaults.json, else d1's rule; what eval.py
and sample.py refuse is refused in one line naming the argument, before the model loads; a length of the task's is
generated in whole blocks and returned cut at max_gen_toks tokens. The sampler is replaced by a spy that records its
options and answers "a" at every position, so the tests see exactly what was asked and what came back. Skipped
without lm-eval (pip install -r requirements-extras.txt)."""

import json
import shutil

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is optional: pip install -r requirements-extras.txt")

from test_harness import requests_of  # noqa: E402  (it sets the offline variables)
from test_harness_checks import at_repo_root, folders, no_model  # noqa: E402, F401  (the fixtures)

import harness as H  # noqa: E402
from model import GENERATION_DEFAULTS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread


class Spy(list):
    """The options of each sampler call; lm: the GiftLM whose tokenizer spells the answers."""
    lm = None


@pytest.fixture
def spy(monkeypatch):
    """harness.generate_with_options replaced: each call's options recorded, every answer token "a"."""
    calls = Spy()

    def sampled(model, prompt, attention_mask, options, *_, **__):
        calls.append(options)
        a = calls.lm.tokenizer.token_to_id("a")
        return torch.cat([prompt, torch.full((len(prompt), options.gen_length), a)], 1)
    monkeypatch.setattr(H, "generate_with_options", sampled)
    return calls


def folder_with(tmp_path, folders, **defaults):
    """A copy of the tiny LLaDA folder with these generation_defaults.json settings (none: no file)."""
    folder = tmp_path / "model"
    shutil.copytree(folders["llada"][0], folder)
    if defaults:
        (folder / GENERATION_DEFAULTS).write_text(json.dumps(defaults))
    return folder


def answer(spy, folder, task_kwargs, **model_args):
    """(gen_length, steps, block_length, temperature) the sampler was asked for, and the length of the text returned,
    for one request of a task with these generation_kwargs (until: none)."""
    spy.clear()
    spy.lm = H.GiftLM(model=str(folder), dtype="float64", **model_args)
    (text,) = spy.lm.generate_until(requests_of("generate_until", [("q: hi", {"until": []} | task_kwargs)]))
    (o,) = spy
    assert set(text) == {"a"}
    return (o.gen_length, o.steps, o.block_length, o.temperature), len(text)


# each length source with each of gen_length / steps / block_length given alone (the task gives only gen_length):
# (folder's generation_defaults.json, the task's generation_kwargs, model_args) -> ((gen, steps, block, T), returned)
SOURCES = [
    ({}, {"max_gen_toks": 20}, {}, ((20, 10, 20, 0.0), 20)),  # the task alone: one block of 20, d1's 2 per step
    ({}, {"max_gen_toks": 40}, {}, ((64, 32, 32, 0.0), 40)),  # blocks of 32: 64 generated, 40 returned
    ({}, {"max_gen_toks": 20}, dict(gen_length=24), ((24, 12, 24, 0.0), 24)),  # model_args' length: all of it
    ({}, {"max_gen_toks": 20}, dict(steps=5), ((20, 5, 20, 0.0), 20)),
    ({}, {"max_gen_toks": 20}, dict(block_length=8), ((24, 12, 8, 0.0), 20)),  # whole blocks of 8, 20 returned
    (dict(gen_length=24), {"max_gen_toks": 20}, {}, ((20, 10, 20, 0.0), 20)),  # the task's length wins the folder's
    (dict(gen_length=24), {}, {}, ((24, 12, 24, 0.0), 24)),  # a task that names none: the folder's
    (dict(steps=5), {"max_gen_toks": 20}, {}, ((20, 5, 20, 0.0), 20)),
    (dict(block_length=8), {"max_gen_toks": 20}, {}, ((24, 12, 8, 0.0), 20)),
    (dict(gen_length=34, steps=34, block_length=34), {"max_gen_toks": 40}, {}, ((68, 34, 34, 0.0), 40)),  # embedded
    (dict(gen_length=34, steps=34, block_length=34), {"max_gen_toks": 40}, dict(gen_length=16, block_length=16),
     ((16, 34, 16, 0.0), 16)),  # model_args' lengths, the folder's steps (as eval.py keeps them under --gen-length)
]

@pytest.mark.parametrize("defaults, task, model_args, want", SOURCES, ids=[str(s[:3]) for s in SOURCES])
def test_each_length_comes_from_its_source(folders, tmp_path, spy, defaults, task, model_args, want):
    assert answer(spy, folder_with(tmp_path, folders, **defaults), task, **model_args) == want


def test_no_length_anywhere_is_lm_evals_256():
    """(The tiny model's context is 256 positions: no room for a prompt, so the options alone.)"""
    o, n = H.generation_options({}, {}, H.task_generation("t", {"until": []}))
    assert (o.gen_length, o.steps, o.block_length, n) == (256, 128, 32, 256)


TEMPERATURES = [  # (the folder's, the task's generation_kwargs, model_args) -> the temperature sampled at
    ({}, {}, {}, 0.0),
    ({}, {"do_sample": True, "temperature": 0.5}, {}, 0.5),
    ({}, {"temperature": 0.5}, {}, 0.5),  # lm-eval's models: do_sample follows a temperature > 0
    ({}, {"do_sample": False, "temperature": 0.5}, {}, 0.0),  # lm-eval's models: do_sample false is greedy
    ({}, {"do_sample": False}, dict(temperature=0.7), 0.7),  # model_args win (Dream's published commands)
    (dict(temperature=0.3), {}, {}, 0.3),
    (dict(temperature=0.3), {"do_sample": False}, {}, 0.0),  # the task's before the folder's
]


@pytest.mark.parametrize("defaults, task, model_args, want", TEMPERATURES, ids=[str(s[:3]) for s in TEMPERATURES])
def test_the_temperature_comes_from_its_source(folders, tmp_path, spy, defaults, task, model_args, want):
    got = answer(spy, folder_with(tmp_path, folders, **defaults), {"max_gen_toks": 8} | task, **model_args)
    assert got[0][3] == want


REFUSED_LENGTHS = [  # model_args eval.py and sample.py refuse: refused before the model loads, in one line
    (dict(gen_length=50), "GiftLM: gen_length=50 must be a multiple of block_length=32"),
    (dict(gen_length=64, block_length=48), "GiftLM: gen_length=64 must be a multiple of block_length=48"),
    (dict(gen_length=16, block_length=32), "GiftLM: block_length=32 is longer than gen_length=16"),
    (dict(gen_length=64, steps=3), "GiftLM: gen_length=64 must be a multiple of block_length=32, and steps=3 a "
                                   "multiple of the number of blocks 2"),
    (dict(gen_length=16, steps=32), "GiftLM: model_args: field 'steps' = 32: more steps than the 16 tokens"),
]


@pytest.mark.parametrize("model_args, message", REFUSED_LENGTHS, ids=[str(a) for a, _ in REFUSED_LENGTHS])
def test_lengths_eval_py_refuses_are_refused_before_loading(folders, model_args, message, no_model):
    with pytest.raises(ValueError) as info:
        H.GiftLM(model=str(folders["llada"][0]), **model_args)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


REFUSED_TASKS = [  # (model_args, the task's generation_kwargs) refused when the task's requests come, before sampling
    (dict(steps=7, block_length=8), {"max_gen_toks": 20},
     "GiftLM: gen_length=24 must be a multiple of block_length=8, and steps=7 a multiple of the number of blocks 3"),
    (dict(steps=32), {"max_gen_toks": 8}, "GiftLM: model_args: field 'steps' = 32: more steps than the 8 tokens"),
    ({}, {"max_gen_toks": 8, "do_sample": True}, "GiftLM: task 't': do_sample True with temperature None: sampling "
                                                 "needs a temperature > 0"),
    ({}, {"max_gen_toks": 8, "temperature": "hot"}, "GiftLM: task 't': temperature 'hot': must be 0 (greedy) or more"),
    ({}, {"max_gen_toks": 8, "do_sample": "yes"}, "GiftLM: task 't': do_sample 'yes': expected true or false"),
    ({}, {"max_gen_toks": 8, "top_p": 0.9}, "GiftLM: task 't': generation_kwargs top_p: not read by GiftLM"),
]


@pytest.mark.parametrize("model_args, task, message", REFUSED_TASKS, ids=[str(a[:2]) for a in REFUSED_TASKS])
def test_a_tasks_lengths_or_temperature_we_cannot_honour_are_refused(folders, spy, model_args, task, message):
    spy.lm = H.GiftLM(model=str(folders["llada"][0]), dtype="float64", **model_args)
    with pytest.raises(ValueError) as info:
        spy.lm.generate_until(requests_of("generate_until", [("q: ok", {"until": [], "max_gen_toks": 56}),
                                                              ("q: hi", {"until": []} | task)]))
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)
    assert not spy  # nothing was sampled


def test_harness_py_checks_each_tasks_lengths_before_loading(folders, tmp_path, capsys, no_model):
    """python harness.py: a task whose max_gen_toks the given lengths cannot meet is refused before the model loads."""
    from test_harness_checks import harness_argv, refusal, task_yaml
    task_yaml(tmp_path, "twenty", **{"max_gen_toks: 16": "max_gen_toks: 20"})
    argv = harness_argv(folders["llada"][0], "--steps", "7", "--block-length", "8", tasks="twenty", include=tmp_path)
    said = refusal(lambda: H.harness_main(argv), capsys)
    assert "GiftLM: gen_length=24 must be a multiple of block_length=8, and steps=7 a multiple" in said, said
