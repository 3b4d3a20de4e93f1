"""rl.py as a long job (issue 54): a run stopped (between rollouts, mid-rollout batch, by kill -9) and resumed ends
bit-identical to an unstopped one; 2 processes compute what 1 does, rollouts included; the early exit changes no
rollout; bad input is one line before any rollout. A tiny random LLaDA with the embedded task's tokenizer, and a
reward that reads the completion's text (`planted_reward`: a random model never writes an answer tag, so d1's
Sudoku reward would be 0 for every completion and every group's advantage 0)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, metrics
from safetensors.torch import load_file

import rl

TIMED = {"rollout_s", "update_s", "elapsed_s", "eta_s"}  # measured, not computed
PLANT = ("import sys, rl; rl.reward = lambda task, text, item: (sum(map(ord, text)) % 7) / 6; "
         "rl.run_command_line(rl.main, 'rl.py', rank0_only=True, errors=(ValueError, OSError, rl.RunError))")


def planted_reward(task, text, item):
    """A reward in [0, 1] that differs between completions (any text): PLANT's, in this process."""
    return (sum(map(ord, text)) % 7) / 6


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A tiny LLaDA folder (the embedded task's tokenizer, weights std 0.2) and a CSV of 64 Sudoku prompts."""
    from embedded import make_char_tokenizer, sudoku_split, tiny_config_for
    from model import LLaDA
    root = tmp_path_factory.mktemp("rl")
    tokenizer = make_char_tokenizer()
    config = tiny_config_for(tokenizer, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=64,
                             max_sequence_length=128)
    LLaDA(config).init_weights(torch.Generator().manual_seed(0), std=0.2).save_pretrained(root / "model")
    tokenizer.save(str(root / "model" / "tokenizer.json"))
    pairs, _ = sudoku_split(64, 0, (4, 8), seed=0)
    (root / "prompts.csv").write_text("Puzzle,Solution\n" + "".join(f"{p},{s}\n" for p, s in pairs))
    return root


def rl_args(start, out, *extra):
    """A tiny run: 4 prompts x 4 completions of 16 tokens (blocks of 4) per rollout, 3 optimizer steps each."""
    return ["--model", str(start / "model"), "--task", "sudoku", "--data", str(start / "prompts.csv"),
            "--prompt-style", "plain", "--out", str(out), "--gen-length", "16", "--block-length", "4", "--steps", "8",
            "--group-size", "4", "--prompts-per-step", "4", "--iterations", "3", "--lr", "1e-3", "--log-every", "1",
            "--save-every", "2", "--dtype", "float32", *extra]


def run_in_process(monkeypatch, argv):
    monkeypatch.setattr(rl, "reward", planted_reward)
    rl.main(argv)


def untimed(out):
    return [{k: v for k, v in r.items() if k not in TIMED | {"total_steps"}} for r in metrics(out)]


def weights(out):
    folder = out / "checkpoints" / (out / "latest").read_text().strip()
    name = "adapter/adapter_model.safetensors" if (folder / "adapter").is_dir() else "model/model.safetensors"
    return load_file(folder / name)


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_stopped_run_resumes_bit_identical(start, tmp_path, monkeypatch, one_thread):
    """Stopped at step 2 (mid-rollout batch: rollout 0 serves steps 1-3), then at 3 (a rollout's end), resumed to 7:
    the weights and every metrics.jsonl record equal an unstopped run's. The rollout buffer comes from the
    checkpoint; a rerun of the rollout from the step-2 weights would differ."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_in_process(monkeypatch, rl_args(start, whole, "--max-steps", "7"))
    run_in_process(monkeypatch, rl_args(start, parts, "--max-steps", "2"))
    run_in_process(monkeypatch, rl_args(start, parts, "--max-steps", "3", "--resume", "--save-every", "3"))
    run_in_process(monkeypatch, rl_args(start, parts, "--max-steps", "7", "--resume"))
    assert_same_weights(whole, parts)
    assert untimed(whole) == untimed(parts)
    records = metrics(whole)
    assert [r["rollout"] for r in records] == [0, 0, 0, 1, 1, 1, 2]
    assert all(r["reward_mean"] > 0 and r["zero_advantage"] < 1 for r in records)  # the updates do something
    assert records[0]["loss"] != 0 and records[0]["grad_norm"] > 0


def test_kill_9_mid_run_then_resume(start, tmp_path):
    """kill -9 at any time (here after step 3's record, mid-rollout or mid-update), then --resume: the same final
    weights and records as a run never killed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    args = rl_args(start, whole, "--max-steps", "9", "--save-every", "1")
    subprocess.run([sys.executable, "-c", PLANT, *args], cwd=REPO, env=env, check=True, capture_output=True,
                   timeout=300)
    args = rl_args(start, killed, "--max-steps", "9", "--save-every", "1")
    proc = subprocess.Popen([sys.executable, "-c", PLANT, *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if (killed / "metrics.jsonl").is_file() and len((killed / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run([sys.executable, "-c", PLANT, *args, "--resume"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_weights(whole, killed)
    assert untimed(whole) == untimed(killed)


def test_the_early_exit_changes_no_rollout(start, tmp_path, monkeypatch, one_thread):
    """The default (the early exit) and --no-early-exit train the same weights with the same records: a completion
    ends at its first turn end in both (rl.end_at_stop); only the tokens the exit skipped differ."""
    on, off = tmp_path / "on", tmp_path / "off"
    run_in_process(monkeypatch, rl_args(start, on, "--max-steps", "4"))
    run_in_process(monkeypatch, rl_args(start, off, "--max-steps", "4", "--no-early-exit"))
    assert_same_weights(on, off)
    a, b = untimed(on), untimed(off)
    assert sum(r["tokens_skipped"] for r in a) > 0 and all(r["tokens_skipped"] == 0 for r in b)
    drop = {"tokens_generated", "tokens_skipped"}
    assert [{k: v for k, v in r.items() if k not in drop} for r in a] == [
        {k: v for k, v in r.items() if k not in drop} for r in b]


def torchrun(nproc, args, cwd):
    script = cwd / "planted_rl.py"
    script.write_text(PLANT.replace("; ", "\n"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_two_processes_equal_one(start, tmp_path):
    """LoRA under DDP: 2 processes (2 prompts each) compute what 1 does (4), rollouts included: each group samples
    from its own generators, its prompt mask from its own, so the rewards are equal and the losses and weights equal
    to rounding."""
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ("--max-steps", "4", "--lora", "--lora-r", "4", "--lora-alpha", "8", "--lora-dropout", "0")
    torchrun(1, rl_args(start, one, *extra), tmp_path)
    torchrun(2, rl_args(start, two, *extra), tmp_path)
    wa, wb = weights(one), weights(two)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)
    a, b = metrics(one), metrics(two)
    for ra, rb in zip(a, b):
        assert ra["reward_mean"] == rb["reward_mean"] and ra["answer_length"] == rb["answer_length"]
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("flags, said", [
    (("--group-size", "1"), "--group-size 1: must be at least 2"),
    (("--prompts-per-step", "100"), "--prompts-per-step 100: more than the 64 prompts"),
    (("--gen-length", "128", "--block-length", "32", "--steps", "64"), "exceed the model's max_sequence_length 128"),
    (("--task", "gsm8k"), "prompts.csv"),
    (("--sampler", "dream"), "--block-length: not read by the dream sampler"),
    (("--prompt-mask", "1"), "--prompt-mask 1.0: must be in [0, 1)"),
])
def test_bad_input_is_refused_before_any_rollout(start, tmp_path, flags, said, capsys, monkeypatch):
    """Each refusal names the flag or the row, before the model loads or a rollout runs (rl.py prints it in one line:
    test_a_refusal_is_one_line)."""
    monkeypatch.setattr(rl, "make_rollout", lambda *a, **k: pytest.fail("a rollout ran"))
    out = tmp_path / "out"
    with pytest.raises((SystemExit, ValueError)) as e:
        rl.main(rl_args(start, out, "--max-steps", "2", *flags))
    assert said in (str(e.value) if e.type is ValueError else capsys.readouterr().err), e.value
    assert not (out / "metrics.jsonl").exists()


def test_a_prompt_file_without_answers_or_blanks_is_refused(start, tmp_path):
    """A Sudoku CSV without its Solution column, or a puzzle with no empty cell (its reward always 0): one line
    naming the file (and the row), before any rollout."""
    no_answers = tmp_path / "no_answers.csv"
    no_answers.write_text("Puzzle\n0123400000000000\n")
    full = tmp_path / "full.csv"
    full.write_text("Puzzle,Solution\n1234341221434321,1234341221434321\n")
    for path, said in ((no_answers, "no_answers.csv, line 1: expected a header with columns Puzzle,Solution"),
                       (full, "item 0: the puzzle 1234341221434321 has no empty cell")):
        with pytest.raises(ValueError, match=said):
            rl.main(rl_args(start, tmp_path / "out", "--data", str(path)))


def test_a_refusal_is_one_line(start, tmp_path):
    """`python rl.py` with a row it refuses: exit status 1, one line naming it, no traceback."""
    full = tmp_path / "full.csv"
    full.write_text("Puzzle,Solution\n1234341221434321,1234341221434321\n")
    result = subprocess.run([sys.executable, "rl.py", *rl_args(start, tmp_path / "out", "--data", str(full))],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [f"rl.py: error: {full}: item 0: the puzzle 1234341221434321 has no "
                                                  "empty cell, so its reward is always 0; remove it"]


def test_a_gift_checkpoint_is_a_start(start, tmp_path, monkeypatch, one_thread):
    """--model takes what gift.py printed: a run folder (its latest checkpoint's model/); a LoRA checkpoint is merged
    into its base, and the RL run then exports merged/ beside its adapter."""
    from conftest import ROWS, write_rows
    write_rows(tmp_path / "sft.jsonl", ROWS)
    import gift
    gift.main(["--model", str(start / "model"), "--data", str(tmp_path / "sft.jsonl"), "--out", str(tmp_path / "g"),
               "--max-steps", "2", "--batch-size", "2", "--grad-accum", "1", "--lora", "--lora-r", "2",
               "--log-every", "1"])
    out = tmp_path / "r"
    run_in_process(monkeypatch, rl_args(start, out, "--max-steps", "2", "--lora", "--lora-r", "2") + [
        "--model", str(tmp_path / "g")])
    final = out / "checkpoints" / "step-0000002"
    assert (final / "adapter" / "adapter_model.safetensors").is_file() and (final / "merged" / "config.json").is_file()
    trainer = json.loads((final / "trainer.json").read_text())
    assert trainer["options"]["adapter"].endswith("adapter") and trainer["fingerprints"]["files"]["adapter"]


@pytest.mark.parametrize("sampler", ["block", "dream"])
def test_dream_trains(start, tmp_path, monkeypatch, one_thread, sampler):
    """A Dream folder (its shifted head: model.predicting_hidden) trains with the block sampler and with Dream's own,
    LoRA on Dream's names; its loss finite and not zero, and a stopped run resumes bit-identical."""
    from test_dream_cli import tiny_dream
    model, tokenizer = tiny_dream(dtype=torch.float32)
    model.save_pretrained(tmp_path / "dream")
    tokenizer.save(str(tmp_path / "dream" / "tokenizer.json"))
    extra = ["--model", str(tmp_path / "dream"), "--lora", "--lora-r", "2", "--lora-dropout", "0"]
    extra += ["--sampler", "dream"] if sampler == "dream" else []

    def args(out, *more):  # Dream's sampler has no blocks: --block-length is refused with it
        a = rl_args(start, out, *more, *extra)
        return a[:a.index("--block-length")] + a[a.index("--block-length") + 2:] if sampler == "dream" else a
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_in_process(monkeypatch, args(whole, "--max-steps", "4"))
    run_in_process(monkeypatch, args(parts, "--max-steps", "2"))
    run_in_process(monkeypatch, args(parts, "--max-steps", "4", "--resume"))
    assert_same_weights(whole, parts)
    records = metrics(whole)
    assert all(r["loss"] is not None and r["grad_norm"] > 0 for r in records)
    trainer = json.loads((whole / "checkpoints" / "step-0000004" / "trainer.json").read_text())
    assert trainer["options"]["sampling"]["sampler"] == sampler


def test_the_cached_sampler_is_an_opt_in(start, tmp_path, monkeypatch, one_thread):
    """--cache dual --threshold 0.9 (cached_sample.py's options, as sample.py names them) samples the rollouts with
    the cached sampler; the run records them and trains."""
    out = tmp_path / "cached"
    run_in_process(monkeypatch, rl_args(start, out, "--max-steps", "2", "--cache", "dual", "--threshold", "0.9"))
    trainer = json.loads((out / "checkpoints" / "step-0000002" / "trainer.json").read_text())
    assert trainer["options"]["sampling"]["cache"] == "dual" and trainer["options"]["sampling"]["threshold"] == 0.9
    assert [r["step"] for r in metrics(out)] == [1, 2]
