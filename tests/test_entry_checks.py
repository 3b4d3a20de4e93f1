"""Issue 37, items 2d and 4: sample.py and eval.py (and gift.py where it shares the case) refuse a user's mistake in
one line, before the model's weights load: adapter_config.json's fields, a folder given to the wrong flag, a tokenizer
larger than the model, a `latest` file pointing elsewhere, sampler lengths and --shots; Ctrl-C and a full disk end in
one line; a checkpoint saved again at its step keeps a user's files. Each test fails on the code before the fix."""

import json
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import latest, train_args
from test_eval import sudoku_checkpoint
from test_sample_eval_refusals import model_folder, sample_argv

import adapters
import data
import eval as E
import longjob
import gift
import model as model_py
import sample
from adapters import save_adapter
from model import LLaDA, add_lora

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread


@pytest.fixture
def no_weights(monkeypatch):
    """The weights must not load: every check under test comes before them."""
    def refuse(*_, **__):
        raise AssertionError("the weights loaded before the check")
    monkeypatch.setattr(sample, "load_weights", refuse)
    monkeypatch.setattr(E, "load_weights", refuse)


def refusal(call, capsys):
    """The one-line message of a refused call (argparse's SystemExit, or the ValueError / OSError a command line's
    run_command_line prints in one line)."""
    with pytest.raises((SystemExit, ValueError, OSError)) as info:
        call()
    said = f"{info.value} {capsys.readouterr().err}".strip()
    assert "Traceback" not in said
    return said


def adapter_folder(tmp, **changes):
    """A tiny model folder tmp/m and a LoRA adapter on it, tmp/a, whose adapter_config.json gets `changes`."""
    base = model_folder(tmp / "m")
    model = add_lora(LLaDA.from_pretrained(base), r=2, alpha=4, dropout=0.0)
    save_adapter(model, tmp / "a", base_model_name_or_path=str(base))
    cfg = json.loads((tmp / "a" / "adapter_config.json").read_text())
    (tmp / "a" / "adapter_config.json").write_text(json.dumps(cfg | changes))
    return base, tmp / "a"


# -----------------------------------------------------------------------------
# 2d: one check of adapter_config.json

BAD_ADAPTER_CONFIGS = [
    ("r", 0), ("r", "4"), ("r", True), ("r", 2.5), ("lora_alpha", math.nan), ("lora_alpha", math.inf),
    ("lora_alpha", 0), ("lora_alpha", "8"), ("lora_alpha", True), ("target_modules", []), ("target_modules", 5),
    ("target_modules", ["q_proj", 1]), ("lora_dropout", 1.0), ("lora_dropout", -0.1), ("lora_dropout", "0"),
    ("rank_pattern", {"q_proj": 0}), ("alpha_pattern", {"q_proj": math.nan}), ("rank_pattern", [1]),
    ("use_dora", True),
]


@pytest.mark.parametrize("field,value", BAD_ADAPTER_CONFIGS, ids=[f"{f}={v!r}" for f, v in BAD_ADAPTER_CONFIGS])
def test_sample_refuses_an_adapter_config_field_before_the_weights(tmp_path, capsys, no_weights, field, value):
    base, adapter = adapter_folder(tmp_path, **{field: value})
    said = refusal(lambda: sample.main(sample_argv(base, "--adapter", str(adapter))), capsys)
    assert str(adapter / "adapter_config.json") in said.splitlines()[-1] and field in said.splitlines()[-1]


def test_eval_and_load_adapter_refuse_a_nan_lora_alpha(tmp_path, capsys, no_weights):
    argv = sudoku_checkpoint(tmp_path, 2)
    model = add_lora(LLaDA.from_pretrained(tmp_path / "ckpt"), r=2, alpha=4, dropout=0.0)
    save_adapter(model, tmp_path / "a", base_model_name_or_path=str(tmp_path / "ckpt"))
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(cfg | {"lora_alpha": math.nan}))
    said = refusal(lambda: E.main(argv + ["--adapter", str(tmp_path / "a")]), capsys)
    assert "lora_alpha" in said and "adapter_config.json" in said
    with pytest.raises(ValueError, match="adapter_config.json.*lora_alpha"):
        adapters.load_adapter(LLaDA.from_pretrained(tmp_path / "ckpt"), tmp_path / "a")


def test_an_adapter_config_that_is_not_json_is_one_line(tmp_path, capsys, no_weights):
    base, adapter = adapter_folder(tmp_path)
    (adapter / "adapter_config.json").write_text("{r: 2")
    said = refusal(lambda: sample.main(sample_argv(base, "--adapter", str(adapter))), capsys)
    assert str(adapter / "adapter_config.json") in said and "JSON" in said


# -----------------------------------------------------------------------------
# 4: a folder given to the wrong flag


def test_adapter_given_a_model_folder(tmp_path, capsys, no_weights):
    base = model_folder(tmp_path / "m")
    other = model_folder(tmp_path / "other")
    said = refusal(lambda: sample.main(sample_argv(base, "--adapter", str(other))), capsys)
    assert "model folder" in said and f"--model {other}" in said
    argv = sudoku_checkpoint(tmp_path, 2)
    said = refusal(lambda: E.main(argv + ["--adapter", str(other)]), capsys)
    assert "model folder" in said and f"--model {other}" in said


def test_model_given_an_adapter_folder(tmp_path, capsys, no_weights):
    base, adapter = adapter_folder(tmp_path)
    said = refusal(lambda: sample.main(sample_argv(adapter)), capsys)
    assert "LoRA adapter" in said and f"--adapter {adapter}" in said and f"--model {base}" in said


def test_gift_model_given_a_run_or_an_adapter_folder(base, tmp_path, capsys):
    run = tmp_path / "run"
    gift.main(train_args(base, run, "--max-steps", "1"))
    for wrong, fragments in [(run, ["a gift.py run", "--resume"]),
                             (adapter_folder(tmp_path)[1], ["LoRA adapter", "--model"]),
                             (latest(run), ["gift.py checkpoint", f"--model {latest(run) / 'model'}"])]:
        args = train_args(base, tmp_path / "run2", "--max-steps", "1")
        args[args.index("--model") + 1] = str(wrong)
        said = refusal(lambda: gift.main(args), capsys)
        assert all(f in said for f in fragments), said
        assert not (tmp_path / "run2").exists()


# -----------------------------------------------------------------------------
# 4: ids at or beyond the embedding


def test_a_tokenizer_larger_than_the_models_embedding(tmp_path, capsys, no_weights):
    folder = model_folder(tmp_path / "m")
    size = json.loads((folder / "config.json").read_text())["embedding_size"]
    tokenizer = data.load_tokenizer(folder)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(size - tokenizer.get_vocab_size() + 3)])
    tokenizer.save(str(folder / "tokenizer.json"))
    said = refusal(lambda: sample.main(sample_argv(folder)), capsys)
    assert str(tokenizer.get_vocab_size()) in said and str(size) in said and "embedding" in said


@pytest.mark.parametrize("command", ["sample", "eval", "gift"])
def test_an_eos_the_tokenizer_reads_as_a_digit_is_refused_before_the_weights(tmp_path, capsys, no_weights, command):
    """config.json's eos_token_id on the ordinary token '3' (every 3 would end a generation, and pads would be 3s):
    sample.py, eval.py and gift.py refuse it in one line naming config.json's field, before any weight is read."""
    folder = model_folder(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    digit = data.load_tokenizer(folder).token_to_id("3")
    (folder / "config.json").write_text(json.dumps(config | {"eos_token_id": digit}))
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "say hi", "response": "hi"}) + "\n")
    argv = {"sample": sample_argv(folder), "gift": train_args(tmp_path, tmp_path / "run") + ["--model", str(folder)],
            "eval": sudoku_checkpoint(tmp_path, 2) + ["--out", str(tmp_path / "r.json")]}[command]
    if command == "eval":
        argv[argv.index("--model") + 1] = str(folder)
    main = dict(sample=sample.main, eval=E.main, gift=gift.main)[command]
    said = refusal(lambda: main(argv), capsys).strip().splitlines()  # eval.py's: argparse's usage, then the error
    assert f"config.json field 'eos_token_id' = {digit} is the tokenizer's ordinary token '3'" in said[-1], said
    assert len(said) == 1 or command == "eval" and ": error: " in said[-1], said


# -----------------------------------------------------------------------------
# 4: Ctrl-C and a full disk


def interrupted(call):
    """The exit status of call() through run_command_line when a KeyboardInterrupt is raised inside."""
    try:
        call()
    except SystemExit as e:
        return e.code
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    return None


def test_ctrl_c_in_sample_is_one_line_and_status_130(tmp_path, capsys, monkeypatch):
    folder = model_folder(tmp_path / "m")

    def press(*_, **__):
        raise KeyboardInterrupt
    monkeypatch.setattr(sample, "generate_with_options", press)
    code = interrupted(lambda: longjob.run_command_line(lambda: sample.main(sample_argv(folder)), "sample.py"))
    err = capsys.readouterr().err
    assert code == 130 and len(err.strip().splitlines()) == 1 and "sample.py" in err and "Traceback" not in err


def test_ctrl_c_in_eval_keeps_the_records_and_is_one_line(tmp_path, capsys, monkeypatch):
    argv = sudoku_checkpoint(tmp_path, 4) + ["--batch-size", "2", "--out", str(tmp_path / "r.json")]
    real, calls = E.generate_with_options, []

    def second_press(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)
    monkeypatch.setattr(E, "generate_with_options", second_press)
    code = interrupted(lambda: longjob.run_command_line(lambda: E.main(argv), "eval.py"))
    err = capsys.readouterr().err
    assert code == 130 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert str(tmp_path / "r.jsonl") in err  # where the graded items are, to continue from
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 2  # the first batch's records stay


def test_a_full_disk_names_the_file_being_written(tmp_path, monkeypatch):
    def full(self, *_, **__):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError, match=f"{tmp_path / 'status.json'}.*No space left"):
        model_py.atomic_write_text(tmp_path / "status.json", "{}")
    monkeypatch.undo()
    out = tmp_path / "r.json"
    args = E.parse_args(sudoku_checkpoint(tmp_path, 2) + ["--out", str(out)])[1]
    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError, match=f"{out}.*No space left"):
        E.report(args, {}, 1, [dict(seed=0, accuracy=50.0, records=[])], out, tmp_path / "r.jsonl")
    monkeypatch.undo()

    class FullFile:  # metrics.jsonl, appended to at every logged step
        name = str(tmp_path / "metrics.jsonl")

        def write(self, text):
            raise OSError(28, "No space left on device")
    record = dict(step=1, total_steps=2, epoch=0, loss=1.0, lr=1e-3, grad_norm=1.0, masked_fraction=0.5,
                  skipped_steps=0, tokens_per_s=1.0, elapsed_s=1.0, eta_s=1.0)
    with pytest.raises(OSError, match=f"{tmp_path / 'metrics.jsonl'}: No space left"):
        longjob.log(FullFile(), record)


# -----------------------------------------------------------------------------
# 4: a `latest` file that points outside the run folder


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_latest_outside_the_run_folder_is_refused(tmp_path, capsys, no_weights, how):
    argv = sudoku_checkpoint(tmp_path, 2)  # tmp/ckpt: a model folder, outside the run folder
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "latest").write_text(("../../ckpt" if how == "relative" else str(tmp_path / "ckpt")) + "\n")
    said = refusal(lambda: sample.main(sample_argv(run)), capsys)
    assert "outside" in said and str(run / "latest") in said
    argv[argv.index("--model") + 1] = str(run)
    said = refusal(lambda: E.main(argv), capsys)
    assert "outside" in said and str(run / "latest") in said


# -----------------------------------------------------------------------------
# 4: sampler lengths and --shots, before the model loads


@pytest.mark.parametrize("flags,fragment", [
    (["--gen-length", "8", "--block-length", "3", "--steps", "8"], "multiple of --block-length"),
    (["--gen-length", "8", "--block-length", "4", "--steps", "3"], "number of blocks"),
    (["--gen-length", "8", "--block-length", "16", "--steps", "8"], "longer than --gen-length"),
    (["--gen-length", "128", "--block-length", "8", "--steps", "128"], "no room for a prompt"),
    (["--gen-length", "120", "--block-length", "8", "--steps", "120"], "max_sequence_length 128"),  # with the prompt
])
def test_sample_checks_its_lengths_before_the_model_loads(tmp_path, capsys, no_weights, flags, fragment):
    folder = model_folder(tmp_path / "m", max_sequence_length=128)
    said = refusal(lambda: sample.main(sample_argv(folder) + flags), capsys)  # later flags win
    assert fragment in said


def test_eval_checks_shots_and_context_before_the_model_loads(tmp_path, capsys, no_weights):
    argv = sudoku_checkpoint(tmp_path, 2, max_sequence_length=32)
    import embedded
    shots = tmp_path / "shots.csv"  # 2 puzzles of another split (a copy of the test file is refused: test_eval_leaks.py)
    pairs, _ = embedded.sudoku_split(2, 0, n_blanks=6, seed=11)
    shots.write_text("Puzzle,Solution\n" + "".join(f"{p},{s}\n" for p, s in pairs))
    said = refusal(lambda: E.main(argv + ["--shots", "3", "--shot-data", str(shots)]), capsys)
    assert "--shots 3" in said and "2 items" in said
    said = refusal(lambda: E.main(argv + ["--shots", "-1", "--shot-data", str(shots)]), capsys)
    assert "--shots -1" in said
    # the shots' "Question:" is not in the Sudoku model's alphabet: said in one line, not a tokenizer's exception
    said = refusal(lambda: E.main(argv + ["--shots", "1", "--shot-data", str(shots)]), capsys)
    assert "--shots 1: the few-shot prompt" in said
    said = refusal(lambda: E.main(argv), capsys)  # a 24-token answer and a plain prompt do not fit 32 tokens
    assert "max_sequence_length 32" in said


# -----------------------------------------------------------------------------
# A checkpoint saved again at its step keeps a user's files


def test_a_checkpoint_saved_again_at_its_step_keeps_a_users_files(base, tmp_path, capsys):
    out = tmp_path / "run"
    gift.main(train_args(base, out, "--save-every", "1", "--max-steps", "2", "--keep-last", "2"))
    step2 = latest(out)
    (step2 / "eval.json").write_text("beside model/")
    (step2 / "model" / "notes.txt").write_text("inside model/")
    (step2 / "loop_state.pt").write_bytes(b"damaged")  # resume falls back to step 1, then saves step 2 again
    capsys.readouterr()
    gift.main(train_args(base, out, "--save-every", "1", "--max-steps", "2", "--keep-last", "2", "--resume"))
    said = capsys.readouterr().out
    assert "resumed from" in said and "kept" in said and "eval.json" in said and "notes.txt" in said
    assert (step2 / "eval.json").read_text() == "beside model/"
    assert (step2 / "model" / "notes.txt").read_text() == "inside model/"
    assert latest(out) == step2 and torch.load(step2 / "loop_state.pt", weights_only=False)  # saved anew
    assert not step2.with_name(step2.name + ".tmp").exists()


# -----------------------------------------------------------------------------
# The tests write no cache outside their tmp folders


def test_the_weight_hash_cache_is_in_a_tmp_folder():
    home = Path.home() / ".cache"
    assert home not in longjob.WEIGHT_HASH_CACHE.parents and os.environ.get("GIFT_CACHE_DIR")
