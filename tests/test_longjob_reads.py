"""Issue 53's reads (longjob.py): a damaged record of an adapter's base is refused, never taken for none (item 6); a
user's line at the end of eval.py's records is never cut away as a torn record (item 8); a file the project reads as
JSON or JSONL that is not a regular file (a FIFO) is refused before it can block (item 10). Each fails before the fix."""

import os
import subprocess
import sys

import pytest
from conftest import REPO, tiny_model

import longjob
from adapters import ADAPTER_BASE, save_adapter
from model import add_lora


@pytest.fixture
def adapter(tmp_path):
    """(a saved model folder, an adapter folder whose ADAPTER_BASE records that folder's fingerprint)."""
    model = tiny_model(seed=3)
    model.save_pretrained(tmp_path / "base")
    save_adapter(add_lora(model, targets=("q_proj",)), tmp_path / "adapter",
                 base_fingerprint=longjob.folder_fingerprint(tmp_path / "base"))
    return tmp_path / "base", tmp_path / "adapter"


# -----------------------------------------------------------------------------
# item 6: an adapter_base.json that exists but cannot be read is refused in one line naming it


@pytest.mark.parametrize("damaged", [b"[1,2]", b"", b"null", b"\xff\xfe\x00garbage", b"{}", b'{"base_fingerprint": 5}'])
def test_a_damaged_adapter_base_record_is_refused_naming_it(adapter, damaged):
    """Read as "no record" before, the adapter was then applied to any base; now one line naming the file."""
    base, folder = adapter
    longjob.check_adapter(base, folder)  # the intact record: its own base is accepted
    (folder / ADAPTER_BASE).write_bytes(damaged)
    with pytest.raises(ValueError) as err:
        longjob.check_adapter(base, folder)
    assert str(folder / ADAPTER_BASE) in str(err.value) and "\n" not in str(err.value)
    (folder / ADAPTER_BASE).unlink()  # no record at all (PEFT's own adapter): not checked, as before
    longjob.check_adapter(base, folder)


# -----------------------------------------------------------------------------
# item 8: only a last line that begins like a record is a torn one; a user's note there is refused, never cut away

SETTINGS = {"task": "gsm8k", "gen_length": 64, "model": "m"}


def records_file(path):
    """Two records as eval.py writes them (graded_records' fields, longjob.append_records' lines): the file, a line."""
    lock = longjob.append_records(path, [dict(index=0, seed=0, question="q", generation="5", correct=True)], SETTINGS)
    lock.close()
    return path, (
        '{"index": 12, "seed": 3, "question": "q 7", "generation": "5", "correct": false, "settings": '
        '{"task": "gsm8k", "gen_length": 64, "model": "m"}}\n').encode()


def test_a_torn_record_is_cut_at_every_byte(tmp_path):
    """A kill mid-write leaves any prefix of a record's line (no line break): cut off, the rest kept (as before)."""
    path, line = records_file(tmp_path / "r.jsonl")
    whole = path.read_bytes()
    for k in range(1, len(line)):
        path.write_bytes(whole + line[:k])
        assert list(longjob.read_records(path, SETTINGS)) == [(0, 0)], line[:k]
        assert path.read_bytes() == whole


@pytest.mark.parametrize("note", [b"my note: rerun with --limit 16", b"# greedy, 8 items", b"[1, 2]", b"{ note }"])
def test_a_users_note_as_the_last_line_is_refused_untouched(tmp_path, note):
    """Cut away as a torn record before; now the file is not eval.py's records: one line naming it, nothing changed."""
    path, _ = records_file(tmp_path / "r.jsonl")
    path.write_bytes(path.read_bytes() + note)
    before = path.read_bytes()
    with pytest.raises(ValueError) as err:
        longjob.read_records(path, SETTINGS)
    assert f"{path}, line 2: not an eval.py records file" in str(err.value) and "\n" not in str(err.value)
    assert path.read_bytes() == before


# -----------------------------------------------------------------------------
# item 10: a FIFO where a JSON or JSONL file is read is refused (model.open_regular), never read (it would block)

FIFO_CALLS = {  # each in a process of its own, which a blocked read cannot hang the suite with
    "eval.py --out": "import argparse, longjob; longjob.open_output(argparse.ArgumentParser(), argparse.Namespace("
                     "out=FIFO, data=None, shot_data=None))",
    "harness.py --out": "import harness; harness.check_harness_out(Path(FIFO))",
    "records": "import longjob; longjob.read_records(Path(FIFO), {})",
    "read_json": "import model; model.read_json(FIFO)",
    "json_or_empty": "import longjob; assert longjob.json_or_empty(FIFO) == {}",
}


def run_on_fifo(code, fifo, timeout=120):
    """`code` run with FIFO naming a FIFO no one writes to: (exit status, stderr), or a failure if it blocked."""
    script = f"import sys; from pathlib import Path; FIFO = {str(fifo)!r}; sys.path.insert(0, {str(REPO)!r}); {code}"
    try:
        done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"blocked on the FIFO {fifo} for {timeout} s: {code}")
    return done.returncode, done.stderr


@pytest.mark.parametrize("what", FIFO_CALLS)
def test_a_fifo_is_refused_before_it_is_read(tmp_path, what):
    """Each read returns at once: a refusal (one line naming the file), or json_or_empty's "no such record"."""
    fifo = tmp_path / ("r.jsonl" if what == "records" else "out.json")
    os.mkfifo(fifo)
    status, said = run_on_fifo(FIFO_CALLS[what], fifo)
    if what == "json_or_empty":
        assert status == 0, said
    else:
        assert status != 0 and str(fifo) in said.strip().splitlines()[-1], said


def test_an_adapter_base_record_that_is_a_fifo_is_refused(adapter):
    """check_adapter blocked on a FIFO at adapter_base.json; now it is refused as a record that cannot be read."""
    base, folder = adapter
    (folder / ADAPTER_BASE).unlink()
    os.mkfifo(folder / ADAPTER_BASE)
    status, said = run_on_fifo(f"import longjob; longjob.check_adapter({str(base)!r}, {str(folder)!r})",
                               folder / ADAPTER_BASE)
    assert status != 0 and "ValueError" in said and f"{folder / ADAPTER_BASE}: not a regular file" in said, said

