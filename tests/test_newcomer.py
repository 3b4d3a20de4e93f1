"""The newcomer's path, as the README gives it: the main job (a short one here), then sample.py and eval.py on the
path it prints, with no other flag; a prompt the model cannot read; a resume with another number of processes."""

import json
import os
import shlex
import subprocess
import sys

import pytest
from conftest import REPO

import sample


def run(argv, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """`python gift.py`, the embedded default, cut to 30 steps and 24 held-out puzzles: what it prints, and where."""
    out = tmp_path_factory.mktemp("newcomer") / "run"
    result = run(["gift.py", "--out", str(out), "--max-steps", "30", "--eval-puzzles", "24"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result.stdout


def printed_command(stdout, label):
    """The command printed after `label`, ready to run here (python -> this interpreter)."""
    line = next(line for line in stdout.splitlines() if line.startswith(label))
    argv = shlex.split(line[len(label):])
    assert argv[0] == "python"
    return argv[1:]


def test_the_job_says_what_it_runs_and_leaves_results(job):
    out, stdout = job
    first = stdout.splitlines()[:2]
    assert first[0].startswith("data: 19,200 4x4 Sudoku puzzles") and "24 held-out puzzles" in first[0]
    assert "never seen in training" in first[0]
    assert first[1].startswith("gift.py: full fine-tuning, loss gift;") and "1 process on cpu, float32" in first[1]
    assert "30 optimizer steps of 64 examples" in first[1]
    assert any(line.startswith("step 30/30 (epoch 0) | loss ") and "ETA 0:00:00" in line for line in stdout.splitlines())
    results = json.loads((out / "results.json").read_text())
    assert set(results["heldout"]) == {"untrained", "trained"} and results["heldout"]["trained"]["puzzles"] == 24
    assert results["processes"] == 1 and results["options"]["max_steps"] == 30 and results["train_seconds"] > 0
    assert (out / "sudoku_heldout.csv").read_text().count("\n") == 25  # the header and the 24 puzzles
    model = out / "checkpoints" / "step-0000030" / "model"
    assert f"model: {model}" in stdout.splitlines()
    for name in ("generation_defaults.json", "sudoku_heldout.csv", "tokenizer.json", "config.json"):
        assert (model / name).is_file(), name


def test_the_printed_commands_work_with_no_other_flag(job):
    out, stdout = job
    chat = run(printed_command(stdout, "chat with it:"))
    assert chat.returncode == 0 and chat.stdout.strip(), chat.stderr[-2000:]
    evaluation = run(printed_command(stdout, "evaluate it:"))
    assert evaluation.returncode == 0, evaluation.stderr[-2000:]
    assert "sudoku: 24 items" in evaluation.stdout and "plain prompts" in evaluation.stdout
    assert "gen_length 34, steps 34, block 34" in evaluation.stdout and "sudoku accuracy:" in evaluation.stdout
    # the run folder and the checkpoint folder name the same model
    assert run(["eval.py", "--model", str(out), "--task", "sudoku", "--limit", "2"]).returncode == 0


def test_sample_uses_the_models_own_generation_settings(job, monkeypatch, capsys):
    out, _ = job
    seen = {}

    def fake_generate(model, prompt, **kw):
        seen.update(kw)
        return prompt.new_zeros(1, prompt.shape[1] + kw["gen_length"])
    monkeypatch.setattr(sample, "generate", fake_generate)
    sample.main(["--model", str(out), "--prompt", "Solve the following Sudoku puzzle: 0123030100043400"])
    assert (seen["gen_length"], seen["block_length"], seen["steps"]) == (34, 34, 34)
    sample.main(["--model", str(out), "--prompt", "Solve", "--gen-length", "8", "--block-length", "4"])
    assert (seen["gen_length"], seen["block_length"], seen["steps"]) == (8, 4, 34)  # a flag overrides
    capsys.readouterr()


def test_a_prompt_the_model_cannot_read_is_one_line(job):
    out, _ = job
    result = run(["sample.py", "--model", str(out), "--prompt", "Hello, Sudoku: 0123"])
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == ("sample.py: the prompt has characters this model's tokenizer cannot encode: 'H' "
                                     "(U+0048), ',' (U+002C); this model reads only "
                                     "'\\n :/<>0123456789Sabcdefghijklmnopqrstuvwxyz'")
    result = run(["eval.py", "--model", str(out), "--task", "sudoku", "--prompt-style", "d1"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "a d1 prompt has characters this model's tokenizer cannot encode" in result.stderr
    assert "--prompt-style plain" in result.stderr


def test_resume_with_another_number_of_processes_says_so(job, tmp_path):
    out, _ = job
    trainer = out / "checkpoints" / "step-0000030" / "trainer.json"
    meta = json.loads(trainer.read_text())
    trainer.write_text(json.dumps(dict(meta, world_size=2)))  # as if torchrun --nproc_per_node 2 had written it
    try:
        result = run(["gift.py", "--out", str(out), "--max-steps", "30", "--eval-puzzles", "24", "--resume"])
    finally:
        trainer.write_text(json.dumps(meta))
    assert result.returncode != 0
    assert ("was written by 2 processes, this is 1: resume with the same number (`torchrun --nproc_per_node 2 "
            "gift.py ... --resume`)") in result.stderr
    assert "batch_size" not in result.stderr
