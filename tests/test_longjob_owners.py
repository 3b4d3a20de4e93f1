"""Issue 53's ownership rules (longjob.py): one eval.py per --out at a time, the second refused naming the first
(item 7). Each test fails before the fix."""

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from test_eval import record_lines, sudoku_checkpoint

import eval as E
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
    """A real second `python eval.py` on the same --out, started while the first runs (before its first batch is
    written, and after): it ran to the end before (exit 0, every record twice, the summary replaced); now it exits at
    once, one error line naming the first (pid, host), and the first ends as it would alone."""
    argv = sudoku_checkpoint(tmp_path, 4) + ["--batch-size", "2", "--out", str(tmp_path / "r.json")]
    seconds = []

    def second_eval_then_append(path, records, settings):  # the first's batch is graded: the second starts now
        seconds.append(subprocess.run([sys.executable, "eval.py", *argv], cwd=REPO, capture_output=True, text=True,
                                      timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}))
        return append_records(path, records, settings)
    append_records = E.append_records
    monkeypatch.setattr(E, "append_records", second_eval_then_append)
    E.main(argv)  # the first: returns (exit 0)
    assert len(seconds) == 2  # two batches of 2
    for second in seconds:
        said = second.stderr.strip().splitlines()
        assert second.returncode != 0 and "Traceback" not in second.stderr, second.stderr
        assert said[-1].startswith(f"eval.py: error: --out {tmp_path / 'r.json'}: another eval.py is writing "
                                   f"{tmp_path / 'r.jsonl'} (pid {os.getpid()} on {socket.gethostname()})"), said
    assert sorted(r["index"] for r in record_lines(tmp_path / "r.jsonl")) == [0, 1, 2, 3]  # each once
    assert json.loads((tmp_path / "r.json").read_text())["n_items"] == 4
    monkeypatch.undo()
    E.main(argv)  # released at the first's end: the same command continues (nothing left to generate)
    assert len(record_lines(tmp_path / "r.jsonl")) == 4
