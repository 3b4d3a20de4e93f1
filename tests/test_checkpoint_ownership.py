"""What a run may delete or write in its folder is what it wrote: a checkpoint's own files are those its manifest
lists (older checkpoints: those named as a save names them), --overwrite leaves a user's wandb/ and ref_betas.pt, a
step-N that is a symbolic link is never followed, a user's .lock is never truncated; --wandb-project without wandb and
a full disk at the lock are one line; a weight file's fingerprint reads every byte. Each test names its case."""

import errno
import hashlib
import json
import os
import shutil
import sys

import pytest
import torch
from conftest import REPO, latest, train_args

import gift
import longjob
from gift import main

MANIFEST = "manifest.json"  # longjob.MANIFEST: in each checkpoint, the files its save wrote
USERS = {"generation_config.json": "{}", "my_quantized.safetensors": "int4", "modeling_mine.py": "# mine",
         "chat_template.jinja": "{{ mine }}"}  # a user's files in a checkpoint's model/, named as a save names its own


def put(folder, files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def kept(folder, files):
    return all((folder / name).read_text() == text for name, text in files.items())


# -----------------------------------------------------------------------------
# 1. A checkpoint's own files are those its manifest lists


def test_the_manifest_lists_every_file_of_the_save_before_the_folder_appears(base, tmp_path, monkeypatch):
    out, seen = tmp_path / "run", []
    replace = os.replace

    def spy(src, dst):  # the rename that makes a checkpoint visible: its manifest is already in it
        if longjob.checkpoint_step(os.path.basename(dst)) is not None:
            seen.append(json.loads((src / MANIFEST).read_text()))
        return replace(src, dst)
    monkeypatch.setattr(longjob.os, "replace", spy)
    main(train_args(base, out, "--max-steps", "1"))
    monkeypatch.undo()
    ckpt = latest(out)
    files = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert seen == [[f for f in files if f != MANIFEST]]
    assert "model/model.safetensors" in files and "train_state/.metadata" in files and "trainer.json" in files


def test_rotation_and_overwrite_keep_a_users_files_named_like_the_runs(base, tmp_path, capsys):
    out = tmp_path / "run"
    main(train_args(base, out, "--max-steps", "1", "--save-every", "1", "--keep-last", "1"))
    old = latest(out)
    put(old / "model", USERS)
    with pytest.raises(FileExistsError, match="my_quantized.safetensors.*nothing was deleted"):
        main(train_args(base, out, "--max-steps", "1", "--overwrite"))
    assert kept(old / "model", USERS)
    capsys.readouterr()
    main(train_args(base, out, "--max-steps", "2", "--save-every", "1", "--keep-last", "1", "--resume"))
    assert "kept" in capsys.readouterr().out and kept(old / "model", USERS)
    assert not (old / "trainer.json").exists() and not (old / "model" / "model.safetensors").exists()  # ours went
    (old / "model" / "config.json").write_text("the user's, after the rotation")  # a name the run writes, now theirs
    main(train_args(base, out, "--max-steps", "3", "--save-every", "1", "--keep-last", "1", "--resume"))
    assert kept(old / "model", dict(USERS, **{"config.json": "the user's, after the rotation"}))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000001", "step-0000003"]


def test_a_checkpoint_saved_again_at_its_step_keeps_a_users_files(base, tmp_path):
    out = tmp_path / "run"
    main(train_args(base, out, "--max-steps", "2", "--save-every", "1", "--keep-last", "2"))
    ckpt = latest(out)
    (ckpt / "loop_state.pt").unlink()  # damaged: --resume falls back to step 1 and saves step 2 again
    put(ckpt / "model", USERS)
    main(train_args(base, out, "--max-steps", "2", "--save-every", "1", "--keep-last", "2", "--resume"))
    assert kept(ckpt / "model", USERS) and longjob.checkpoint_problem(ckpt) is None
    assert not set(json.loads((ckpt / MANIFEST).read_text())) & {f"model/{name}" for name in USERS}


def test_a_damaged_manifest_keeps_the_checkpoint_whole_and_says_so(base, tmp_path, capsys):
    out = tmp_path / "run"
    main(train_args(base, out, "--max-steps", "1", "--save-every", "1", "--keep-last", "1", "--lora"))
    old = latest(out)
    (old / MANIFEST).write_text("[torn")
    capsys.readouterr()
    main(train_args(base, out, "--max-steps", "3", "--save-every", "1", "--keep-last", "1", "--lora", "--resume"))
    said = capsys.readouterr()
    assert "resumed from" in said.out and str(old) in said.out
    warnings = [line for line in said.err.splitlines() if "cannot delete the old checkpoint" in line]
    assert len(warnings) == 1 and "manifest.json is unreadable" in warnings[0]
    assert longjob.checkpoint_problem(old) is None  # whole
    (old / MANIFEST).unlink()  # missing, where trainer.json says there is one: the same
    assert longjob.checkpoint_files(old)[0] == [] and not longjob.delete_checkpoint(old)
    assert longjob.checkpoint_problem(old) is None


def test_an_older_checkpoint_without_a_manifest_keeps_the_name_rule(tmp_path):
    """tests/data/ebf2705's run (older code: no manifest) resumes and its step 2 rotates by the names a save writes."""
    fixture = shutil.copytree(REPO / "tests" / "data" / "ebf2705", tmp_path / "f")
    out, old = fixture / "run", fixture / "run" / "checkpoints" / "step-0000002"
    put(old / "model", {"notes.txt": "the user's"})
    main(["--model", str(fixture / "base"), "--data", str(fixture / "data.jsonl"), "--out", str(out), "--loss", "gift",
          "--lr", "3e-3", "--epochs", "2", "--max-steps", "3", "--batch-size", "2", "--grad-accum", "2",
          "--warmup-steps", "1", "--dtype", "float32", "--log-every", "1", "--keep-last", "1", "--save-every", "1",
          "--resume"])
    assert sorted(p.relative_to(old).as_posix() for p in old.rglob("*")) == ["model", "model/notes.txt"]


# -----------------------------------------------------------------------------
# 2. --overwrite deletes wandb/ and ref_betas.pt only when this run wrote them


def test_overwrite_keeps_a_users_wandb_folder_and_ref_betas(base, tmp_path):
    out, star = tmp_path / "run", ("--loss", "gift-star", "--lora", "--max-steps", "1")
    main(train_args(base, out, *star))
    put(out / "wandb", {"notes.txt": "the user's W&B folder"})  # no wandb_run_id: no run of ours logged there
    with pytest.raises(FileExistsError, match="wandb.*nothing was deleted"):
        main(train_args(base, out, *star, "--overwrite"))
    assert kept(out / "wandb", {"notes.txt": "the user's W&B folder"})
    (out / longjob.WANDB_ID).write_text("abc\n")  # a run of ours logged there: its folder goes with it
    main(train_args(base, out, *star, "--overwrite"))
    assert not (out / "wandb").exists() and not (out / longjob.WANDB_ID).exists()
    torch.save({"betas": torch.ones(3)}, out / "ref_betas.pt")  # a user's file of that name
    mine = (out / "ref_betas.pt").read_bytes()
    with pytest.raises(FileExistsError, match="ref_betas.pt.*nothing was deleted"):
        main(train_args(base, out, *star, "--overwrite"))
    assert (out / "ref_betas.pt").read_bytes() == mine


# -----------------------------------------------------------------------------
# 3. A step-N that is a symbolic link is never followed


def test_a_symlinked_step_is_refused_before_anything_is_written(base, tmp_path):
    out, mine = tmp_path / "run", tmp_path / "mine"
    main(train_args(base, out, "--max-steps", "1", "--save-every", "1", "--lora"))
    shutil.copytree(latest(out), mine)  # a user's folder: a copy of a checkpoint, and their notes
    put(mine / "adapter", {"notes.txt": "the user's"})
    before = sorted((p.relative_to(mine), p.read_bytes()) for p in mine.rglob("*") if p.is_file())
    for name in ("step-0000002", "step-0000002.tmp"):
        (out / "checkpoints" / name).symlink_to(mine)
        for flag in ("--resume", "--overwrite"):  # a save, rotation or .tmp clean-up through it; --resume reading it
            with pytest.raises(FileExistsError, match=f"{name}: a symbolic link .*never follows"):
                main(train_args(base, out, "--max-steps", "3", "--save-every", "1", "--keep-last", "1", "--lora", flag))
        (out / "checkpoints" / name).unlink()
    assert sorted((p.relative_to(mine), p.read_bytes()) for p in mine.rglob("*") if p.is_file()) == before
    (out / "checkpoints" / "step-0000002").symlink_to(mine)
    (out / "latest").write_text("step-0000002\n")
    assert longjob.resume_candidates(out) == ["step-0000001"]  # latest naming it: skipped, saying so
    assert "symbolic link" in longjob.checkpoint_problem(out / "checkpoints" / "step-0000002")


def test_a_step_linked_during_the_run_is_not_written_through(base, tmp_path, monkeypatch):
    out, mine = tmp_path / "run", tmp_path / "mine"
    put(mine / "model", {"config.json": "the user's", "model.safetensors": "the user's"})
    put(mine, {"trainer.json": "the user's"})
    real_step = gift.train_step

    def step(*args, **kwargs):  # the link appears after the start-up checks
        if not (out / "checkpoints" / "step-0000001").is_symlink():
            (out / "checkpoints").mkdir(parents=True, exist_ok=True)
            (out / "checkpoints" / "step-0000001").symlink_to(mine)
        return real_step(*args, **kwargs)
    monkeypatch.setattr(gift, "train_step", step)
    with pytest.raises(OSError, match="step-0000001 is a symbolic link"):
        main(train_args(base, out, "--max-steps", "1"))
    assert kept(mine / "model", {"config.json": "the user's", "model.safetensors": "the user's"})
    assert sorted(p.name for p in mine.rglob("*")) == ["config.json", "model", "model.safetensors", "trainer.json"]


# -----------------------------------------------------------------------------
# 4. A user's .lock is never truncated; a full disk at the lock is one line


def test_a_users_lock_file_is_refused_untouched(base, tmp_path):
    out = tmp_path / "run"
    put(out, {".lock": "my notes\n"})
    with pytest.raises(FileExistsError, match=r"\.lock is not a lock a gift.py run wrote"):
        main(train_args(base, out, "--max-steps", "1"))
    assert (out / ".lock").read_text() == "my notes\n"
    (out / ".lock").unlink()
    (out / ".lock").symlink_to(tmp_path / "elsewhere.txt")
    put(tmp_path, {"elsewhere.txt": "pid 1 on a link\n"})
    with pytest.raises(FileExistsError, match=r"\.lock is not a lock"):
        main(train_args(base, out, "--max-steps", "1"))
    assert (tmp_path / "elsewhere.txt").read_text() == "pid 1 on a link\n"
    (out / ".lock").unlink()
    put(out, {".lock": "pid 12 on a-dead-host\n"})  # a lock an ended run left: taken over
    longjob.lock_folder(out).close()
    assert (out / ".lock").read_text() == f"pid {os.getpid()} on {longjob.socket.gethostname()}\n"


def test_a_full_disk_at_the_lock_is_one_line_naming_it(base, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real_open = open

    class Full:  # the lock file, on a full disk
        def __init__(self, f):
            self.f = f

        def __getattr__(self, name):
            return getattr(self.f, name)

        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_open(path, *args, **kwargs):
        f = real_open(path, *args, **kwargs)
        return Full(f) if os.path.basename(path) == ".lock" else f
    monkeypatch.setattr(longjob, "open", full_open, raising=False)
    with pytest.raises(SystemExit) as info:
        longjob.run_command_line(lambda: main(train_args(base, out, "--max-steps", "1")), "gift.py",
                                 errors=(ValueError, OSError, longjob.RunError))
    err = capsys.readouterr().err
    assert info.value.code == 1 and len(err.splitlines()) == 1, err
    assert str(out / ".lock") in err and "No space left on device" in err and not (out / "checkpoints").exists()


# -----------------------------------------------------------------------------
# 5. --wandb-project without wandb: one line, before the model loads


def test_wandb_project_without_wandb_is_refused_before_the_model_loads(base, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: `import wandb` fails

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(gift, "load_inputs", no_loading)
    with pytest.raises(SystemExit):
        main(train_args(base, tmp_path / "run", "--wandb-project", "p", "--max-steps", "1"))
    err = capsys.readouterr().err
    assert "--wandb-project" in err and "wandb package is not installed" in err and not (tmp_path / "run").exists()


# -----------------------------------------------------------------------------
# 6. A weight file's fingerprint reads every byte, past any read buffer


def test_the_fingerprint_sees_the_last_bytes_of_a_file_larger_than_any_read_buffer(tmp_path, monkeypatch):
    monkeypatch.setattr(longjob, "WEIGHT_HASH_CACHE", tmp_path / "cache.json")
    monkeypatch.setattr(longjob, "_weight_hashes", {})
    monkeypatch.setattr(longjob, "RACY_SECONDS", 0)  # cache even a file just written
    folder = tmp_path / "model"
    put(folder, {"config.json": "{}"})
    weights, size = folder / "model.safetensors", 20 << 20  # past file_sha256's 16 MiB reads
    with open(weights, "wb") as f:
        f.truncate(size)  # sparse: quick to write and to read
    try:
        first = longjob.folder_fingerprint(folder)
        assert longjob.file_sha256(weights) == hashlib.sha256(bytes(size)).hexdigest()
        st = weights.stat()
        with open(weights, "r+b") as f:
            f.seek(size - 8)
            f.write(b"changed!")  # the same size
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the same modification time
        assert longjob.folder_fingerprint(folder) != first
        assert longjob.file_sha256(weights) == hashlib.sha256(bytes(size - 8) + b"changed!").hexdigest()
    finally:
        weights.unlink()
