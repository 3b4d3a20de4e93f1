"""Issue 53's ownership rules (longjob.py): one eval.py per --out at a time, the second refused naming the first
(item 7); files matched by name (a checkpoint without a manifest) only in a folder whose trainer.json names it, in the
run's own checkpoints/ (item 9); two rough ones: --out up.JSONL beside up.jsonl, and one rule of "the same base" for
an adapter and --resume. Each test fails before the fix, but for the guard of a kill mid-save (which the fix must not
break)."""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, latest, train_args
from test_eval import record_lines, sudoku_checkpoint

import eval as E
import gift
import longjob

SETTINGS = {"task": "gsm8k", "gen_length": 64, "model": "m"}


# -----------------------------------------------------------------------------
# item 7: one eval.py per --out at a time, the records file locked from the start to the end of the run


def test_the_lock_files_are_in_the_tests_cache():
    """eval.py's lock files (longjob.LOCKS) live in the cache, which conftest points at a folder of the session's."""
    assert Path(os.environ["GIFT_CACHE_DIR"]) in longjob.LOCKS.parents and Path.home() not in longjob.LOCKS.parents


def test_a_second_eval_on_one_out_is_refused_naming_the_holder(tmp_path, capsys):
    """Before, a first run that had no records file yet locked nothing until its first batch: a second on the same
    --out ran too and both appended (every record twice). Now the second is refused at once, naming the holder, and
    nothing is written beside --out (no lock file: longjob.LOCKS); the first's end releases it."""
    args = argparse.Namespace(out=str(tmp_path / "r.json"), data=None, shot_data=None)
    first = longjob.open_output(argparse.ArgumentParser(), args)[2]
    try:
        for records in (False, True):  # before the first batch, and after it (the records file exists then)
            if records:
                first.callback(longjob.append_records(tmp_path / "r.jsonl", [dict(index=0, seed=0)], SETTINGS).close)
            with pytest.raises(SystemExit):
                longjob.open_output(argparse.ArgumentParser(), args)
            said = capsys.readouterr().err.strip().splitlines()[-1]
            assert f"another eval.py is writing {tmp_path / 'r.jsonl'} (pid {os.getpid()} on " in said, said
    finally:
        first.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]
    longjob.open_output(argparse.ArgumentParser(), args)[2].close()  # released: the next run starts


def test_two_eval_processes_on_one_out_the_second_refused_the_first_finishing(tmp_path, monkeypatch):
    """A real second `python eval.py` on the same --out, started while the first runs, before its records file
    exists: it ran to the end before (exit 0, every record twice, the summary replaced); now it exits at once, one
    error line naming the first (pid, host), and the first ends as it would alone."""
    argv = sudoku_checkpoint(tmp_path, 4) + ["--batch-size", "2", "--out", str(tmp_path / "r.json")]
    seconds = []

    def second_eval_then_append(path, records, settings):  # the first's first batch is graded: the second starts now
        if not seconds:
            seconds.append(subprocess.run([sys.executable, "eval.py", *argv], cwd=REPO, capture_output=True,
                                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}))
        return append_records(path, records, settings)
    append_records = E.append_records
    monkeypatch.setattr(E, "append_records", second_eval_then_append)
    E.main(argv)  # the first: returns (exit 0)
    said = seconds[0].stderr.strip().splitlines()
    assert seconds[0].returncode != 0 and "Traceback" not in seconds[0].stderr, seconds[0].stderr
    assert said[-1].startswith(f"eval.py: error: --out {tmp_path / 'r.json'}: another eval.py is writing "
                               f"{tmp_path / 'r.jsonl'} (pid {os.getpid()} on {socket.gethostname()})"), said
    assert sorted(r["index"] for r in record_lines(tmp_path / "r.jsonl")) == [0, 1, 2, 3]  # each once
    assert json.loads((tmp_path / "r.json").read_text())["n_items"] == 4
    monkeypatch.undo()
    E.main(argv)  # released at the first's end: the same command continues (nothing left to generate)
    assert len(record_lines(tmp_path / "r.jsonl")) == 4


# -----------------------------------------------------------------------------
# item 9: a folder without a manifest is matched by name only where its trainer.json names it, in a real checkpoints/

MINE = {"model/model.safetensors": "the user's weights", "model/config.json": "{}"}  # named as a save names its own


def put(folder, files):
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def kept(folder, files):
    return all((folder / name).read_text() == text for name, text in files.items())


def test_a_users_step_tmp_folder_is_kept_by_resume_saves_and_overwrite(base, tmp_path, capsys):
    """Removed as an interrupted save before (its files named as a save names them); no trainer.json names it: the
    user's, kept by --resume's start (saying so), by the save of its step (refused, naming it) and by --overwrite."""
    out = tmp_path / "run"
    gift.main(train_args(base, out, "--max-steps", "1"))
    mine = out / "checkpoints" / "step-0000002.tmp"
    put(mine, MINE)
    capsys.readouterr()
    with pytest.raises(OSError, match="step-0000002.tmp holds files no gift.py run wrote"):
        gift.main(train_args(base, out, "--max-steps", "2", "--resume"))
    assert kept(mine, MINE) and f"kept {mine / 'model' / 'model.safetensors'}" in capsys.readouterr().out
    with pytest.raises(FileExistsError, match="step-0000002.tmp/model/model.safetensors.*nothing was deleted"):
        gift.main(train_args(base, out, "--max-steps", "2", "--overwrite"))
    assert kept(mine, MINE) and sorted(p.name for p in mine.rglob("*")) == ["config.json", "model", "model.safetensors"]


def test_a_save_killed_midway_leaves_a_tmp_the_next_start_removes(base, tmp_path, monkeypatch, capsys):
    """The guard: a save's .tmp names itself in its trainer.json from its start, so a kill before its manifest leaves
    a folder the next start removes whole (tens of GB at 8B), as before."""
    out = tmp_path / "run"

    def killed(*args, **kwargs):  # a kill -9 after the training state is written, before the model and the manifest
        raise KeyboardInterrupt
    monkeypatch.setattr(longjob, "export_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        gift.main(train_args(base, out, "--max-steps", "1"))
    tmp = out / "checkpoints" / "step-0000001.tmp"
    assert (tmp / "train_state" / ".metadata").is_file() and not (tmp / longjob.MANIFEST).exists()
    monkeypatch.undo()
    capsys.readouterr()
    gift.main(train_args(base, out, "--max-steps", "1", "--resume"))
    assert f"removed {tmp}, left by an interrupted save" in capsys.readouterr().out and not tmp.exists()


def test_rotation_through_a_checkpoints_folder_linked_midway_keeps_a_users_step(base, tmp_path, monkeypatch):
    """checkpoints/ replaced by a link to a user's folder during the run: rotation deleted its step-0000001/model
    files by name before (even a trainer.json naming that step does not make a folder behind a link the run's)."""
    out, mine = tmp_path / "run", tmp_path / "mine"
    users = dict(MINE, **{"trainer.json": json.dumps({"state": {"step": 1, "checkpoints": ["step-0000001"]}})})
    put(mine / "step-0000001", users)
    real_step = gift.train_step

    def step(*args, **kwargs):  # after step 1's checkpoint: the folder moved away, a link to the user's in its place
        if (out / "checkpoints" / "step-0000001").is_dir() and not (out / "checkpoints").is_symlink():
            (out / "checkpoints").rename(tmp_path / "moved")
            (out / "checkpoints").symlink_to(mine)
        return real_step(*args, **kwargs)
    monkeypatch.setattr(gift, "train_step", step)
    gift.main(train_args(base, out, "--max-steps", "2", "--save-every", "1", "--keep-last", "1"))
    assert kept(mine / "step-0000001", users)
    assert longjob.checkpoint_problem(mine / "step-0000002") is None  # the run's step 2, written there


def test_a_save_at_a_users_step_folder_replaces_none_of_its_files(base, tmp_path):
    """A user's step-0000002/ (no manifest, no trainer.json) where the run saves step 2: its model files were deleted
    by name and replaced by the run's before; now the save is refused naming them, nothing of theirs touched."""
    out = tmp_path / "run"
    gift.main(train_args(base, out, "--max-steps", "1", "--save-every", "1"))
    mine = out / "checkpoints" / "step-0000002"
    put(mine, MINE)
    with pytest.raises(OSError, match=r"step-0000002/model/.*a user's file where the checkpoint writes one"):
        gift.main(train_args(base, out, "--max-steps", "2", "--save-every", "1", "--resume"))
    assert kept(mine, MINE) and latest(out).name == "step-0000001"


# -----------------------------------------------------------------------------
# Rough: a summary named like its records file but for the case (one file where the file system folds case)


@pytest.mark.parametrize("name", ["up.JSONL", "up.Jsonl"])
def test_a_summary_named_as_its_records_in_another_case_is_refused(tmp_path, capsys, name):
    """--out up.JSONL was accepted beside the records up.jsonl: on macOS's and Windows' file systems the same file, the
    summary written over the records. Now one line naming the flag, before anything is written."""
    records = tmp_path / "up.jsonl"
    longjob.append_records(records, [dict(index=0, seed=0)], SETTINGS).close()
    before = records.read_bytes()
    args = argparse.Namespace(out=str(tmp_path / name), data=None, shot_data=None)
    with pytest.raises(SystemExit):
        longjob.open_output(argparse.ArgumentParser(), args)
    assert f"--out {tmp_path / name}: name the summary .json file" in capsys.readouterr().err.strip().splitlines()[-1]
    assert records.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["up.jsonl"]


# -----------------------------------------------------------------------------
# Rough: one rule of "the same base" (longjob.base_changes): a re-indented config.json is the same base for an adapter
# as for --resume


def reindent(path):
    path.write_text(json.dumps(json.loads(path.read_text()), indent=4, sort_keys=False) + "\n")


def test_an_adapter_on_its_base_with_a_reindented_config_is_accepted(base, tmp_path):
    """Refused as "another model" before (its record hashed config.json's bytes), where --resume took the same base
    as the same; now both compare file by file, JSON by content. A real change is still refused, naming the file; a
    record of older code (the fingerprint only) is read as before, by every byte."""
    shutil.copytree(base / "model", tmp_path / "base")
    out = tmp_path / "run"
    gift.main(train_args(base, out, "--lora", "--max-steps", "1") + ["--model", str(tmp_path / "base")])
    copied = shutil.copytree(latest(out) / "adapter", tmp_path / "copied")  # copied out: its own record only
    config = tmp_path / "base" / "config.json"
    original = config.read_text()
    reindent(config)
    assert config.read_text() != original
    longjob.check_adapter(tmp_path / "base", copied)
    gift.main(train_args(base, out, "--lora", "--max-steps", "2", "--resume") + ["--model", str(tmp_path / "base")])
    config.write_text(json.dumps(dict(json.loads(original), rope_theta=1.0)))  # another model
    with pytest.raises(ValueError, match=r"trained on a base model with fingerprint .*its config.json \(fingerprint"):
        longjob.check_adapter(tmp_path / "base", copied)
    record = copied / "adapter_base.json"  # as older code wrote it
    record.write_text(json.dumps({"base_fingerprint": json.loads(record.read_text())["base_fingerprint"]}) + "\n")
    config.write_text(original)
    longjob.check_adapter(tmp_path / "base", copied)
    reindent(config)
    with pytest.raises(ValueError, match="trained on a base model with fingerprint"):
        longjob.check_adapter(tmp_path / "base", copied)


@pytest.mark.parametrize("left", ["a half-written model folder", "trainer.json half written", "nothing yet",
                                  "the training state's metadata half written"])
def test_a_save_killed_in_a_writer_leaves_a_tmp_the_next_start_removes(base, tmp_path, monkeypatch, capsys, left):
    """A kill inside one of the save's own writers leaves their temporaries (model.atomic_folder's model.tmp-XXXX/,
    model.atomic_write_text's trainer.json.<pid>-<hex>.tmp) or an empty .tmp: the run's (longjob.WRITER_TEMP), removed
    by the next start, which then saves that step (the kill -9 of tests/test_rl_run.py found the first)."""
    out = tmp_path / "run"
    gift.main(train_args(base, out, "--max-steps", "1"))
    tmp = out / "checkpoints" / "step-0000002.tmp"
    tmp.mkdir()
    if left == "a half-written model folder":  # trainer.json names it; export_pretrained's folder half written
        trainer = json.loads((latest(out) / "trainer.json").read_text())
        trainer["state"].update(step=2, checkpoints=trainer["state"]["checkpoints"] + ["step-0000002"])
        del trainer["manifest"]  # written with the manifest, last
        (tmp / "trainer.json").write_text(json.dumps(trainer))
        (tmp / "model.tmp-_3y4wk3u").mkdir()
        (tmp / "model.tmp-_3y4wk3u" / "config.json").write_text("{")
    elif left == "the training state's metadata half written":  # torch.distributed.checkpoint's .metadata.tmp
        trainer = json.loads((latest(out) / "trainer.json").read_text())
        trainer["state"].update(step=2, checkpoints=trainer["state"]["checkpoints"] + ["step-0000002"])
        del trainer["manifest"]
        (tmp / "trainer.json").write_text(json.dumps(trainer))
        (tmp / "train_state").mkdir()
        (tmp / "train_state" / "__0_0.distcp").write_bytes(b"x")
        (tmp / "train_state" / ".metadata.tmp").write_bytes(b"x")
    elif left == "trainer.json half written":
        (tmp / "trainer.json.12345-deadbeef.tmp").write_text('{"state": {"st')
    capsys.readouterr()
    gift.main(train_args(base, out, "--max-steps", "2", "--resume"))
    assert not tmp.exists() and (out / "checkpoints" / "step-0000002" / "trainer.json").is_file()
    assert "kept" not in capsys.readouterr().out
