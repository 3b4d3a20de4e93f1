"""LoRA on a base sharded by FSDP2 (--parallel fsdp) and --cpu-offload: the same run as DDP's, the same checkpoint and
exports (the PEFT adapter, --save-merged), resume bit for bit after kill -9, bf16 too; offload changes no number; and
bench/lora_fsdp.py's smoke run (the GPU measurement of issue 40, item 5)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, final_weights, latest, metrics, train_args
from safetensors.torch import load_file
from test_resume import computed

from gift import main, parse_options

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
LR = 3e-3  # train_args' --lr
# gift.py, each rank writing the elements of the frozen base it holds (local) and their total (full) after wrap_model
WATCHED_GIFT = f"""import json, os, sys
sys.path.insert(0, {str(REPO)!r})
import gift
from torch.distributed.tensor import DTensor
wrap_model = gift.wrap_model

def watched(*args, **kwargs):
    model = wrap_model(*args, **kwargs)
    base = [p for p in model.parameters() if not p.requires_grad]
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in base)
    with open(f"base_sizes_{{os.environ['RANK']}}.json", "w") as f:
        json.dump(dict(local=local, full=sum(p.numel() for p in base)), f)
    return model

gift.wrap_model = watched
gift.run_command_line(gift.main, "gift.py", rank0_only=True)
"""


def start(argv, cwd, script=REPO / "gift.py"):
    """A 2-process torchrun of gift.py (or `script`, a wrapper of it) in a session of its own (so that kill -9
    reaches its workers too)."""
    return subprocess.Popen(TORCHRUN + [str(script)] + argv, cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc):
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    return output


def merged(out):
    return load_file(latest(out) / "merged" / "model.safetensors")


def test_lora_fsdp_equals_ddp_and_resumes_bit_for_bit_after_kill_9(base, tmp_path):
    """Four 2-process runs at once, then one more:
    - float32, GIFT* (its no-grad passes over the data before step 1: FSDP2 must reshard after them), LoRA dropout
      on, --save-merged: --parallel ddp against --parallel fsdp, 4 steps;
    - bf16, GIFT with betas reused for 2 epochs (BetaCache's first passes on the sharded model, its state in the
      checkpoint): an fsdp run killed with -9 mid-way, resumed with --cpu-offload, against an unstopped fsdp run."""
    common = ("--lora", "--lora-dropout", "0.1", "--save-merged")
    fp32 = common + ("--loss", "gift-star", "--max-steps", "4")
    bf16 = common + ("--dtype", "bfloat16", "--loss", "gift", "--beta-refresh-epochs", "2", "--epochs", "3",
                     "--schedule", "constant", "--warmup-steps", "0", "--save-every", "2", "--max-steps", "8",
                     "--parallel", "fsdp")
    runs = {name: tmp_path / name for name in ("ddp", "fsdp", "killed", "straight")}
    (tmp_path / "watched_gift.py").write_text(WATCHED_GIFT)
    procs = {"ddp": start(train_args(base, runs["ddp"], *fp32, "--parallel", "ddp", batch_size=1), tmp_path),
             "fsdp": start(train_args(base, runs["fsdp"], *fp32, "--parallel", "fsdp", batch_size=1), tmp_path,
                           tmp_path / "watched_gift.py"),
             "straight": start(train_args(base, runs["straight"], *bf16, batch_size=1), tmp_path)}
    killed = start(train_args(base, runs["killed"], *bf16, batch_size=1), tmp_path)
    try:
        path = runs["killed"] / "metrics.jsonl"
        deadline = time.time() + 120
        while not (path.exists() and len(path.read_text().splitlines()) >= 3):
            assert killed.poll() is None and time.time() < deadline, "the run ended before it could be killed"
            time.sleep(0.01)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)  # torchrun and both workers, at once
        killed.wait()
    assert max(r["step"] for r in metrics(runs["killed"])) < 8  # it was stopped before its end
    for proc in procs.values():
        finish(proc)
    finish(start(train_args(base, runs["killed"], *bf16, "--resume", "--cpu-offload", batch_size=1), tmp_path))

    # fsdp, killed and resumed (with the base offloaded from the resumption on) = fsdp unstopped, bit for bit: the
    # same code on the same machine, so equal, not close
    for a, b in ((final_weights(runs["straight"], True), final_weights(runs["killed"], True)),
                 (merged(runs["straight"]), merged(runs["killed"]))):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert computed(metrics(runs["straight"])) == computed(metrics(runs["killed"]))
    assert [r["step"] for r in metrics(runs["killed"])] == list(range(1, 9))

    # fsdp = ddp. Both compute each rank's forward and backward with the same weights; they differ only in how the
    # gradient is reduced and its norm taken (DDP: a bucket all-reduce; FSDP2: a reduce-scatter, then the norm of the
    # local shards all-reduced), float32 roundings of relative size ~1e-7 in the gradient and in clip_grad_norm's
    # factor. AdamW's update, m / sqrt(v), moves by the same relative ~1e-7 of its size, at most ~lr per element and
    # step: after 4 steps |delta| <~ 4 lr 1e-7; atol 4 lr 1e-4 leaves 1000x for the forward's amplification, and
    # is still ~80 float32 ulps of the largest adapter entry (~0.2): a wrong gradient, a missed reshard or a lost
    # micro-batch moves entries by ~lr.
    tolerance = dict(rtol=0, atol=4 * LR * 1e-4)
    for a, b in ((final_weights(runs["ddp"], True), final_weights(runs["fsdp"], True)),
                 (merged(runs["ddp"]), merged(runs["fsdp"]))):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], **tolerance, msg=lambda m: f"{k}: {m}")
    a, b = metrics(runs["ddp"]), metrics(runs["fsdp"])
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):  # the loss and the gradient norm (a sum where there should be a mean would double it)
        for key in ("loss", "grad_norm", "masked_fraction", "beta_mean"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5), key

    # --parallel fsdp shards the frozen base (DDP, which keeps it whole on every rank, passes every check above):
    # each rank holds half of its elements (every first dimension of the tiny model is even)
    sizes = [json.loads((tmp_path / f"base_sizes_{rank}.json").read_text()) for rank in (0, 1)]
    assert all(s["full"] > 0 and s["local"] * 2 == s["full"] for s in sizes), sizes

    # the fsdp checkpoint is what --parallel fsdp saved: the option recorded, the adapters sharded over both ranks
    trainer = json.loads((latest(runs["fsdp"]) / "trainer.json").read_text())
    assert trainer["options"]["parallel"] == "fsdp" and trainer["world_size"] == 2
    shards = sorted(p.name for p in (latest(runs["fsdp"]) / "train_state").glob("*.distcp"))
    assert len(shards) == 2, shards


def test_cpu_offload_at_one_process_equals_no_offload(base, tmp_path, one_thread):
    """One process, bf16: --cpu-offload runs FSDP2 over a process group of one (CPUOffloadPolicy on the host)
    and changes no number: the same adapter and metrics, bit for bit, as the plain one-process run."""
    extra = ("--lora", "--dtype", "bfloat16", "--max-steps", "3", "--lora-dropout", "0.1")
    main(train_args(base, tmp_path / "plain", *extra))
    main(train_args(base, tmp_path / "offload", *extra, "--parallel", "fsdp", "--cpu-offload"))
    assert not torch.distributed.is_initialized()  # main tears its group of one down
    a, b = final_weights(tmp_path / "plain", True), final_weights(tmp_path / "offload", True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert computed(metrics(tmp_path / "plain")) == computed(metrics(tmp_path / "offload"))


@pytest.mark.parametrize("flags,message", [
    (["--parallel", "ddp"], "--parallel ddp needs --lora"),
    (["--lora", "--cpu-offload"], "--cpu-offload needs FSDP2: add --parallel fsdp"),
    (["--lora", "--parallel", "ddp", "--cpu-offload"], "--cpu-offload needs FSDP2"),
    (["--parallel", "zero"], "--parallel: invalid choice"),
])
def test_bad_parallel_options_are_refused_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_options(["--model", "m", "--data", "d", *flags])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err, err


def test_parallel_defaults_are_as_before():
    from gift import parallel_of
    assert parallel_of(parse_options(["--model", "m", "--data", "d", "--lora"])) == "ddp"
    assert parallel_of(parse_options(["--model", "m", "--data", "d"])) == "fsdp"
    assert parallel_of(parse_options(["--model", "m", "--data", "d", "--lora", "--parallel", "fsdp",
                                      "--cpu-offload"])) == "fsdp"


def test_bench_lora_fsdp_smoke_runs_both_layouts(tmp_path, one_thread):
    """bench/lora_fsdp.py --smoke (the GPU measurement's code at tiny shapes on the CPU): both layouts step and are
    planned, and the JSON and markdown are written."""
    sys.path.insert(0, str(REPO / "bench"))
    import lora_fsdp
    result = lora_fsdp.main(["--smoke", "--out", str(tmp_path)])
    assert not torch.distributed.is_initialized()
    assert [r["layout"] for r in result["rows"]] == ["ddp", "fsdp"]
    for r in result["rows"]:
        assert r["step_s"] > 0 and r["planned_tensors_gib"] > 0
    saved = json.loads((tmp_path / "lora_fsdp_smoke.json").read_text())
    assert saved["rows"] == result["rows"] and "| fsdp |" in (tmp_path / "lora_fsdp_smoke.md").read_text()
