"""A hostile but realistic user (issue 22): nothing silently wrong, nothing lost, and a user's mistake is one line.
Each test names the case; on the code before the fix each fails."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from conftest import REPO, latest, metrics, train_args
from test_eval import record_lines, sudoku_checkpoint
from test_resume import stop_after

import eval as E
import longjob
import gift
import sample
from gift import main, parse_options


def run_cli(argv):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


# -----------------------------------------------------------------------------
# Options that train nothing, or something else than asked: refused before any work, naming the flag

BAD_TRAIN_OPTIONS = [
    (["--lora", "--lora-alpha", "0"], "--lora-alpha 0.0: must be a positive number"),
    (["--beta-power", "nan"], "--beta-power nan: must be in (0, 10]"),
    (["--beta-power", "-1"], "--beta-power -1.0: must be in (0, 10]"),
    (["--warmup-steps", "-5"], "--warmup-steps -5: must be 0 (none) or more"),
    (["--grad-clip", "inf"], "--grad-clip inf: must be 0 (off) or a finite positive norm"),
    (["--grad-clip", "-1"], "--grad-clip -1.0: must be 0 (off)"),
    (["--lora-dropout", "1.5"], "--lora-dropout 1.5: must be in [0, 1)"),
    (["--weight-decay", "-1"], "--weight-decay -1.0: must be 0 or more"),
    (["--lr", "nan"], "--lr nan: must be positive"),
    (["--max-len", "0"], "--max-len 0: must be at least 2"),
    (["--max-len", "1"], "--max-len 1: must be at least 2"),
    (["--out", "/dev/full"], "--out /dev/full: must be a folder of its own (it is a file)"),
    (["--out", "/"], "--out /: must be a folder of its own (it is the root)"),
    (["--data", "/"], "--data /: a folder; give the JSONL file"),
    (["--out", ""], "--out '': give the run's folder"),
    (["--out", str(REPO / "tests" / "golden" / "tiny_llada_mha")], "holds a model (config.json)"),
    (["--seed", "99999999999999999999"], "--seed 99999999999999999999: must be in [0, 1000000)"),
    (["--beta-power", "1e30"], "--beta-power 1e+30: must be in (0, 10]"),
]


@pytest.mark.parametrize("flags,message", BAD_TRAIN_OPTIONS, ids=[" ".join(f) for f, _ in BAD_TRAIN_OPTIONS])
def test_an_option_that_trains_nothing_or_else_is_refused(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_options(["--model", "m", "--data", "d", *flags])
    assert message in capsys.readouterr().err


BAD_EVAL_FLAGS = [
    (["--seeds", "0", "0"], "--seeds 0 0: each seed once"),
    (["--temperature", "-1"], "--temperature -1.0: must be 0 (greedy) or more"),
    (["--gen-length", "100", "--block-length", "32"], "--gen-length 100 must be a multiple of --block-length 32"),
    (["--gen-length", "64", "--block-length", "32", "--steps", "33"], "--steps 33 a multiple of the number of blocks 2"),
    (["--gen-length", "32", "--block-length", "64"], "--block-length 64 is longer than --gen-length 32"),
]


@pytest.mark.parametrize("flags,message", BAD_EVAL_FLAGS, ids=[" ".join(f) for f, _ in BAD_EVAL_FLAGS])
def test_bad_eval_flags_refused_before_anything_is_written(tmp_path, flags, message, capsys):
    argv = sudoku_checkpoint(tmp_path, 2)[:6] + ["--prompt-style", "plain"]  # --model, --task, --data
    with pytest.raises(SystemExit):
        E.main(argv + ["--out", str(tmp_path / "r.json"), *flags])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r.jsonl").exists()  # nothing left behind


BAD_SAMPLE_FLAGS = [
    (["--temperature", "-1"], "--temperature -1.0: must be 0 (greedy) or more"),
    (["--cfg-scale", "-3"], "must be 0 (off) or more"),
]
if not torch.cuda.is_available():
    BAD_SAMPLE_FLAGS.append((["--device", "cuda"], "--device cuda: this machine has no CUDA device"))


@pytest.mark.parametrize("flags,message", BAD_SAMPLE_FLAGS, ids=[" ".join(f) for f, _ in BAD_SAMPLE_FLAGS])
def test_bad_sample_flags_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit):
        sample.main(["--model", "no-such-folder", "--prompt", "hi", *flags])
    assert message in capsys.readouterr().err


# -----------------------------------------------------------------------------
# eval.py: a rerun with a larger --limit, two evals into one file


def test_a_rerun_with_a_larger_limit_counts_each_item_once(tmp_path):
    argv = sudoku_checkpoint(tmp_path, 8) + ["--batch-size", "4", "--out", str(tmp_path / "r.json")]
    E.main(argv + ["--limit", "5"])
    E.main(argv + ["--limit", "8"])
    lines = record_lines(tmp_path / "r.jsonl")
    assert sorted(r["index"] for r in lines) == list(range(8))
    summary = json.loads((tmp_path / "r.json").read_text())
    assert summary["n_items"] == 8 and len(summary["runs"][0]["records"]) == 8
    E.main(argv + ["--out", str(tmp_path / "whole.json")])  # the same 8 items in one go
    whole = json.loads((tmp_path / "whole.json").read_text())
    assert whole["accuracy_mean"] == summary["accuracy_mean"]


def test_one_eval_per_output_file(tmp_path, capsys):
    import fcntl
    argv = sudoku_checkpoint(tmp_path, 2) + ["--out", str(tmp_path / "r.json")]
    E.main(argv + ["--limit", "1"])
    before = (tmp_path / "r.jsonl").read_text()
    holder = open(tmp_path / "r.jsonl", "rb")
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another eval.py writes there (it locks the records file)
    try:
        with pytest.raises(SystemExit):
            E.main(argv)
    finally:
        holder.close()
    assert "another eval.py is writing" in capsys.readouterr().err
    assert (tmp_path / "r.jsonl").read_text() == before


# -----------------------------------------------------------------------------
# Training: what --overwrite deletes, extending a run, damaged files, a full disk


def test_overwrite_deletes_only_what_a_run_wrote(base, tmp_path):
    out = tmp_path / "run"
    main(train_args(base, out, "--max-steps", "1"))
    (out / "checkpoints" / "important.bin").write_text("a user's file")
    with pytest.raises(FileExistsError, match="important.bin.*nothing was deleted"):
        main(train_args(base, out, "--max-steps", "1", "--overwrite"))
    assert (out / "checkpoints" / "important.bin").exists() and (out / "metrics.jsonl").exists()
    (out / "checkpoints" / "important.bin").unlink()
    main(train_args(base, out, "--max-steps", "1", "--overwrite"))  # only ours: deleted and started over
    elsewhere = tmp_path / "elsewhere"  # checkpoints/ a link to a folder of the user's: never followed
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("the user's")
    shutil.rmtree(out / "checkpoints")
    (out / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(FileExistsError, match="checkpoints.*nothing was deleted"):
        main(train_args(base, out, "--max-steps", "1", "--overwrite"))
    assert (elsewhere / "keep.txt").exists()
    (out / "checkpoints").unlink()
    (out / "latest").write_text("my notes")  # a user's file named latest: --resume must not take it over either
    with pytest.raises(FileExistsError, match="--resume: .*latest.*nothing was changed"):
        main(train_args(base, out, "--max-steps", "1", "--resume"))
    assert (out / "latest").read_text() == "my notes"


def test_extending_a_finished_run_stretches_its_schedule_and_says_so(base, tmp_path, capsys):
    out = tmp_path / "run"
    main(train_args(base, out, "--schedule", "linear"))  # 2 epochs = 6 steps, lr 3e-3 down to 0
    assert metrics(out)[-1]["lr"] == 0.0
    capsys.readouterr()
    main(train_args(base, out, "--schedule", "linear", "--epochs", "4", "--resume"))  # 12 steps now
    f = gift.lr_lambda("linear", 1, 12)
    said = capsys.readouterr().out
    assert "the run now has 12 steps, it had 6" in said and f"step 7 runs at lr {3e-3 * f(6):.3g}" in said
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(1, 13)) and records[-1]["total_steps"] == 12
    assert records[6]["lr"] == pytest.approx(3e-3 * f(7)) and records[-1]["lr"] == 0.0


def test_a_shard_overwritten_with_garbage_falls_back_to_the_checkpoint_before(base, tmp_path, capsys):
    out = tmp_path / "run"
    main(train_args(base, out, "--save-every", "1", "--max-steps", "3", "--keep-last", "3"))
    shards = sorted((latest(out) / "train_state").glob("*.distcp"))
    for shard in shards:
        shard.write_bytes(os.urandom(shard.stat().st_size))  # same size: the size checks cannot see it
    capsys.readouterr()
    main(train_args(base, out, "--save-every", "1", "--max-steps", "4", "--keep-last", "3", "--resume"))
    said = capsys.readouterr().out
    assert "cannot load" in said and "step-0000003" in said and "resumed from" in said and "step-0000002" in said
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]


def test_a_kill_during_rotation_leaves_nothing_behind(base, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_rmtree, skipped = longjob.shutil.rmtree, []
    monkeypatch.setattr(longjob.shutil, "rmtree",
                        lambda p, **k: skipped.append(p) if "step-0000001" in str(p) else real_rmtree(p, **k))
    main(train_args(base, out, "--save-every", "1", "--max-steps", "3"))  # "killed" while deleting step 1
    monkeypatch.undo()
    assert skipped  # the hook ran
    main(train_args(base, out, "--save-every", "1", "--max-steps", "4", "--resume"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000003", "step-0000004"]


def test_a_full_disk_during_a_checkpoint_names_the_path_and_frees_the_space(base, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_save = torch.save

    def full(obj, path, *a, **k):
        if str(path).endswith("loop_state.pt"):
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *a, **k)
    monkeypatch.setattr(gift.torch, "save", full)
    with pytest.raises(OSError, match="cannot write the checkpoint .*step-0000001.tmp \\(No space left on device\\)"):
        main(train_args(base, out, "--max-steps", "1"))
    assert not list((out / "checkpoints").glob("*.tmp"))
    assert json.loads((out / "status.json").read_text())["state"] == "failed"


def test_a_damaged_gift_star_cache_is_recomputed(base, tmp_path, capsys):
    out = tmp_path / "star"
    main(train_args(base, out, "--loss", "gift-star", "--lora", "--max-steps", "2", "--save-every", "1"))
    good = torch.load(out / "ref_betas.pt")["betas"]
    (out / "ref_betas.pt").write_bytes(b"not a torch file")
    capsys.readouterr()
    main(train_args(base, out, "--loss", "gift-star", "--lora", "--max-steps", "3", "--save-every", "1", "--resume"))
    assert "ref_betas.pt is unreadable" in capsys.readouterr().out
    assert torch.equal(torch.load(out / "ref_betas.pt")["betas"], good)


def test_auto_options_resume_as_what_they_resolved_to(base, tmp_path):
    out = tmp_path / "run"
    main(train_args(base, out, "--max-steps", "1"))  # --dtype auto (float32 on the CPU), --data-format auto
    main(train_args(base, out, "--max-steps", "2", "--resume", "--dtype", "float32", "--data-format",
                    "prompt-response"))
    with pytest.raises(ValueError, match="'dtype': \\('float32', 'bfloat16'\\)"):  # the last run's, resolved
        main(train_args(base, out, "--max-steps", "3", "--resume", "--dtype", "bfloat16"))


def test_one_changed_answer_of_the_same_length_is_refused_at_resume(base, tmp_path):
    out, data = tmp_path / "run", tmp_path / "data.jsonl"
    rows = (base / "data.jsonl").read_text().splitlines()
    data.write_text("\n".join(rows) + "\n")
    main(train_args(base, out, "--max-steps", "1", data=data))
    row = json.loads(rows[0])
    rows[0] = json.dumps(dict(row, response=row["response"][::-1]))  # "five" -> "evif": every length the same
    data.write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError, match="training data changed"):
        main(train_args(base, out, "--max-steps", "2", "--resume", data=data))


def test_a_run_where_every_step_was_skipped_is_not_done(base, tmp_path):
    with pytest.raises(longjob.RunError, match="every step \\(2\\) had a non-finite loss"):
        main(train_args(base, tmp_path / "run", "--lora", "--lora-alpha", "1e30", "--max-steps", "2"))


def test_a_batch_larger_than_the_data_is_refused(base, tmp_path):
    with pytest.raises(ValueError, match="--batch-size 2 x --grad-accum 100 exceeds the 12 examples"):
        main(train_args(base, tmp_path / "run", "--grad-accum", "100"))


def test_a_bad_data_file_fails_before_the_lora_base_loads(base, tmp_path, monkeypatch):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hi"}\n')
    monkeypatch.setattr(gift.LLaDA, "from_pretrained", lambda *a, **k: pytest.fail("the base loaded first"))
    with pytest.raises(ValueError, match="bad.jsonl, line 1"):
        main(train_args(base, tmp_path / "run", "--lora", data=tmp_path / "bad.jsonl"))


# -----------------------------------------------------------------------------
# What a requeue script reads, and what a user's mistake prints


def test_status_file_says_done_preempted_or_failed(base, tmp_path, monkeypatch):
    out = tmp_path / "run"
    stop_after(monkeypatch, 2)
    with pytest.raises(SystemExit):
        main(train_args(base, out, "--max-steps", "4"))
    monkeypatch.undo()
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "preempted" and status["step"] == 2 and status["exit_code"] == 128 + signal.SIGTERM
    assert status["checkpoint"] == str(out / "checkpoints" / "step-0000002")
    main(train_args(base, out, "--max-steps", "4", "--resume"))
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "done" and status["step"] == 4


USER_MISTAKES = [  # {tmp}: this test's folder
    (["gift.py", "--model", "{tmp}/no-such-model", "--data", "{tmp}/no-such.jsonl", "--out", "{tmp}/run"],
     "gift.py: error: "),
    (["gift.py", "--out", "/dev/null/x", "--max-steps", "1"], "gift.py: error: "),
]


@pytest.mark.parametrize("argv,start", USER_MISTAKES, ids=[" ".join(a[1:3]) for a, _ in USER_MISTAKES])
def test_a_users_mistake_is_one_line_without_traceback(argv, start, tmp_path):
    result = run_cli([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(start), result.stderr
