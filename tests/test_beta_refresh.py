"""--beta-refresh-epochs K (gift.BetaCache): GIFT's betas reused for K epochs. K = 1 through the cache equals the plain
gift step bit for bit; with K = 3 an example's entropy pass runs in epochs 0, 3, 6 only (K = 0: epoch 0 only); the
betas used in between are the cached ones; a resume restores the cache exactly."""

import os
import signal

import pytest
import torch
from conftest import ROWS, final_weights, metrics, train_args

import gift
from data import Split, epoch_order, load_dataset, load_tokenizer, step_batches, step_micro_batches
from gift import BetaCache, MicroBatch, main, train_step
from model import LLaDA

# 12 examples, global batch 4: 3 steps per epoch
RUN = ("--loss", "gift", "--log-every", "1", "--lora-dropout", "0.1")


def entropy_pass_rows_by_epoch(monkeypatch):
    """Patch gift so that every first pass is counted: {epoch: rows passed}."""
    rows, now = {}, {}
    real_pass, real_batches = gift.first_pass_betas, gift.step_micro_batches

    def counting_pass(betas_from, model, input_ids, *args, **kwargs):
        rows[now["epoch"]] = rows.get(now["epoch"], 0) + len(input_ids)
        return real_pass(betas_from, model, input_ids, *args, **kwargs)

    def batches(examples, step_indices, epoch, *args, **kwargs):
        now["epoch"] = epoch
        return real_batches(examples, step_indices, epoch, *args, **kwargs)
    monkeypatch.setattr(gift, "first_pass_betas", counting_pass)
    monkeypatch.setattr(gift, "step_micro_batches", batches)
    return rows


@pytest.mark.parametrize("k,epochs_with_a_pass", [(1, list(range(7))), (3, [0, 3, 6]), (0, [0])])
def test_the_entropy_pass_runs_every_k_epochs_over_every_example(base, tmp_path, monkeypatch, k, epochs_with_a_pass):
    rows = entropy_pass_rows_by_epoch(monkeypatch)
    main(train_args(base, tmp_path / "run", *RUN, "--epochs", "7", "--beta-refresh-epochs", str(k), "--lora"))
    assert rows == {e: len(ROWS) for e in epochs_with_a_pass}


def test_k3_equals_k1_in_epoch_0_then_uses_the_cached_betas(base, tmp_path):
    """Epoch 0 computes every beta as K = 1 does (the same losses, bit for bit); from epoch 1 on, K = 3's betas are
    epoch 0's, so its losses differ from K = 1's, whose betas follow the model."""
    for k in (1, 3):
        main(train_args(base, tmp_path / f"k{k}", *RUN, "--epochs", "3", "--beta-refresh-epochs", str(k)))
    a, b = metrics(tmp_path / "k1"), metrics(tmp_path / "k3")
    assert [r["loss"] for r in a[:3]] == [r["loss"] for r in b[:3]]
    assert [r["beta_mean"] for r in a[:3]] == [r["beta_mean"] for r in b[:3]]
    assert all(ra["beta_mean"] != rb["beta_mean"] for ra, rb in zip(a[3:], b[3:]))


def test_the_cache_path_with_k1_equals_the_plain_gift_step(base):
    """Through BetaCache with K = 1 (every row stale at every visit: the pass over "the stale rows" is the pass over
    all rows), 3 epochs of train_step give the results of the plain step, bit for bit. With K = 2 the second epoch's
    objective gets exactly the betas epoch 0 stored. (The runs are sequential, each from a fresh load: two model
    copies alive side by side in one process can differ in the last bit.)"""
    tokenizer = load_tokenizer(base / "model")
    examples, _ = load_dataset(base / "data.jsonl", tokenizer)

    def run(cache):
        model = LLaDA.from_pretrained(base / "model")
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        results = []
        for epoch in range(3):
            for step in step_batches(epoch_order(len(examples), epoch, 7), 4):
                mbs = [MicroBatch(**f) for f in step_micro_batches(examples, step, epoch, Split(0, 1, 2, 2),
                                                                   model.config.pad_token_id, torch.device("cpu"), 7)]
                if cache:
                    cache.attach(mbs, epoch)
                    if cache.refresh_epochs == 2 and epoch == 1:  # every row fresh: epoch 0's betas
                        assert not any(mb.stale.any() for mb in mbs)
                        for mb in mbs:
                            for r, i in enumerate(mb.indices):
                                n = min(mb.precomputed_betas.shape[1], len(cache.betas[i]))  # cut or extended
                                assert cache.epoch[i] == 0 and torch.equal(mb.precomputed_betas[r, :n], cache.betas[i][:n])
                results.append(train_step(model, optimizer, mbs, "gift"))
                if cache:
                    cache.update(mbs, epoch)
        return results

    plain, k1, k2 = run(None), run(BetaCache(len(examples), 1)), run(BetaCache(len(examples), 2))
    assert k1 == plain
    assert k2[:3] == plain[:3] and all(a != b for a, b in zip(k2[3:6], plain[3:6]))


def test_cached_rows_follow_the_micro_batchs_padded_length():
    """A row cached at one padded length and used in a micro-batch of another: cut, or extended with its last
    value (an EOS pad's beta)."""
    cache = BetaCache(2, 0)
    cache.epoch[:] = 0
    cache.betas = [torch.tensor([0.0, 0.5, 0.25]), torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4])]
    mb = gift.MicroBatch(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool), None,
                         indices=[0, 1])
    cache.attach([mb], epoch=5)
    assert not mb.stale.any()
    assert torch.equal(mb.precomputed_betas, torch.tensor([[0.0, 0.5, 0.25, 0.25], [0.0, 0.1, 0.2, 0.3]]))


def test_resume_inside_a_reuse_period_restores_the_cache(base, tmp_path, monkeypatch):
    """K = 3, stopped inside epoch 1 (step 4, betas of epoch 0 in use): the resumed run is the unstopped one, bit
    for bit. Without the cache in the checkpoint, the resumed run would recompute the betas with a later model."""
    extra = (*RUN, "--epochs", "4", "--beta-refresh-epochs", "3")
    main(train_args(base, tmp_path / "straight", *extra))
    real, done = gift.train_step, []

    def step(*args, **kwargs):
        result = real(*args, **kwargs)
        done.append(1)
        if len(done) == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return result
    monkeypatch.setattr(gift, "train_step", step)
    with pytest.raises(SystemExit):
        main(train_args(base, tmp_path / "cut", *extra))
    assert len(done) == 4  # the hook ran: its signal stopped the run
    monkeypatch.undo()
    rows = entropy_pass_rows_by_epoch(monkeypatch)
    main(train_args(base, tmp_path / "cut", *extra, "--resume"))
    assert rows == {3: len(ROWS)}  # the cache came back: no pass until epoch 3
    a, b = final_weights(tmp_path / "straight", False), final_weights(tmp_path / "cut", False)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in metrics(tmp_path / "straight")] == [r["loss"] for r in metrics(tmp_path / "cut")]


def test_a_cache_row_is_never_written_from_a_dummy_row():
    cache = BetaCache(3, 2)
    mb = gift.MicroBatch(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool), None, real=False,
                         indices=[2])
    cache.attach([mb], 0)
    mb.precomputed_betas[:] = 1.0
    cache.update([mb], 0)
    assert int(cache.epoch[2]) == -1
