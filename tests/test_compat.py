"""On-disk compatibility with ebf2705, the layout before gift.py, model.py, sample.py and eval.py were restructured:
a run, a LoRA adapter and an eval.py records file written at ebf2705 (tests/data/ebf2705, whose README.md says how)
resume or are recognised, with the fingerprints they recorded, and a resumed run equals an unstopped one bit for bit.
Only the command lines and the files are used, so these tests hold whichever module a name lives in."""

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import REPO

FIXTURE = REPO / "tests" / "data" / "ebf2705"
ORIGIN = "/tmp/ebf2705"  # the folder the fixture was made in: the eval records' settings name paths under it
STEP2 = "checkpoints/step-0000002"
# gift.py's options of the fixture's run/ and lora/ (its README), --out, --save-every and --resume aside
RUN = ("--loss", "gift", "--lr", "3e-3", "--epochs", "2", "--max-steps", "4", "--batch-size", "2", "--grad-accum", "2",
       "--warmup-steps", "1", "--dtype", "float32", "--log-every", "1", "--keep-last", "2")
# eval.py's options of the fixture's eval/ records, --model, --data and --out aside
EVAL = ("--task", "sudoku", "--limit", "4", "--prompt-style", "plain", "--gen-length", "24", "--steps", "12",
        "--block-length", "8", "--batch-size", "2")
LORA = ("--lora", "--lora-r", "2", "--lora-alpha", "4", "--lora-dropout", "0.1")  # the fixture's lora/ besides RUN
SAMPLE = ("--prompt", "Solve 1234", "--gen-length", "8", "--steps", "4", "--block-length", "4", "--device", "cpu")
TIMED = {"elapsed_s", "eta_s", "tokens_per_s"}  # metrics.jsonl fields that are measured, not computed


def command(script, *args):
    """python <script> args, run in the repository root on the CPU (as the fixture was made); its CompletedProcess."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, script, *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def together(*calls):
    """Several command(script, *args) calls, `calls` their argument tuples, run at the same time (each process
    one thread): their CompletedProcess, in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: command(*call), calls))


def said(result):
    return f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def fixture_copy(root):
    """A copy of the fixture in `root` (nothing writes into the repository's)."""
    return shutil.copytree(FIXTURE, root / "ebf2705")


def resume(f, out, *extra):
    """gift.py's arguments to --resume the run in `out`, with the fixture run's options and the copy `f`'s base and
    data."""
    return ("gift.py", "--model", f / "base", "--data", f / "data.jsonl", "--out", out, *RUN, *extra, "--resume")


def printed(result):
    assert result.returncode == 0, said(result)
    return result.stdout


def kill_9_after(out, step):
    """What a kill -9 in the save of the step after `step` leaves: that checkpoint gone, `latest` naming `step`'s."""
    name = f"step-{step:07d}"
    for ckpt in (out / "checkpoints").iterdir():
        if ckpt.name > name:
            shutil.rmtree(ckpt)
    (out / "latest").write_text(name + "\n")


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def trainer(ckpt):
    return json.loads((ckpt / "trainer.json").read_text())


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """The fixture's runs (stopped after step 2 of 4) resumed by this code. The full fine-tuning run: once to step 4
    with the options it was started with, and, from another copy, twice (a checkpoint every step, a kill -9 in step
    4's save, --resume again). The LoRA run: once (a checkpoint every step), and twice from a copy of that after a
    kill -9 in step 4's save. Returns ({"full" | "lora": (once, twice)}, what each --resume printed)."""
    f = fixture_copy(tmp_path_factory.mktemp("compat"))
    full, lora = (f / "run", f / "twice"), (f / "lora", f / "lora_twice")
    shutil.copytree(full[0], full[1])
    # save_every may change at --resume
    first = together(resume(f, full[0], "--save-every", "2"), resume(f, full[1], "--save-every", "1"),
                     resume(f, lora[0], *LORA, "--save-every", "1"))
    shutil.copytree(lora[0], lora[1])
    for run in (full[1], lora[1]):
        kill_9_after(run, 3)
    second = together(resume(f, full[1], "--save-every", "1"), resume(f, lora[1], *LORA, "--save-every", "1"))
    return dict(full=full, lora=lora), [printed(result) for result in first + second]


def test_runs_stopped_at_ebf2705_resume_from_their_step_2_and_finish(resumed):
    """The old checkpoints are taken as they are (options, fingerprints, train state, RNG states, metrics): --resume
    continues each at step 2 instead of refusing it or starting over, and the run ends at step 4."""
    runs, outputs = resumed
    (once, twice), (lora, lora_twice) = runs["full"], runs["lora"]
    for out, run, step in ((0, once, 2), (1, twice, 2), (2, lora, 2), (3, twice, 3), (4, lora_twice, 3)):
        assert f"resumed from {run / 'checkpoints' / f'step-{step:07d}'}: step {step} (" in outputs[out], outputs[out]
    for kind, old in (("full", "run"), ("lora", "lora")):
        out = runs[kind][0]
        assert (out / "latest").read_text().strip() == "step-0000004"
        assert trainer(out / "checkpoints" / "step-0000004")["state"]["step"] == 4
        assert json.loads((out / "status.json").read_text())["state"] == "done"
        # the old run's records of steps 1-2 kept as they were written, its 3-4 (a kill -9 left them) written again
        then = (FIXTURE / old / "metrics.jsonl").read_text().splitlines()
        now = (out / "metrics.jsonl").read_text().splitlines()
        assert now[:2] == then[:2] and [r["step"] for r in map(json.loads, now)] == [1, 2, 3, 4]


@pytest.mark.parametrize("kind,weights", [("full", "model/model.safetensors"),
                                          ("lora", "adapter/adapter_model.safetensors")])
def test_resumed_once_equals_resumed_twice_bit_for_bit(resumed, kind, weights):
    """A step resumed from a checkpoint the old code wrote (step 3 from step 2's) equals the step run on unstopped
    in the same process: the same step-4 weights file byte for byte, the same metrics of steps 3-4 (the old step-2
    RNG states, LoRA dropout's included, schedule and optimizer state are restored exactly). The step-4 weights are
    not compared with the fixture's own unstopped run's: other CPUs may give other bits."""
    runs, _ = resumed
    once, twice = runs[kind]
    weights = f"checkpoints/step-0000004/{weights}"
    assert (once / weights).read_bytes() == (twice / weights).read_bytes()
    a, b = records(once / "metrics.jsonl"), records(twice / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [{k: v for k, v in r.items() if k not in TIMED} for r in a[2:]] == \
           [{k: v for k, v in r.items() if k not in TIMED} for r in b[2:]]


def test_fingerprints_recorded_at_ebf2705_are_this_codes(resumed):
    """The fingerprints of the base (the whole folder and file by file) and of the data that ebf2705 recorded are
    what this code computes of the same files, byte for byte: --resume refuses a changed fingerprint, and an old
    run, adapter or records file would be refused (or a changed base taken for the old one) if the recipe moved."""
    runs, _ = resumed
    for kind, old in (("full", "run"), ("lora", "lora")):
        then = trainer(FIXTURE / old / STEP2)["fingerprints"]
        assert set(then) >= {"data", "examples", "model", "files"}
        for run in runs[kind]:
            assert trainer(run / "checkpoints" / "step-0000004")["fingerprints"] == then


def test_an_ebf2705_adapter_loads_on_its_base_and_is_refused_on_another(tmp_path):
    """sample.py takes the old LoRA checkpoint's adapter on the base it was trained on (the fingerprint its
    trainer.json recorded matches) and answers; on another model of the same shape (the run's step-2 model) it
    refuses it in one line naming the fingerprint recorded."""
    f = fixture_copy(tmp_path)
    adapter = f / "lora" / STEP2 / "adapter"
    result, other = together(("sample.py", "--model", f / "base", "--adapter", adapter, *SAMPLE),
                             ("sample.py", "--model", f / "run" / STEP2 / "model", "--adapter", adapter, *SAMPLE))
    assert result.returncode == 0 and result.stdout.strip(), said(result)
    recorded = trainer(f / "lora" / STEP2)["fingerprints"]["model"]
    assert other.returncode != 0 and "Traceback" not in other.stderr, said(other)
    assert "fingerprint" in other.stderr and recorded in other.stderr, said(other)


def relocate(path, root):
    """Rewrite the fixture file `path`'s recorded paths under ORIGIN to the same paths under `root` (eval.py keeps
    absolute paths in its settings and continues a records file only with the same settings)."""
    old, new = (json.dumps(str(p))[1:-1] + "/" for p in (ORIGIN, root))
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_ebf2705_eval_records_are_continued_without_generating(tmp_path):
    """The same eval.py command rerun on the old records finds every graded item (the model fingerprint and the
    settings it recorded are this code's) and generates nothing: records.jsonl unchanged byte for byte, the summary
    written again the same, accuracy included."""
    f = fixture_copy(tmp_path)
    out = f / "eval" / "records.json"
    summary = json.loads(out.read_text())
    assert summary["model"] == f"{ORIGIN}/run/{STEP2}/model"  # where the fixture was made
    for path in (out, out.with_suffix(".jsonl")):
        relocate(path, f)
    before, summary = out.with_suffix(".jsonl").read_bytes(), json.loads(out.read_text())
    assert len(before.splitlines()) == 4
    result = command("eval.py", "--model", f / "run" / STEP2 / "model", "--data", f / "eval" / "sudoku.csv",
                     *EVAL, "--out", out)
    assert result.returncode == 0, said(result)
    assert f"{out.with_suffix('.jsonl')}: 4 graded items found" in result.stdout, said(result)
    assert out.with_suffix(".jsonl").read_bytes() == before
    again = json.loads(out.read_text())
    assert again["accuracy_mean"] == summary["accuracy_mean"]
    assert again == summary
