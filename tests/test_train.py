"""The training loop of gift.py: options, end-to-end runs, checkpoints, resume, faults, GIFT* cache, and
distributed runs (2 processes, gloo) equal to one process with the same global batch."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, latest, metrics, train_args
from safetensors.torch import load_file

import embedded
import gift
import longjob
from data import load_tokenizer
from gift import main, parse_options
from adapters import load_adapter
from model import LLaDA

args = train_args


# -----------------------------------------------------------------------------
# Options


def test_options_flags_help_and_errors(capsys):
    with pytest.raises(SystemExit):
        parse_options(["--no-such-flag", "1"])
    with pytest.raises(SystemExit):
        parse_options(["--help"])
    help_text = capsys.readouterr().out
    for f in gift.TrainOptions.__dataclass_fields__:
        assert "--" + f.replace("_", "-") in help_text
    with pytest.raises(SystemExit):
        parse_options(["--loss", "nonsense"])
    assert parse_options(["--loss", "dream"]).loss == parse_options(["--loss", "cart"]).loss == "cart"  # eq. (16)
    opts = parse_options(["--model", "m", "--data", "d", "--lr", "2e-5", "--lora"])
    assert opts.lr == 2e-5 and opts.lora and opts.epochs == 20  # the paper's LoRA defaults otherwise
    assert parse_options(["--model", "m", "--data", "d", "--lora-dropout", "0"]).lora_dropout == 0.0  # 0 is given
    assert parse_options([]).out == embedded.EMBEDDED["out"]  # no --model: the embedded task's settings


def test_importing_gift_imports_no_evaluation_and_sets_no_warning_filter():
    """gift.py is imported by tests, benches and experiments: eval.py (and sample.py) load only when the built-in
    task is evaluated, and the import changes no warning filter."""
    check = ("import sys, warnings; import torch.distributed.checkpoint, torch.utils.checkpoint, data, model; "
             "filters = list(warnings.filters); import gift; "
             "assert 'eval' not in sys.modules and 'sample' not in sys.modules, 'eval.py imported'; "
             "assert warnings.filters == filters, 'a warning filter changed'")
    result = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# -----------------------------------------------------------------------------
# End to end: the checkpoints load where the base model did


def test_full_run_writes_a_loadable_hf_folder(base, tmp_path):
    out = tmp_path / "full"
    main(args(base, out, "--loss", "gift", "--max-steps", "3"))
    ckpt = latest(out)
    model = LLaDA.from_pretrained(ckpt / "model")
    load_tokenizer(ckpt / "model")  # tokenizer files copied from the base folder
    before = LLaDA.from_pretrained(base / "model")
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.state_dict().values()))
    log = metrics(out)
    assert [r["step"] for r in log] == [1, 2, 3]
    for key in ("loss", "lr", "grad_norm", "masked_fraction", "beta_mean", "beta_std", "tokens_per_s", "eta_s"):
        assert key in log[-1]


def test_lora_run_writes_a_peft_adapter(base, tmp_path):
    out = tmp_path / "lora"
    main(args(base, out, "--lora", "--loss", "sft", "--max-steps", "2"))
    adapter = latest(out) / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    model = load_adapter(LLaDA.from_pretrained(base / "model"), adapter)
    assert any(float(m.lora_B.abs().sum()) > 0 for m in model.modules() if hasattr(m, "lora_B"))


def test_loss_dream_is_cart_and_a_run_saved_as_dream_resumes(base, tmp_path):
    """--loss dream (the paper's name for eq. 16) runs and saves as cart; a checkpoint whose trainer.json says "dream"
    resumes with either name."""
    out = tmp_path / "cart"
    main(args(base, out, "--lora", "--loss", "dream", "--max-steps", "1"))
    trainer = latest(out) / "trainer.json"
    meta = json.loads(trainer.read_text())
    assert meta["options"]["loss"] == "cart"
    meta["options"]["loss"] = "dream"
    trainer.write_text(json.dumps(meta))
    main(args(base, out, "--lora", "--loss", "cart", "--max-steps", "2", "--resume"))
    assert [r["step"] for r in metrics(out)] == [1, 2]


def test_bad_row_names_the_line(base, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match="line 2"):
        main(["--model", str(base / "model"), "--data", str(bad), "--out", str(tmp_path / "o")])


def test_max_len_is_capped_at_the_models_max_sequence_length(base, tmp_path, capsys):
    """--max-len above config.json's max_sequence_length: a warning naming both, and the model's limit used (the
    61-token example dropped, and saved in the options, so the same command resumes)."""
    short = tmp_path / "short"
    shutil.copytree(base / "model", short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_sequence_length": 56}))
    out = tmp_path / "run"
    main(args(base, out, "--model", str(short), "--max-len", "1000", "--max-steps", "1"))
    printed = capsys.readouterr().out
    assert "--max-len 1000 exceeds the model's max_sequence_length 56" in printed
    assert "data: 11 examples" in printed and "of 12 rows, 1 longer than --max-len" in printed
    assert json.loads((latest(out) / "trainer.json").read_text())["options"]["max_len"] == 56
    main(args(base, out, "--model", str(short), "--max-len", "1000", "--max-steps", "2", "--resume"))
    assert "resumed from" in capsys.readouterr().out
    main(args(base, tmp_path / "fits", "--model", str(short), "--max-len", "56", "--max-steps", "1"))
    assert "exceeds" not in capsys.readouterr().out


# -----------------------------------------------------------------------------
# Resume (more in tests/test_resume.py)


def test_resume_refuses_changed_options(base, tmp_path):
    out = tmp_path / "run"
    main(args(base, out, "--max-steps", "1"))
    with pytest.raises(ValueError, match="lr"):
        main(args(base, out, "--max-steps", "2", "--resume", "--lr", "1e-4"))


def test_interrupted_checkpoint_leaves_the_last_good_one(base, tmp_path, monkeypatch):
    out = tmp_path / "run"
    main(args(base, out, "--lora", "--save-every", "1", "--max-steps", "1"))
    good = latest(out)
    real_save = longjob.save_adapter

    def crash(model, path, **kw):  # write part of the adapter, then die
        real_save(model, path, **kw)
        (path / "adapter_model.safetensors").write_bytes(b"truncated")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(longjob, "save_adapter", crash)
    with pytest.raises(KeyboardInterrupt, match="killed mid-write"):  # the hook's: it ran
        main(args(base, out, "--lora", "--save-every", "1", "--max-steps", "2", "--resume"))
    assert latest(out) == good
    load_adapter(LLaDA.from_pretrained(base / "model"), good / "adapter")


# -----------------------------------------------------------------------------
# Faults


def test_non_finite_steps_are_skipped_then_stop(base, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gift, "diffusion_loss", lambda *a, **k: torch.tensor(float("nan"), requires_grad=True))
    with pytest.raises(RuntimeError, match="step 3"):
        main(args(base, tmp_path / "nan", "--max-bad-steps", "3"))
    assert capsys.readouterr().out.count("update skipped") == 3


# -----------------------------------------------------------------------------
# Distributed: 2 processes (gloo) == 1 process with the same global batch and the same noise


def torchrun(nproc, argv, cwd):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(REPO / "gift.py"), *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.parametrize("mode", ["lora", "full", "full-refresh", "full-star"])
def test_two_processes_equal_one(base, tmp_path, mode):
    # LoRA runs under DDP, full fine-tuning under FSDP2; GIFT's "masked" norm needs the all-reduced count.
    # full-refresh: betas reused for 2 epochs (BetaCache: gathered over ranks), 7 steps = epochs 0, 1 and 2
    # full-star: GIFT*'s no-grad passes over the data before the first step (FSDP2 must reshard after them)
    steps = 7 if mode == "full-refresh" else 3
    loss = "gift-star" if mode == "full-star" else "gift"
    extra = ["--loss", loss, "--max-steps", str(steps)] + (["--lora"] if mode == "lora" else [])
    extra += ["--beta-refresh-epochs", "2", "--epochs", "3"] if mode == "full-refresh" else []
    one, two = tmp_path / "one", tmp_path / "two"
    torchrun(1, args(base, one, *extra, batch_size=2), tmp_path)  # global batch 1 x 2 x accum 2
    torchrun(2, args(base, two, *extra, batch_size=1), tmp_path)  # global batch 2 x 1 x accum 2
    name = "adapter/adapter_model.safetensors" if mode == "lora" else "model/model.safetensors"
    wa, wb = load_file(latest(one) / name), load_file(latest(two) / name)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)
    a, b = metrics(one), metrics(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, steps + 1))
    for ra, rb in zip(a, b):  # the statistics pool every micro-batch of every rank
        for key in ("loss", "grad_norm", "masked_fraction", "beta_mean", "beta_std"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-4), key


# every option check: the flags and what the message must name
BAD_OPTIONS = [
    (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
    (["--grad-accum", "0"], "--grad-accum 0: must be at least 1"),
    (["--log-every", "0"], "--log-every 0"),
    (["--keep-last", "0"], "--keep-last 0"),
    (["--lora-r", "0"], "--lora-r 0"),
    (["--epochs", "0"], "--epochs 0"),
    (["--max-steps", "-1"], "--max-steps -1"),
    (["--lr=-1e-5"], "--lr -1e-05: must be positive"),
    (["--eps", "1"], "--eps 1.0: must be in [0, 1)"),
    (["--dtype", "float16"], "--dtype: invalid choice: 'float16'"),
    (["--save-dtype", "int8"], "--save-dtype: invalid choice: 'int8'"),
    (["--loss", "gift2"], "--loss: invalid choice: 'gift2'"),
    (["--lora", "--lora-targets", "q_proj,qkv"], "['qkv'] not among the linears"),
    (["--resume", "--overwrite"], "choose one"),
    (["--save-merged"], "--save-merged needs --lora"),
    (["--beta-refresh-epochs", "-1"], "--beta-refresh-epochs -1: must be 1"),
    (["--loss", "sft", "--beta-refresh-epochs", "3"], "not --loss sft"),
    (["--loss", "gift-star", "--beta-refresh-epochs", "0"], "not --loss gift-star"),
]


@pytest.mark.parametrize("flags,message", BAD_OPTIONS, ids=[" ".join(f) for f, _ in BAD_OPTIONS])
def test_bad_options_are_refused_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_options(["--model", "m", "--data", "d", *flags])
    assert message in capsys.readouterr().err


def test_data_without_model_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_options(["--data", "d.jsonl"])
    assert "--data needs --model" in capsys.readouterr().err
    parse_options(["--model", "m", "--data", "d", "--lr", "0"])
    assert "--lr 0" in capsys.readouterr().err  # a warning, not an error
