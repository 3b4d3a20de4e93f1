"""--wandb-project: every metrics.jsonl record also goes to a Weights & Biases run, which --resume continues; a run
without the flag imports nothing new. Tested without network and without the wandb package: a stand-in module records
what gift.py asks of it (the real one takes the same calls: wandb.init(project, id, resume, dir, config), run.log)."""

import sys
import types

import pytest
from conftest import metrics, train_args

import gift
import longjob


class StandIn:
    """A stand-in for the wandb module: init() returns a run whose log() calls are kept."""

    def __init__(self):
        self.inits, self.logged = [], []

    def module(self):
        wandb = types.ModuleType("wandb")

        def init(**kwargs):
            self.inits.append(kwargs)
            return types.SimpleNamespace(log=lambda data, step: self.logged.append((step, data)))
        wandb.init = init
        return wandb


def test_records_go_to_one_wandb_run_that_resume_continues(base, tmp_path, monkeypatch):
    stand_in = StandIn()
    monkeypatch.setitem(sys.modules, "wandb", stand_in.module())
    out = tmp_path / "run"
    gift.main(train_args(base, out, "--wandb-project", "gift-test", "--max-steps", "2"))
    (init,) = stand_in.inits
    run_id = (out / longjob.WANDB_ID).read_text().strip()
    assert init["project"] == "gift-test" and init["id"] == run_id and init["resume"] == "allow"
    assert init["dir"] == str(out) and init["config"]["wandb_project"] == "gift-test"
    records = metrics(out)
    assert [step for step, _ in stand_in.logged] == [r["step"] for r in records] == [1, 2]
    for (_, data), record in zip(stand_in.logged, records):
        assert data["loss"] == record["loss"] and data["lr"] == record["lr"] and "step" not in data

    gift.main(train_args(base, out, "--wandb-project", "gift-test", "--max-steps", "3", "--resume"))
    assert [i["id"] for i in stand_in.inits] == [run_id, run_id]  # the same W&B run
    assert [step for step, _ in stand_in.logged][-1] == 3


def test_a_run_without_the_flag_imports_no_tracker(base, tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    gift.main(train_args(base, tmp_path / "run", "--max-steps", "1"))
    assert "wandb" not in sys.modules and not (tmp_path / "run" / longjob.WANDB_ID).exists()


def test_overwrite_deletes_the_tracker_id_with_the_run(base, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", StandIn().module())
    out = tmp_path / "run"
    gift.main(train_args(base, out, "--wandb-project", "p", "--max-steps", "1"))
    first = (out / longjob.WANDB_ID).read_text()
    with pytest.raises(FileExistsError, match="already holds a run"):
        gift.main(train_args(base, out, "--max-steps", "1"))
    gift.main(train_args(base, out, "--wandb-project", "p", "--max-steps", "1", "--overwrite"))
    assert (out / longjob.WANDB_ID).read_text() != first  # a new run, a new W&B run
