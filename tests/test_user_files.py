"""Issue 37: nothing of a user's is lost or silently misread, and every entry point checks its inputs as gift.py does.
Each test names the case; on the code before the fix each fails (or hangs, stopped by a timer)."""

import json
import os
import shutil
import signal
import threading
import time

import pytest
import torch
from conftest import latest, metrics, train_args, write_rows
from test_eval import sudoku_checkpoint

import data
import embedded
import eval as E
import longjob
import gift
import model as model_py
import sample
from gift import main


def at_once(call, limit=10):
    """call(), stopped by a TimeoutError after `limit` seconds (a FIFO's open blocks, /dev/zero never ends)."""
    def stop(*_):
        raise TimeoutError(f"still running after {limit} s")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        return call()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def eval_refusal(argv, capsys):
    """E.main(argv) must stop with a one-line error (argparse's or run_command_line's); returns it."""
    with pytest.raises((SystemExit, ValueError, OSError)) as info:
        E.main(argv)
    return str(info.value) + capsys.readouterr().err


# -----------------------------------------------------------------------------
# 1. Nothing of a user's is lost


def test_eval_out_never_replaces_an_input_or_a_file_it_did_not_write(tmp_path, capsys):
    argv = sudoku_checkpoint(tmp_path, 2)
    data_file = tmp_path / "sudoku.csv"
    before = data_file.read_bytes()
    said = eval_refusal(argv + ["--out", str(data_file)], capsys)  # the test data as the summary
    assert "--data" in said and data_file.read_bytes() == before
    results = tmp_path / "results.json"  # gift.py's results
    results.write_text(json.dumps({"heldout": {"trained": 1.0}, "model": "m"}))
    said = eval_refusal(argv + ["--out", str(results)], capsys)
    assert "not an eval.py summary" in said and json.loads(results.read_text())["model"] == "m"
    assert not (tmp_path / "results.jsonl").exists()
    E.main(argv + ["--out", str(tmp_path / "r.json")])  # a summary of its own: rerunning the command is fine
    E.main(argv + ["--out", str(tmp_path / "r.json")])
    summary = (tmp_path / "r.json").read_text()
    (tmp_path / "r.jsonl").unlink()  # the records gone, the summary of other settings must stay
    said = eval_refusal(argv + ["--out", str(tmp_path / "r.json"), "--temperature", "0.5"], capsys)
    assert "summary of another evaluation" in said and "temperature" in said
    assert (tmp_path / "r.json").read_text() == summary


def test_rotation_keeps_a_users_files_in_an_old_checkpoint_and_says_so(base, tmp_path, capsys):
    out = tmp_path / "run"
    main(train_args(base, out, "--max-steps", "1", "--save-every", "1", "--keep-last", "1"))
    old = latest(out)
    (old / "eval.json").write_text("beside model/")
    (old / "model" / "notes.txt").write_text("inside model/")
    capsys.readouterr()
    main(train_args(base, out, "--max-steps", "2", "--save-every", "1", "--keep-last", "1", "--resume"))
    said = capsys.readouterr().out
    assert (old / "eval.json").read_text() == "beside model/"
    assert (old / "model" / "notes.txt").read_text() == "inside model/"
    assert said.count("kept") == 1 and "eval.json" in said and "notes.txt" in said
    assert not (old / "trainer.json").exists() and not (old / "train_state").exists()  # ours went
    main(train_args(base, out, "--max-steps", "3", "--save-every", "1", "--keep-last", "1", "--resume"))
    assert (old / "eval.json").exists()  # never revisited: no longer a checkpoint
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000001", "step-0000003"]


def test_overwrite_refuses_a_users_file_two_levels_down(base, tmp_path):
    out = tmp_path / "run"
    main(train_args(base, out, "--max-steps", "1"))
    notes = latest(out) / "model" / "notes.txt"
    notes.write_text("the user's")
    with pytest.raises(FileExistsError, match="notes.txt.*nothing was deleted"):
        main(train_args(base, out, "--max-steps", "1", "--overwrite"))
    assert notes.read_text() == "the user's"


@pytest.mark.parametrize("name", ["results.json", "tokenizer.json", "sudoku_heldout.csv", "status.json",
                                  "generation_defaults.json"])
def test_the_embedded_run_never_replaces_a_users_file(tmp_path, name):
    out = tmp_path / "run"
    out.mkdir()
    (out / name).write_text("a user's file")
    with pytest.raises(FileExistsError, match=f"{name}.*no gift.py run wrote; nothing was changed"):
        at_once(lambda: main(["--out", str(out), "--max-steps", "1", "--eval-puzzles", "2", "--overwrite"]))
    assert (out / name).read_text() == "a user's file" and not (out / "checkpoints").exists()


def test_the_embedded_runs_own_files_are_recognized(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    embedded.make_char_tokenizer().save(str(out / "tokenizer.json"))
    (out / "sudoku_heldout.csv").write_text("Puzzle,Solution\n1234341221434321,1234341221434321\n")
    (out / "status.json").write_text(json.dumps({"state": "failed"}))
    (out / "results.json").write_text(json.dumps({"heldout": {}, "train_seconds": 1, "options": {}}))
    (out / "generation_defaults.json").write_text(json.dumps(embedded.EMBEDDED_EVAL))
    longjob.claim_output_folder(out, False, False, replaced=embedded.REPLACED).close()  # nothing refused


def test_rotation_deletes_a_checkpoint_a_kill_left_behind(base, tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setattr(longjob, "delete_checkpoint", lambda folder: True)  # killed between each save and its rotation
    main(train_args(base, out, "--max-steps", "3", "--save-every", "1", "--keep-last", "1"))
    monkeypatch.undo()
    assert len(list((out / "checkpoints").iterdir())) == 3
    main(train_args(base, out, "--max-steps", "4", "--save-every", "1", "--keep-last", "1", "--resume"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000004"]


# -----------------------------------------------------------------------------
# 2. No silent wrong result


def test_eval_refuses_data_from_a_pipe(tmp_path, capsys):
    argv = sudoku_checkpoint(tmp_path, 2)
    read, write = os.pipe()
    content = (tmp_path / "sudoku.csv").read_bytes()
    writer = threading.Thread(target=lambda: (os.write(write, content), os.close(write)))
    writer.start()
    try:
        argv[argv.index("--data") + 1] = f"/proc/self/fd/{read}"
        said = eval_refusal(argv + ["--out", str(tmp_path / "r.json")], capsys)
    finally:
        writer.join()
        os.close(read)
    assert "not a regular file" in said and "named pipe" in said


def test_the_fingerprint_sees_one_changed_byte_anywhere(tmp_path, monkeypatch):
    monkeypatch.setattr(longjob, "WEIGHT_HASH_CACHE", tmp_path / "cache.json")
    monkeypatch.setattr(longjob, "_weight_hashes", {})
    monkeypatch.setattr(longjob, "RACY_SECONDS", 0)  # cache even a file just written
    sudoku_checkpoint(tmp_path, 1)
    weights = tmp_path / "ckpt" / "model.safetensors"
    first = longjob.folder_fingerprint(tmp_path / "ckpt")
    assert json.loads((tmp_path / "cache.json").read_text())  # cached
    assert longjob.folder_fingerprint(tmp_path / "ckpt") == first
    raw = bytearray(weights.read_bytes())
    st = weights.stat()
    middle = len(raw) - 12_345  # between the old sampler's 64 KiB samples for a file of this size, or not: any byte
    raw[middle] ^= 1
    time.sleep(0.01)
    weights.write_bytes(bytes(raw))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same size and modification time
    assert longjob.folder_fingerprint(tmp_path / "ckpt") != first


def plain_vocab_chat_token(folder, token=data.EOT):
    """Rewrite folder/tokenizer.json so that `token` is a plain vocabulary entry (same id), not an added token."""
    raw = json.loads((folder / "tokenizer.json").read_text())
    entry = next(t for t in raw["added_tokens"] if t["content"] == token)
    raw["added_tokens"].remove(entry)
    raw["model"]["vocab"][token] = entry["id"]
    (folder / "tokenizer.json").write_text(json.dumps(raw))


def test_every_entry_point_refuses_chat_tokens_it_would_spell_out(tmp_path, base, capsys):
    argv = sudoku_checkpoint(tmp_path, 2)
    plain_vocab_chat_token(tmp_path / "ckpt")
    said = eval_refusal(argv, capsys)
    assert "<|eot_id|>" in said and "as one token" in said and str(tmp_path / "ckpt") in said
    with pytest.raises(ValueError, match=r"<\|eot_id\|>.*as one token.*--raw"):
        sample.main(["--model", str(tmp_path / "ckpt"), "--prompt", "1234", "--gen-length", "8", "--steps", "8",
                     "--block-length", "8"])
    model_dir = tmp_path / "train_base"
    shutil.copytree(base / "model", model_dir)
    plain_vocab_chat_token(model_dir)
    with pytest.raises(ValueError, match=r"<\|eot_id\|>.*as one token"):
        main(["--model", str(model_dir), "--data", str(base / "data.jsonl"), "--out", str(tmp_path / "run")])


def test_the_mask_tokens_text_in_an_answer_or_a_prompt_is_refused(tmp_path):
    path = tmp_path / "d.jsonl"
    write_rows(path, [("say hi", "hi"), ("say hi", f"hi {data.MASK} there")])
    with pytest.raises(data.DataError, match=r"line 2: the answer holds the mask token"):
        data.load_dataset(path, embedded.make_char_tokenizer())
    with pytest.raises(ValueError, match="the prompt holds the mask token"):
        data.encode_text(embedded.make_char_tokenizer(), f"a {data.MASK}")


def test_a_trainer_json_whose_step_disagrees_is_damaged(base, tmp_path, capsys):
    out = tmp_path / "run"
    main(train_args(base, out, "--save-every", "1", "--max-steps", "2", "--keep-last", "2"))
    trainer = latest(out) / "trainer.json"
    meta = json.loads(trainer.read_text())
    meta["state"]["step"] = 5
    trainer.write_text(json.dumps(meta))
    capsys.readouterr()
    main(train_args(base, out, "--save-every", "1", "--max-steps", "3", "--keep-last", "2", "--resume"))
    said = capsys.readouterr().out
    assert "trainer.json says step 5" in said and "resumed from" in said and "step 1 " in said
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]


# -----------------------------------------------------------------------------
# 3. No hang: one check of every data file


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
@pytest.mark.parametrize("flag", ["--data", "--shot-data"])
def test_eval_refuses_a_data_file_that_would_never_end(tmp_path, capsys, kind, flag):
    argv = sudoku_checkpoint(tmp_path, 2)
    path = "/dev/zero"
    if kind == "fifo":
        os.mkfifo(tmp_path / "pipe.csv")
        path = str(tmp_path / "pipe.csv")
    if flag == "--data":
        argv[argv.index("--data") + 1] = path
    else:
        argv += ["--shots", "1", "--shot-data", path]
    said = at_once(lambda: eval_refusal(argv, capsys))
    assert "not a regular file" in said and path in said


def test_a_key_given_twice_is_refused_in_training_data_too(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "say hi", "response": "hi", "response": "ho"}\n')
    with pytest.raises(data.DataError, match="line 1: the key 'response' is given twice"):
        data.load_dataset(path, embedded.make_char_tokenizer())
