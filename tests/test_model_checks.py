"""Model folders, adapters and the sampler's inputs: save_pretrained writes its own files and touches nothing else; an
adapter names the base it was trained on wherever it is copied; a bf16 LoRA's merged export of a float32 base is
exact; generation_defaults.json and generate()'s tensors are checked before any slow work; per-row generators make a
row's tokens independent of the prompts beside it."""

import json
import shutil

import pytest
import torch
from conftest import U32, latest, tiny_model, train_args
from safetensors.torch import load_file, save_file
from test_dream_cli import tiny_dream
from test_fast_sampler import float64_model
from test_sample import left_pad
from test_sample_eval_refusals import model_folder, refusal, sample_argv, with_defaults

import embedded
import eval as E
import gift
import model as M
import sample
from adapters import load_adapter, save_adapter
from cached_sample import generate_cached
from dream import diffusion_generate
from longjob import check_adapter, folder_fingerprint
from model import LLaDA
from sample import SamplerOptions, generate

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread


# -----------------------------------------------------------------------------
# save_pretrained: its own files, nothing else (case 1)


def test_save_pretrained_writes_its_own_files_and_leaves_the_others(tmp_path, monkeypatch):
    """Saved into a folder holding a tokenizer and a user's notes, beside a user's folder named like a backup: only
    config.json and the weights are written, the rest untouched; a save of another shard count leaves none of the
    earlier save's weight files (an index left behind would make the folder load the old shards)."""
    folder, old = tmp_path / "m", tmp_path / "m.old"
    folder.mkdir()
    old.mkdir()
    theirs = {folder / "tokenizer.json": "{}", folder / "notes.txt": "my notes", old / "keep.txt": "mine"}
    for path, text in theirs.items():
        path.write_text(text)
    model = tiny_model(seed=1)
    weights = lambda: sorted(p.name for p in folder.glob("model*"))  # noqa: E731
    for max_shard_bytes, want in [(20_000, 6), (40_000, 3), (10**9, 1), (20_000, 6)]:
        model.save_pretrained(folder, max_shard_bytes=max_shard_bytes)
        assert all(path.read_text() == text for path, text in theirs.items())
        shards = [f"model-{i:05d}-of-{want:05d}.safetensors" for i in range(1, want + 1)]
        assert weights() == (["model.safetensors"] if want == 1 else shards + ["model.safetensors.index.json"])
        loaded = LLaDA.from_pretrained(folder)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "m.old"]  # no temporary folder left behind
    written = []

    def disk_full(tensors, path, metadata=None):  # the third shard cannot be written
        if len(written) == 2:
            raise OSError(28, "No space left on device")
        written.append(path)
        save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(M, "save_file", disk_full)
    with pytest.raises(OSError):  # a save that fails midway changes nothing
        tiny_model(seed=2).save_pretrained(folder, max_shard_bytes=40_000)
    assert torch.equal(LLaDA.from_pretrained(folder).model.transformer.wte.weight, model.model.transformer.wte.weight)
    assert weights() == [f"model-{i:05d}-of-00006.safetensors" for i in range(1, 7)] + ["model.safetensors.index.json"]


@pytest.mark.parametrize("save", [lambda m, path: m.save_pretrained(path),
                                  lambda m, path: save_adapter(M.add_lora(m, targets=("q_proj",)), path)],
                         ids=["save_pretrained", "save_adapter"])
def test_a_save_onto_a_users_file_is_one_line_and_leaves_nothing(tmp_path, save):
    """A path that is a user's file: refused in one line before any weight is written (no *.tmp-* copy left beside it),
    the file untouched."""
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    with pytest.raises(ValueError) as err:
        save(tiny_model(seed=1), path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    assert path.read_text() == "mine" and list(tmp_path.iterdir()) == [path]


# -----------------------------------------------------------------------------
# A bf16 LoRA run on a float32 base, with --save-merged (cases 2 and 3)


@pytest.fixture(scope="module")
def bf16_lora_run(base, tmp_path_factory):
    """One LoRA step on q_proj in bfloat16 on the float32 tiny base, exporting merged/: (base folder, checkpoint)."""
    root = tmp_path_factory.mktemp("bf16_lora")
    shutil.copytree(base / "model", root / "base")
    out = root / "run"
    gift.main(train_args(base, out, "--lora", "--lora-targets", "q_proj", "--dtype", "bfloat16", "--save-merged",
                         "--max-steps", "1") + ["--model", str(root / "base")])
    return root / "base", latest(out)


def test_a_copied_out_adapter_is_refused_on_another_base(bf16_lora_run, tmp_path, capsys):
    """The adapter names its base's fingerprint (the one the run computed at start, as trainer.json records it):
    copied out of its checkpoint it is still refused on the merged export or on another base, in one line naming
    both folders, and accepted on its base. An adapter without the record (PEFT's own) is not checked."""
    base, checkpoint = bf16_lora_run
    copied = shutil.copytree(checkpoint / "adapter", tmp_path / "copied")
    trained_on = json.loads((checkpoint / "trainer.json").read_text())["fingerprints"]["model"]
    assert trained_on == folder_fingerprint(base)
    check_adapter(base, copied)
    other = model_folder(tmp_path / "other", seed=5, n_heads=4)  # the base's shapes, other weights
    for model in (checkpoint / "merged", other):
        with pytest.raises(ValueError) as err:
            check_adapter(model, copied)
        assert f"--adapter {copied}: trained on a base model with fingerprint {trained_on}" in str(err.value)
        assert f"but {model} has fingerprint" in str(err.value) and "\n" not in str(err.value)
    said = refusal(lambda: sample.main(sample_argv(checkpoint / "merged", "--adapter", str(copied))), capsys)
    assert f"--adapter {copied}: trained on a base model" in said and str(checkpoint / "merged") in said
    save_adapter(load_adapter(LLaDA.from_pretrained(base), copied), tmp_path / "peft")  # no base recorded
    check_adapter(other, tmp_path / "peft")


@pytest.mark.bf16
def test_a_bf16_lora_merged_export_of_a_float32_base_is_exact(bf16_lora_run):
    """Trained in bfloat16, merged into the float32 base's own weights: a layer without LoRA is the base file's bit
    for bit (not rounded to bf16 and back), one with LoRA is W + B A alpha / r within float32 rounding."""
    base, checkpoint = bf16_lora_run
    W, merged = load_file(base / "model.safetensors"), load_file(checkpoint / "merged" / "model.safetensors")
    adapter = load_file(checkpoint / "adapter" / "adapter_model.safetensors")
    assert W.keys() == merged.keys() and all(t.dtype == torch.float32 for t in merged.values())
    adapted = 0
    for key, w in W.items():
        name = "base_model.model." + key.removesuffix(".weight")
        if f"{name}.lora_A.weight" not in adapter:
            assert torch.equal(merged[key], w), key
            continue
        A, B = adapter[f"{name}.lora_A.weight"].double(), adapter[f"{name}.lora_B.weight"].double()
        exact = w.double() + B @ A * (8 / 4)  # lora_alpha / r of train_args
        # float32: one rounding of B A's 4 products, one of the sum, a few ulps of the largest value
        torch.testing.assert_close(merged[key].double(), exact, rtol=0, atol=8 * U32 * float(exact.abs().max()))
        adapted += not torch.equal(merged[key], w)
    assert adapted == 2  # both blocks' q_proj moved


# -----------------------------------------------------------------------------
# generation_defaults.json: a misspelt key, absurd steps (case 4)


@pytest.mark.parametrize("text, fragments", [
    ('{"gen_lenght": 16}', ["field 'gen_lenght' is not a generation setting", "did you mean 'gen_length'?"]),
    ('{"steps": 16, "temprature": 0.5}', ["field 'temprature'", "did you mean 'temperature'?"]),
    ('{"steps": 200}', ["field 'steps' = 200: more steps than the 128 tokens to generate"]),  # sample.py's 128
    ('{"steps": 2.5}', ["field 'steps' = 2.5: expected an integer"]),
    ('{"steps": -3}', ["field 'steps' = -3: must be at least 1"]),
], ids=["misspelt", "misspelt_beside_steps", "steps_above_the_default_gen_length", "steps_not_whole", "negative"])
def test_generation_defaults_name_the_file_and_the_key(tmp_path, capsys, text, fragments):
    """sample.py refuses in one line, before the model loads, naming the file and the key."""
    folder = with_defaults(tmp_path, text)
    said = refusal(lambda: sample.main(["--model", str(folder), "--prompt", "hi"]), capsys)
    assert f"{folder / 'generation_defaults.json'}: " in said
    assert all(f in said for f in fragments), said


def test_eval_refuses_a_misspelt_generation_default(tmp_path, capsys):
    folder = with_defaults(tmp_path, '{"block_lenght": 8}')
    said = refusal(lambda: E.main(["--model", str(folder), "--task", "sudoku", "--data", "x.csv"]), capsys)
    assert "generation_defaults.json: field 'block_lenght' is not a generation setting" in said


# -----------------------------------------------------------------------------
# The samplers' tensors: ids within the vocabulary, prompt + answer within the context (case 5)


def counted(model):
    """The model, and the list its forward calls append to."""
    calls = []
    model.register_forward_pre_hook(lambda m, args: calls.append(1))
    return model, calls


@pytest.mark.parametrize("sampler", ["generate", "generate_cached", "diffusion_generate"])
def test_samplers_refuse_ids_outside_the_vocabulary_and_answers_past_the_context(sampler):
    if sampler == "diffusion_generate":
        model, _ = tiny_dream()
        model.config.max_sequence_length = 24
        run = lambda ids, n: diffusion_generate(model, ids, max_new_tokens=n, steps=n)  # noqa: E731
        name = "max_new_tokens"
    else:
        model = tiny_model(max_sequence_length=24).eval()
        opts = lambda n: dict(gen_length=n, steps=n, block_length=n)  # noqa: E731
        run = ((lambda ids, n: generate(model, ids, **opts(n))) if sampler == "generate" else  # noqa: E731
               (lambda ids, n: generate_cached(model, ids, options=SamplerOptions(**opts(n), cache="dual"))))
        name = "gen_length"
    model, calls = counted(model)
    V = model.config.embedding_size
    ok = torch.randint(0, model.config.eos_token_id, (2, 6), generator=torch.Generator().manual_seed(0))
    for bad, id_ in [(0, V), (1, -1)]:
        ids = ok.clone()
        ids[bad, 3] = id_
        where = dict(generate="sample.py", generate_cached="cached_sample.py", diffusion_generate="dream.py")[sampler]
        with pytest.raises(ValueError, match=rf"{where} {sampler}: prompt holds the token id {id_}, outside the "
                                             rf"model's vocabulary \(ids 0 .. {V - 1}"):
            run(ids, 8)
    with pytest.raises(ValueError, match=rf"the prompt's 6 tokens \+ {name}=20 exceed the model's context \(config "
                                         r"max_sequence_length 24\)"):
        run(ok, 20)
    assert calls == []  # refused before any forward pass
    assert run(ok, 18).shape == (2, 24)  # the whole context is allowed


# -----------------------------------------------------------------------------
# Per-row generators: a row's noise is its own, whatever the batch's padding (case 6)

SAMPLERS = {
    "gumbel": lambda m, ids, mask, g: generate(m, ids, mask, steps=8, gen_length=8, block_length=4, temperature=1.0,
                                               generator=g),
    "random_remasking": lambda m, ids, mask, g: generate(m, ids, mask, steps=8, gen_length=8, block_length=8,
                                                         temperature=0.5, remasking="random", generator=g),
    "cached": lambda m, ids, mask, g: generate_cached(m, ids, mask, SamplerOptions(
        steps=8, gen_length=8, block_length=4, temperature=1.0, cache="dual", threshold=0.6), generator=g),
    "cached_random": lambda m, ids, mask, g: generate_cached(m, ids, mask, SamplerOptions(
        steps=8, gen_length=8, block_length=4, temperature=0.7, remasking="random", cache="prefix"), generator=g),
}


@pytest.mark.numerics  # the same tokens under every CPU kernel set (.ci/run)
@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_a_rows_tokens_do_not_depend_on_the_prompts_beside_it(name, family):
    """float64: each prompt with its own generator gives the same answer alone (unpadded), beside longer or shorter
    prompts (left-padded by 0 to 9), in any order; the exact and the cached sampler, Gumbel noise and random
    remasking."""
    model = float64_model(3) if family == "llada" else tiny_dream(3, no_mask=True)[0]
    vocab = model.config.eos_token_id - 1 if family == "llada" else len(embedded.DREAM_CHAR_VOCAB)  # no special token
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in (3, 12, 7, 5)]
    seed = lambda i: torch.Generator().manual_seed(100 + i)  # noqa: E731  the prompt's own generator

    def answers(order):
        ids, mask = left_pad([prompts[i] for i in order])
        out = SAMPLERS[name](model, ids, mask, [seed(i) for i in order])
        return {i: out[r, ids.shape[1]:] for r, i in enumerate(order)}

    alone = {i: SAMPLERS[name](model, p[None], None, [seed(i)])[0, len(p):] for i, p in enumerate(prompts)}
    for order in ([0, 1], [1, 0, 2], [3, 2, 1, 0], [2, 3]):
        for i, answer in answers(order).items():
            assert torch.equal(answer, alone[i]), (order, i)
    assert len({tuple(a.tolist()) for a in alone.values()}) > 1  # the answers differ: the noise reached them
