"""A run's safety: no code runs from a checkpoint, ranks on different inputs,
what a checkpoint exports, signals and status.json, resume naming the file that changed, rotation of a read-only
checkpoint, a user's folder under checkpoints/. Each test names its case."""

import contextlib
import json
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, latest, metrics, train_args

import gift
import longjob
from gift import main

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]

# gift.py's command line with test hooks read from the environment: RANK1_DATA (rank 1 reads another --data),
# SLOW_SETUP (seconds of sleep before the data loads), SLOW_SAVE (seconds of sleep before each checkpoint); each
# hook is patched in the module that calls it (gift.py loads the data, longjob.py saves the checkpoints) and, when
# it runs, appends its name to the file HOOKS_FIRED names (the test asserts that it ran)
WRAPPER = textwrap.dedent(f"""
    import os, sys, time
    sys.path.insert(0, {str(REPO)!r})
    import gift, longjob
    argv = sys.argv[1:]
    if os.environ.get("RANK") == "1" and os.environ.get("RANK1_DATA"):
        argv[argv.index("--data") + 1] = os.environ["RANK1_DATA"]
    for module, name, hook in ((gift, "load_dataset", "SLOW_SETUP"), (longjob, "save_checkpoint", "SLOW_SAVE")):
        if os.environ.get(hook):
            def slow(*a, _real=getattr(module, name), _s=float(os.environ[hook]), _name=name, **k):
                with open(os.environ["HOOKS_FIRED"], "a") as f:
                    f.write(_name + "\\n")
                time.sleep(_s)
                return _real(*a, **k)
            setattr(module, name, slow)
    try:  # as gift.py's own command line: a user's mistake in one line from rank 0
        gift.main(argv)
    except (ValueError, OSError, getattr(gift, "RunError", ValueError)) as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"gift.py: error: {{e}}", file=sys.stderr)
        sys.exit(1)
""")


@pytest.fixture
def wrapper(tmp_path):
    path = tmp_path / "gift_hooks.py"
    path.write_text(WRAPPER)
    return str(path)


def status(out):
    return json.loads((out / "status.json").read_text())


def fired(path):
    """The wrapper's hooks that ran, in order (the file HOOKS_FIRED names)."""
    return path.read_text().split() if path.exists() else []


def wait_for(condition, proc, timeout=60):
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended first ({proc.returncode}): " + (proc.stderr.read() if proc.stderr
                                                                                 else ""))
        if time.time() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


def has_record(out):
    return lambda: (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 1


def no_traceback_from_us(text):
    return "Traceback" not in text and 'gift.py", line' not in text


# -----------------------------------------------------------------------------
# Case 1: no code runs from a checkpoint


class Planted:
    """A pickle that creates a file when unpickled."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_pickle_in_a_checkpoint_runs_no_code(base, tmp_path, capsys):
    out, marker = tmp_path / "run", tmp_path / "pwned"
    main(train_args(base, out, "--max-steps", "2", "--save-every", "1", "--keep-last", "2"))
    (latest(out) / "train_state" / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    capsys.readouterr()
    main(train_args(base, out, "--max-steps", "3", "--save-every", "1", "--keep-last", "2", "--resume"))
    said = capsys.readouterr().out
    assert not marker.exists()
    assert "skipping" in said and "step-0000002: train_state/.metadata is unreadable" in said and "posix.system" in said
    assert "resumed from" in said and "step-0000001" in said
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    for ckpt in (out / "checkpoints").iterdir():  # every checkpoint planted: refused in one line
        (ckpt / "train_state" / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(longjob.RunError, match="no usable checkpoint.*unreadable"):
        main(train_args(base, out, "--max-steps", "4", "--resume"))
    assert not marker.exists()


def test_the_optimizer_settings_in_a_shard_are_read_without_running_code(tmp_path):
    import io
    marker = tmp_path / "pwned"
    planted = io.BytesIO()
    torch.save(Planted(marker), planted)
    planted.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        longjob.CheckpointLoadPlanner().load_bytes(None, planted)
    assert not marker.exists()


def test_the_gift_star_cache_is_read_as_weights_only(base, tmp_path, monkeypatch):
    out, marker = tmp_path / "star", tmp_path / "pwned"
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # a user's environment: torch.load's default unsafe
    main(train_args(base, out, "--loss", "gift-star", "--lora", "--max-steps", "1"))
    torch.save({"key": Planted(marker)}, out / "ref_betas.pt")
    main(train_args(base, out, "--loss", "gift-star", "--lora", "--max-steps", "2", "--resume"))
    assert not marker.exists()


# -----------------------------------------------------------------------------
# Case 2: ranks on different data


def test_ranks_on_different_data_are_refused(base, tmp_path, wrapper):
    other = tmp_path / "other.jsonl"
    rows = (base / "data.jsonl").read_text().splitlines()
    row = json.loads(rows[0])
    other.write_text("\n".join([json.dumps(dict(row, response=row["response"][::-1]))] + rows[1:]) + "\n")
    out = tmp_path / "run"
    result = subprocess.run(TORCHRUN + [wrapper, *train_args(base, out, "--max-steps", "2", batch_size=1)],
                            env=dict(ENV, RANK1_DATA=str(other)), capture_output=True, text=True, timeout=120)
    said = result.stdout + result.stderr
    assert result.returncode != 0, said[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("gift.py: error:")]
    assert len(errors) == 1 and "the ranks read different training data" in errors[0], said[-3000:]
    assert "rank 0: " in errors[0] and "rank 1: " in errors[0] and 'gift.py", line' not in said
    assert status(out)["state"] == "failed" and not (out / "checkpoints").exists()


# -----------------------------------------------------------------------------
# Case 6: what a checkpoint's model folder copies from the base folder


def test_a_checkpoint_copies_only_what_a_model_folder_needs(base, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(base / "model", model)
    needed = ["tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "modeling_llada.py",
              "configuration_llada.py", "generation_utils.py", "tokenization_dream.py"]
    for name in needed:
        (model / name).write_text("{}\n")
    (model / "pytorch_model.bin").write_bytes(b"\0" * 1024)  # 16 GB at 8B
    (model / "my_notes.txt").write_text("a user's file")
    main(train_args(base, tmp_path / "run", "--max-steps", "1", "--model", str(model)))
    exported = {p.name for p in (latest(tmp_path / "run") / "model").iterdir()}
    assert set(needed) | {"tokenizer.json", "config.json", "model.safetensors"} <= exported
    assert "pytorch_model.bin" not in exported and "my_notes.txt" not in exported


# -----------------------------------------------------------------------------
# Case 7: signals and status.json


def test_a_repeated_sigterm_is_one_notice_and_a_late_one_exits_at_once_saying_so(base, tmp_path, wrapper):
    extra = ("--lora", "--epochs", "1000", "--save-every", "1000")
    out = tmp_path / "twice"  # the second signal during the checkpoint the first asked for (a slow one)
    proc = subprocess.Popen([sys.executable, wrapper, *train_args(base, out, *extra)],
                            env=dict(ENV, SLOW_SAVE="1", HOOKS_FIRED=str(tmp_path / "twice.fired")),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(has_record(out), proc)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)  # Slurm's signal and torchrun's copy of it
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and status(out)["state"] == "preempted"  # with a checkpoint
    assert status(out)["checkpoint"] == str(latest(out))
    assert "save_checkpoint" in fired(tmp_path / "twice.fired")  # the slow save ran
    out = tmp_path / "late"  # a second signal during a slow checkpoint: no waiting, but status.json says so
    proc = subprocess.Popen([sys.executable, wrapper, *train_args(base, out, *extra)],
                            env=dict(ENV, SLOW_SAVE="20", HOOKS_FIRED=str(tmp_path / "late.fired")),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(has_record(out), proc)
        proc.send_signal(signal.SIGTERM)
        time.sleep(2.5)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=5)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM
    assert status(out)["state"] == "preempted" and status(out)["exit_code"] == 128 + signal.SIGTERM
    assert "exiting now without a checkpoint" in proc.stderr.read()
    assert "save_checkpoint" in fired(tmp_path / "late.fired")  # the slow save ran


def test_ctrl_c_is_interrupted_in_one_line_with_a_checkpoint(base, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(REPO / "gift.py"),
                             *train_args(base, out, "--lora", "--epochs", "1000", "--save-every", "1000")],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(has_record(out), proc)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT and no_traceback_from_us(stderr), stderr[-3000:]
    assert [line for line in stderr.splitlines() if line.strip()] == [
        "SIGINT: finishing this step, then a checkpoint and exit (send it again to exit at once)"], stderr
    assert "interrupted by SIGINT at step" in stdout and status(out)["state"] == "interrupted"
    assert status(out)["checkpoint"] == str(latest(out))


def test_sigterm_during_a_slow_set_up_exits_at_once_with_status(base, tmp_path, wrapper):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, wrapper, *train_args(base, out)],
                            env=dict(ENV, SLOW_SETUP="60", HOOKS_FIRED=str(tmp_path / "setup.fired")),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:  # the signal comes inside the slow set-up: once its hook has fired (status.json is written before it)
        wait_for(lambda: "load_dataset" in fired(tmp_path / "setup.fired"), proc)
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert time.time() - t0 < 5 and proc.returncode == -signal.SIGTERM
    assert status(out)["state"] == "preempted" and status(out)["checkpoint"] is None


def test_an_unwritable_status_file_is_said_once(base, tmp_path, capsys):
    out = tmp_path / "run"
    (out / "status.json").mkdir(parents=True)  # cannot be replaced by a file
    main(train_args(base, out, "--max-steps", "3", "--save-every", "1"))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "status.json" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: cannot write") and str(out) in warnings[0]


def test_sigusr1_to_torchrun_checkpoints_the_workers(base, tmp_path):
    """torchrun passes SIGTERM on, but dies of SIGUSR1 and leaves its workers (in sessions of their own) running:
    they notice their launcher is gone, checkpoint and stop; status.json says preempted."""
    out = tmp_path / "run"
    proc = subprocess.Popen(TORCHRUN + [str(REPO / "gift.py"),
                                        *train_args(base, out, "--lora", "--epochs", "1000", "--max-steps", "300",
                                                    "--save-every", "1000",
                                                    batch_size=1)],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(has_record(out), proc)
        proc.send_signal(signal.SIGUSR1)
        output, _ = proc.communicate(timeout=60)  # the workers hold the pipe until they end
    finally:
        proc.kill()
    assert status(out)["state"] == "preempted", output[-3000:]
    assert status(out)["checkpoint"] == str(latest(out)) and status(out)["step"] < 300


# -----------------------------------------------------------------------------
# Case 11: --resume names the file that changed; a read-only old checkpoint


def test_resume_names_the_base_file_that_changed_and_ignores_formatting(base, tmp_path):
    model, out = tmp_path / "model", tmp_path / "run"
    shutil.copytree(base / "model", model)
    args = lambda steps, *extra: train_args(base, out, "--max-steps", steps, "--model", str(model), *extra)
    main(args("1"))
    for name in ("config.json", "tokenizer.json"):  # the same content, formatted differently
        content = json.loads((model / name).read_text())
        (model / name).write_text(json.dumps(dict(reversed(list(content.items()))), indent=3))
    main(args("2", "--resume"))
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # another tokenizer: the data's ids change with it
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="base model changed since .*: its tokenizer.json \\(fingerprint"):
        main(args("3", "--resume"))
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    trainer = latest(out) / "trainer.json"  # a checkpoint of an older gift.py: no per-file fingerprints
    meta = json.loads(trainer.read_text())
    del meta["fingerprints"]["files"]
    trainer.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="base model changed since .*: fingerprint"):  # the whole folder's
        main(args("3", "--resume"))


def test_a_read_only_old_checkpoint_is_kept_whole_and_said_once(base, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    main(train_args(base, out, "--max-steps", "1", "--save-every", "1", "--keep-last", "1"))
    old = latest(out)
    for d in [old, *(p for p in old.rglob("*") if p.is_dir())]:
        d.chmod(0o555)
    hooked = []  # the hooks that ran (root only)
    if os.geteuid() == 0:  # root ignores the modes: read them as the kernel does for a user
        real_access = os.access

        def access(path, mode, **k):
            hooked.append("access")
            return bool(os.stat(path).st_mode & stat.S_IWUSR) if mode == os.W_OK else real_access(path, mode, **k)

        def rmtree(path, ignore_errors=False, **k):  # a user's rmtree in a read-only tree: removes what it can
            hooked.append("rmtree")
            for folder, dirs, files in os.walk(path, topdown=False):
                if os.stat(folder).st_mode & stat.S_IWUSR:
                    for name in files + dirs:
                        with contextlib.suppress(OSError):
                            (os.rmdir if name in dirs else os.unlink)(os.path.join(folder, name))
            with contextlib.suppress(OSError):
                os.rmdir(path)
        monkeypatch.setattr(longjob.os, "access", access)
        monkeypatch.setattr(longjob.shutil, "rmtree", rmtree)
    capsys.readouterr()
    try:
        main(train_args(base, out, "--max-steps", "3", "--save-every", "1", "--keep-last", "1", "--resume"))
    finally:
        for d in [old, *(p for p in old.rglob("*") if p.is_dir())]:
            d.chmod(0o755)
    said = capsys.readouterr().err
    assert os.geteuid() != 0 or {"access", "rmtree"} <= set(hooked)  # as root, the hooks ran
    assert said.count("cannot delete the old checkpoint") == 1 and "step-0000001" in said
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000001", "step-0000003"]
    assert longjob.checkpoint_problem(old) is None  # whole


# -----------------------------------------------------------------------------
# Cases 14 and 15a: status.json's checkpoint path; a user's folder under checkpoints/


def test_status_names_the_checkpoint_by_its_absolute_path(base, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(train_args(base, Path("run"), "--max-steps", "1"))
    assert status(tmp_path / "run")["checkpoint"] == str(tmp_path / "run" / "checkpoints" / "step-0000001")


def test_overwrite_refuses_a_users_folder_in_checkpoints(base, tmp_path):
    out = tmp_path / "run"
    main(train_args(base, out, "--max-steps", "1"))
    (out / "checkpoints" / "best").mkdir()
    (out / "checkpoints" / "best" / "notes.txt").write_text("the user's")
    with pytest.raises(FileExistsError, match="best.*nothing was deleted"):
        main(train_args(base, out, "--max-steps", "1", "--overwrite"))
    shutil.move(out / "checkpoints" / "best" / "notes.txt", latest(out) / "notes.txt")  # in a folder named like ours
    shutil.rmtree(out / "checkpoints" / "best")
    with pytest.raises(FileExistsError, match="notes.txt.*nothing was deleted"):
        main(train_args(base, out, "--max-steps", "1", "--overwrite"))
    assert (latest(out) / "notes.txt").read_text() == "the user's"
