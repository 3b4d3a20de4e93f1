"""What a long job needs from gift.py's loop: a fresh data order every epoch, resume that is exact at any
point (bit for bit on the CPU in float32, LoRA dropout on), safe output folders, checks of what is resumed,
recovery from damaged checkpoints, preemption by SIGTERM, and a metrics.jsonl that stays one record per step."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, ROWS, final_weights, latest, metrics, train_args, write_rows

import gift
import longjob
from data import (Split, collate, epoch_order, load_dataset, load_tokenizer, rank_micro_batches, step_batches,
                  step_micro_batches)
from gift import first_pass_betas, main
from on_model import model_betas, model_loss, model_objective
from model import LLaDA

# 12 examples, global batch 4: 3 steps per epoch, 3 epochs = 9 steps; dropout on, so resume must restore the RNG
RUN = ("--epochs", "3", "--lora-dropout", "0.1", "--log-every", "2", "--loss", "gift")
# keys of a metrics.jsonl record that are computed, not timed
COMPUTED = ("step", "total_steps", "epoch", "loss", "lr", "grad_norm", "masked_fraction", "beta_mean", "beta_std",
            "skipped_steps")


def computed(records, skip=()):
    return [{k: r.get(k) for k in COMPUTED if k not in skip} for r in records]


def wait_for_records(out, n, proc, timeout=120):
    """Wait until the run `proc` writing into `out` has logged n records (it must not end before)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = out / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, "the run ended before it could be stopped"
        time.sleep(0.01)
    raise TimeoutError(f"{out}: fewer than {n} records after {timeout} s")


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def stop_after(monkeypatch, calls, signum=signal.SIGTERM):
    """Send this process `signum` right after the `calls`-th optimizer step of the next run, as a cluster would."""
    real, done = gift.train_step, []

    def step(*args, **kwargs):
        result = real(*args, **kwargs)
        done.append(1)
        if len(done) == calls:
            os.kill(os.getpid(), signum)
        return result
    monkeypatch.setattr(gift, "train_step", step)


def preempt(monkeypatch, argv, calls):
    stop_after(monkeypatch, calls)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    monkeypatch.undo()
    assert exit_info.value.code == 128 + signal.SIGTERM


def folder_digest(out):
    """sha256 of every file under `out` (names and contents): "nothing changed"."""
    h = hashlib.sha256()
    for p in sorted(out.rglob("*")):
        if p.is_file() and p.name != ".lock":
            h.update(str(p.relative_to(out)).encode() + p.read_bytes())
    return h.hexdigest()


# -----------------------------------------------------------------------------
# Data order


def test_each_epoch_has_its_own_order_and_covers_every_example_once_across_ranks():
    n, seed = 13, 5
    orders = [epoch_order(n, e, seed) for e in range(4)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert len({tuple(o) for o in orders}) == 4  # every epoch its own permutation
    assert epoch_order(n, 2, seed) == orders[2] and epoch_order(n, 2, seed + 1) != orders[2]  # (seed, epoch) only
    for world, micro, accum in ((1, 4, 1), (2, 1, 2), (3, 1, 2)):
        seen = [i for step in step_batches(orders[1], world * micro * accum) for r in range(world)
                for part in rank_micro_batches(step, r, world, micro, accum) for i in part]
        assert sorted(seen) == list(range(n))


def test_the_loop_visits_each_epoch_in_its_own_order(base, tmp_path, monkeypatch):
    visited = {}
    real = gift.step_micro_batches

    def record(examples, step_indices, epoch, *args, **kwargs):
        visited.setdefault(epoch, []).extend(step_indices)
        return real(examples, step_indices, epoch, *args, **kwargs)
    monkeypatch.setattr(gift, "step_micro_batches", record)
    main(train_args(base, tmp_path / "run", *RUN, "--loss", "sft"))
    assert sorted(visited) == [0, 1, 2]
    for epoch, indices in visited.items():
        assert indices == epoch_order(len(ROWS), epoch, 42)  # the default --seed
    assert visited[0] != visited[1] != visited[2]


# -----------------------------------------------------------------------------
# Resume is exact anywhere


BF16 = pytest.mark.bf16  # left out of the forced-kernel reruns (conftest.py)


@pytest.mark.parametrize("mode,dtype", [("full", "float32"), ("lora", "float32"),
                                        pytest.param("full", "bfloat16", marks=BF16),
                                        pytest.param("lora", "bfloat16", marks=BF16)])
def test_resume_equals_uninterrupted_at_three_kinds_of_point(base, tmp_path, monkeypatch, mode, dtype):
    """Stopped by SIGTERM inside epoch 0 (step 2), at the epoch boundary (step 3) and inside epoch 2 (step 7), each
    time resumed: the same weights bit for bit, the same metrics, one record per step."""
    extra = RUN + ("--dtype", dtype) + (("--lora",) if mode == "lora" else ())
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    main(train_args(base, straight, *extra))
    preempt(monkeypatch, train_args(base, cut, *extra), calls=2)  # steps 1-2
    assert "step-0000002" in latest(cut).name
    preempt(monkeypatch, train_args(base, cut, *extra, "--resume"), calls=1)  # step 3: epoch 0 ends
    preempt(monkeypatch, train_args(base, cut, *extra, "--resume"), calls=4)  # steps 4-7
    main(train_args(base, cut, *extra, "--resume"))  # steps 8-9
    assert_same_weights(final_weights(straight, mode == "lora"), final_weights(cut, mode == "lora"))
    a, b = metrics(straight), metrics(cut)
    assert [r["step"] for r in a] == [2, 4, 6, 8, 9]  # log every 2, and the last step
    assert computed(a) == computed(b)  # exactly: the step-3 loss carried over the resume into the step-4 record
    elapsed = [r["elapsed_s"] for r in b]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0  # carried over the resumes, not restarted


def test_kill_9_at_a_random_moment_then_resume(base, tmp_path):
    """kill -9 in the middle of a run (perhaps in mid-save): --resume reaches the weights and metrics of a run that
    was never stopped. The constant schedule makes the run's length (--max-steps) irrelevant to its numbers."""
    extra = ("--lora", "--loss", "gift", "--lora-dropout", "0.1", "--schedule", "constant", "--warmup-steps", "0",
             "--save-every", "3", "--epochs", "1000")
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, str(REPO / "gift.py"), *train_args(base, killed, *extra)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_records(killed, 8, proc)
    finally:
        proc.kill()
        proc.wait()
    reached = max(r["step"] for r in metrics(killed))
    steps = str(reached + 4)
    main(train_args(base, killed, *extra, "--max-steps", steps, "--resume"))
    straight = tmp_path / "straight"
    main(train_args(base, straight, *extra, "--max-steps", steps))
    assert_same_weights(final_weights(straight, True), final_weights(killed, True))
    assert computed(metrics(straight), skip=["total_steps"]) == computed(metrics(killed), skip=["total_steps"])


def test_sigterm_to_torchrun_checkpoints_every_rank_and_resumes_exactly(base, tmp_path):
    """Two processes (DDP, LoRA dropout on): SIGTERM to torchrun, which passes it on to both workers; they finish the
    step, write one checkpoint and exit non-zero saying how to resume; the resumed run equals an unstopped one."""
    extra = ("--lora", "--lora-dropout", "0.1", "--schedule", "constant", "--warmup-steps", "0", "--epochs", "1000",
             "--save-every", "1000")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "gift.py")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    stopped = tmp_path / "stopped"
    proc = subprocess.Popen(cmd + train_args(base, stopped, *extra, batch_size=1), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_records(stopped, 3, proc)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "preempted by SIGTERM" in output and "resume with --resume" in output, output[-3000:]
    reached = int(latest(stopped).name.split("-")[1])
    assert reached >= 3 and [r["step"] for r in metrics(stopped)] == list(range(1, reached + 1))
    steps = str(reached + 2)
    for out, flags in ((stopped, ("--resume",)), (tmp_path / "straight", ())):
        result = subprocess.run(cmd + train_args(base, out, *extra, "--max-steps", steps, *flags, batch_size=1),
                                env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_same_weights(final_weights(tmp_path / "straight", True), final_weights(stopped, True))
    assert computed(metrics(tmp_path / "straight"), ["total_steps"]) == computed(metrics(stopped), ["total_steps"])


# -----------------------------------------------------------------------------
# Output folders


def test_a_second_run_into_a_folder_is_refused_and_changes_nothing(base, tmp_path):
    out = tmp_path / "run"
    main(train_args(base, out, "--max-steps", "2", "--save-every", "1"))
    before = folder_digest(out)
    with pytest.raises(FileExistsError, match="--resume"):
        main(train_args(base, out, "--max-steps", "2", "--lr", "1e-3"))
    assert folder_digest(out) == before
    with pytest.raises(SystemExit):  # contradictory flags
        gift.parse_options(train_args(base, out, "--resume", "--overwrite"))
    main(train_args(base, out, "--max-steps", "1", "--overwrite"))  # starting over, knowingly
    assert [r["step"] for r in metrics(out)] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000001"]


def test_one_run_per_folder_and_a_dead_holder_does_not_block(base, tmp_path):
    out = tmp_path / "run"
    lock = longjob.lock_folder(out)  # another run holds the folder
    with pytest.raises(RuntimeError, match=f"in use by a running job \\(pid {os.getpid()}"):
        main(train_args(base, out, "--max-steps", "1"))
    lock.close()
    # a holder killed with -9 leaves the lock file, but not the lock
    holder = subprocess.Popen([sys.executable, "-c", f"import sys, time; sys.path.insert(0, {str(REPO)!r}); "
                               f"import longjob, pathlib; lock = longjob.lock_folder(pathlib.Path({str(out)!r})); "
                               "print('locked', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(RuntimeError, match=f"pid {holder.pid}"):
        main(train_args(base, out, "--max-steps", "1"))
    holder.kill()
    holder.wait()
    main(train_args(base, out, "--max-steps", "1"))


def test_rotation_deletes_only_this_runs_checkpoints_and_leftover_tmp_goes(base, tmp_path, capsys):
    out = tmp_path / "run"
    main(train_args(base, out, "--max-steps", "2", "--save-every", "1"))
    shutil.copytree(latest(out), out / "checkpoints" / "step-0000000-mine")  # a user's own copy, by hand
    (out / "checkpoints" / "step-0000009.tmp" / "train_state").mkdir(parents=True)  # an interrupted save
    main(train_args(base, out, "--max-steps", "5", "--save-every", "1", "--keep-last", "2", "--resume"))
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step-0000000-mine", "step-0000004", "step-0000005"]
    said = capsys.readouterr().out
    assert "step-0000009.tmp, left by an interrupted save" in said
    assert f"checkpoint {out / 'checkpoints' / 'step-0000005'}" in said  # the final message names what exists


# -----------------------------------------------------------------------------
# Resume checks what it resumes


def test_changed_or_shrunk_data_and_another_base_are_refused(base, tmp_path):
    out = tmp_path / "run"
    data = tmp_path / "data.jsonl"
    write_rows(data, ROWS)
    main(train_args(base, out, "--max-steps", "2", data=data))
    write_rows(data, ROWS[:-1] + [("say hi", "hello")])  # same path, same size, one answer changed
    with pytest.raises(ValueError, match="training data changed.*12 examples.*12"):
        main(train_args(base, out, "--max-steps", "4", "--resume", data=data))
    write_rows(data, ROWS[:5])  # shrunk: refused at once, not an endless loop
    with pytest.raises(ValueError, match="training data changed.*12 examples.*, 5"):
        main(train_args(base, out, "--max-steps", "4", "--resume", data=data))
    write_rows(data, ROWS)
    other = tmp_path / "other"
    shutil.copytree(base / "model", other)
    model = LLaDA.from_pretrained(other)
    with torch.no_grad():
        model.model.transformer.ln_f.weight.add_(1e-3)
    model.save_pretrained(other)
    shutil.copy2(base / "model" / "tokenizer.json", other)
    argv = train_args(base, out, "--max-steps", "4", "--resume", data=data)
    argv[argv.index("--model") + 1] = str(other)
    with pytest.raises(ValueError, match="base model changed"):
        main(argv)
    main(train_args(base, out, "--max-steps", "4", "--resume", data=data))  # the original data and base: fine


@pytest.mark.parametrize("damage", ["dangling", "empty", "missing", "truncated shard", "corrupt trainer.json",
                                    "unreadable loop state"])
def test_damaged_latest_falls_back_to_an_older_checkpoint(base, tmp_path, capsys, damage):
    """Whatever is wrong with the newest checkpoint, --resume uses the newest good one, says what it skipped and
    why, and (resume being exact) still ends with the weights of an unstopped run."""
    extra = ("--lora", "--lora-dropout", "0.1", "--save-every", "1", "--keep-last", "3")
    straight, out = tmp_path / "straight", tmp_path / "run"
    main(train_args(base, straight, *extra, "--max-steps", "5"))
    main(train_args(base, out, *extra, "--max-steps", "5"))
    newest = latest(out)
    if damage == "dangling":
        (out / "latest").write_text("step-0000099\n")
        shutil.rmtree(newest)
    elif damage == "empty":
        (out / "latest").write_text("")
        shutil.rmtree(newest)
    elif damage == "missing":
        (out / "latest").unlink()
        shutil.rmtree(newest / "train_state")
    elif damage == "truncated shard":
        shard = next((newest / "train_state").glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "corrupt trainer.json":
        (newest / "trainer.json").write_text('{"state": ')
    elif damage == "unreadable loop state":  # not seen by the checks: fails in loading, the next one is used
        (newest / "loop_state.pt").write_bytes(b"garbage")
    capsys.readouterr()
    main(train_args(base, out, *extra, "--max-steps", "5", "--resume"))
    said = capsys.readouterr().out
    assert ("using step-0000004" in said) != ("cannot load" in said)  # fell back to the newest good one, saying so
    assert f"resumed from {out / 'checkpoints' / 'step-0000004'}" in said
    if damage == "dangling":
        assert "step-0000099: the folder does not exist" in said
    assert_same_weights(final_weights(straight, True), final_weights(out, True))
    assert computed(metrics(straight)) == computed(metrics(out))


def test_a_finished_run_resumed_past_a_dangling_latest_names_what_exists(base, tmp_path, capsys):
    out = tmp_path / "run"
    main(train_args(base, out, "--max-steps", "2", "--save-every", "1"))
    (out / "latest").write_text("step-0000007\n")
    capsys.readouterr()
    main(train_args(base, out, "--max-steps", "2", "--resume"))  # nothing left to do
    assert latest(out).name == "step-0000002"
    assert f"checkpoint {out / 'checkpoints' / 'step-0000002'}" in capsys.readouterr().out


def test_resume_with_no_checkpoint_starts_at_zero_but_broken_ones_are_refused(base, tmp_path):
    out = tmp_path / "run"
    main(train_args(base, out, "--max-steps", "2", "--resume"))  # a requeued job that never saved: starts over
    assert [r["step"] for r in metrics(out)] == [1, 2]
    for ckpt in (out / "checkpoints").iterdir():
        (ckpt / "trainer.json").unlink()
    with pytest.raises(RuntimeError, match="no usable checkpoint.*trainer.json is missing.*--overwrite"):
        main(train_args(base, out, "--max-steps", "3", "--resume"))


def test_gift_star_cache_is_the_initial_models_and_keyed_by_fingerprints(base, tmp_path):
    out = tmp_path / "star"
    main(train_args(base, out, "--loss", "gift-star", "--max-steps", "2", "--save-every", "1"))
    opts = gift.parse_options(train_args(base, out))
    examples, _ = load_dataset(opts.data, load_tokenizer(opts.model))
    initial = LLaDA.from_pretrained(base / "model")

    def expected(length):
        ids, answer_mask = collate(examples, initial.config.pad_token_id, pad_to=length)
        return first_pass_betas(initial, "entropy", ids, answer_mask, initial.config.mask_token_id)

    betas = torch.load(out / "ref_betas.pt")["betas"]
    torch.testing.assert_close(betas, expected(betas.shape[1]), rtol=1e-5, atol=1e-6)
    os.utime(out / "ref_betas.pt", (0, 0))  # a resumed run reads it back
    main(train_args(base, out, "--loss", "gift-star", "--max-steps", "3", "--save-every", "1", "--resume"))
    assert (out / "ref_betas.pt").stat().st_mtime == 0
    # a full fine-tuning resume without the cache recomputes it from the INITIAL model, not the trained one
    (out / "ref_betas.pt").unlink()
    main(train_args(base, out, "--loss", "gift-star", "--max-steps", "4", "--save-every", "1", "--resume"))
    torch.testing.assert_close(torch.load(out / "ref_betas.pt")["betas"], betas, rtol=1e-5, atol=1e-6)
    # a cache made for other data of the same size is not reused
    cache = torch.load(out / "ref_betas.pt")
    cache["key"]["data"] = "0" * 16
    cache["betas"].fill_(7.0)
    torch.save(cache, out / "ref_betas.pt")
    main(train_args(base, out, "--loss", "gift-star", "--max-steps", "5", "--save-every", "1", "--resume"))
    torch.testing.assert_close(torch.load(out / "ref_betas.pt")["betas"], betas, rtol=1e-5, atol=1e-6)


# -----------------------------------------------------------------------------
# metrics.jsonl


def test_metrics_are_strict_json_and_pool_betas_over_micro_batches():
    state = longjob.TrainState(step=4, elapsed_s=2.0, tokens_seen=100)
    window = [dict(loss=1.0, grad_norm=2.0, n_rows=4, n_masked=3, n_answer=10, n_tokens=50, beta_n=10,
                   beta_sum=5.0, beta_sq_sum=4.0),
              dict(loss=float("nan"), grad_norm=4.0, n_rows=4, n_masked=5, n_answer=30, n_tokens=50, beta_n=30,
                   beta_sum=30.0, beta_sq_sum=40.0)]
    record = longjob.log_record(window, state, epoch=1, total_steps=9, lr=1e-3, eta_s=5.0)
    assert record["loss"] is None  # NaN is not JSON
    assert record["grad_norm"] == 3.0 and record["masked_fraction"] == 8 / 40
    assert record["beta_mean"] == pytest.approx(35 / 40)  # pooled over all 40 answer tokens, not averaged per batch
    assert record["beta_std"] == pytest.approx((44 / 40 - (35 / 40) ** 2) ** 0.5)
    assert record["tokens_per_s"] == 50.0
    json.dumps(record, allow_nan=False)


def micro_batches(*args, **kwargs):
    """data.step_micro_batches' micro-batches as the loop wraps them, gift.MicroBatches."""
    return [gift.MicroBatch(**fields) for fields in step_micro_batches(*args, **kwargs)]


def test_train_step_counts_every_micro_batch(base):
    """The step's statistics sum over all micro-batches (and ranks): rows, masked and answer tokens, and the betas of
    the entropy pass, checked against the first pass and objective_batch run on their own."""
    model = LLaDA.from_pretrained(base / "model")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    examples, _ = load_dataset(base / "data.jsonl", load_tokenizer(base / "model"))
    batches = micro_batches(examples, list(range(7)), 0, Split(0, 1, 3, 3), model.config.pad_token_id,
                            torch.device("cpu"), seed=1)
    assert [len(b.input_ids) for b in batches] == [3, 2, 2]
    expected = dict(n_rows=7.0, n_masked=0.0, n_answer=0.0, beta_sum=0.0, beta_n=0.0)
    for b in batches:
        noisy, _, _ = model_objective("gift", model, b.input_ids, b.answer_mask,
                                      [torch.Generator().set_state(g.get_state()) for g in b.generators])
        beta = model_betas(model, b.input_ids, b.answer_mask)
        expected["n_masked"] += float(((noisy == model.config.mask_token_id) & b.answer_mask).sum())
        expected["n_answer"] += float(b.answer_mask.sum())
        expected["beta_n"] += float(b.answer_mask.sum())
        expected["beta_sum"] += float(beta[b.answer_mask].double().sum())
    result = gift.train_step(model, optimizer, batches, "gift")
    for k, v in expected.items():
        assert result[k] == pytest.approx(v, rel=1e-6), k
    assert result["stepped"] and result["loss"] > 0
    # a step shorter than the accumulation: zero-weight dummies fill the empty micro-batches and change nothing
    def step(accum):
        model = LLaDA.from_pretrained(base / "model")
        batches = micro_batches(examples, [5], 0, Split(0, 1, 1, accum), model.config.pad_token_id,
                                torch.device("cpu"), seed=1)
        result = gift.train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches, "gift")
        return [b.real for b in batches], result, model.state_dict()
    (real1, result1, weights1), (real3, result3, weights3) = step(1), step(3)
    assert real1 == [True] and real3 == [True, False, False]
    assert result1 == result3 and result3["n_rows"] == 1
    for k in weights1:
        torch.testing.assert_close(weights1[k], weights3[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("loss_name", ["sft", "gift", "gift-elbo"])  # "answer", "masked", "answer" norms
def test_a_step_over_micro_batches_is_the_loss_of_the_whole_batch(base, loss_name):
    """train_step's loss and gradient over 3 micro-batches (global normaliser) equal objective_batch + diffusion_loss
    on the 7 rows at once (its own normaliser), the same noise drawn from the rows' generators."""
    examples, _ = load_dataset(base / "data.jsonl", load_tokenizer(base / "model"))
    pad = LLaDA.from_pretrained(base / "model").config.pad_token_id
    batches = micro_batches(examples, list(range(7)), 0, Split(0, 1, 3, 3), pad, torch.device("cpu"), seed=1, pad_to=64)
    ids = torch.cat([b.input_ids for b in batches])
    answer_mask = torch.cat([b.answer_mask for b in batches])
    generators = [torch.Generator().set_state(g.get_state()) for b in batches for g in b.generators]
    model = LLaDA.from_pretrained(base / "model")
    noisy, weight, norm = model_objective(loss_name, model, ids, answer_mask, generators)
    whole = model_loss(model, ids, noisy, weight, answer_mask, norm=norm)
    whole.backward()
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    model = LLaDA.from_pretrained(base / "model")
    result = gift.train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches, loss_name,
                             grad_clip=0)
    assert result["loss"] == pytest.approx(whole.item(), rel=1e-5)
    assert result["grad_norm"] == pytest.approx(float(grad_norm), rel=1e-4)


def test_metrics_keep_one_record_per_step_after_a_kill_without_checkpoint(base, tmp_path):
    """Records written after the last checkpoint (and a torn last line) are replaced, not repeated."""
    out = tmp_path / "run"
    extra = ("--save-every", "2", "--max-steps", "6")
    main(train_args(base, out, *extra))
    whole = metrics(out)
    shutil.rmtree(out / "checkpoints" / "step-0000006")
    (out / "latest").write_text("step-0000004\n")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # a kill in mid-write
    main(train_args(base, out, *extra, "--resume"))
    assert computed(metrics(out)) == computed(whole)
