"""GiftLM under lm-eval's own command line (docs/harness.md's gift_lm_eval: harness.lm_eval_main) and lm-eval's
constructors: a user's mistake ends in one line, exit status 1, no traceback; batch_size and device in model_args
beside lm-eval's own --batch_size / --device; dllm's suppress_tokens=None; a device this torch does not have, refused
before the model loads. Skipped without lm-eval (pip install -r requirements-extras.txt)."""

import sys

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is optional: pip install -r requirements-extras.txt")

from test_harness import TASKS  # noqa: E402  (it sets the offline variables)
from test_harness_checks import at_repo_root, folders, local_tasks_only, no_model  # noqa: E402, F401  (fixtures)

import harness as H  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread


def gift_lm_eval(monkeypatch, capsys, *argv):
    """gift_lm_eval ARGV (lm-eval's command line, reading sys.argv): (exit status, stdout, stderr). lm-eval's
    setup_logging is left out: it binds a handler to the sys.stderr of its first call, which pytest closes after it."""
    import lm_eval.__main__
    monkeypatch.setattr(lm_eval.__main__, "setup_logging", lambda *_, **__: None)
    monkeypatch.setattr(sys, "argv", ["gift_lm_eval", "--model", "gift", "--tasks", "gift_mc", "--include_path",
                                      str(TASKS), *argv])
    try:
        H.lm_eval_main()
        status = 0
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu", "--model_args", "model={llada},seed=1.5"], "GiftLM: seed 1.5: expected an integer"),
    (["--device", "cpu", "--model_args", "model={llada},gen_length=50"], "GiftLM: gen_length=50 must be a multiple"),
    (["--device", "cpu", "--model_args", "model={llada},cfg=0.5"], "GiftLM: cfg=0.5: LLaDA's cfg also guides"),
    (["--model_args", "model={llada}"], "GiftLM: device 'cuda:0': not a device of this machine"),  # lm-eval's default
])
def test_a_refusal_under_lm_evals_command_line_is_one_line(folders, monkeypatch, capsys, argv, message, no_model,
                                                           local_tasks_only):
    if "cuda:0" in message and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    argv = [a.replace("{llada}", str(folders["llada"][0])) for a in argv]
    status, _, err = gift_lm_eval(monkeypatch, capsys, *argv)
    said = [line for line in err.splitlines() if line.startswith("gift_lm_eval: error:")]
    assert status == 1 and len(said) == 1 and message in said[0], err
    assert "Traceback" not in err, err


def test_batch_size_in_model_args_beside_lm_evals_own(folders, monkeypatch, capsys, local_tasks_only):
    """lm-eval passes its --batch_size (default 1) and --device beside the model_args: those of the model_args win, the
    others fill in (lm-eval's LM would raise a TypeError: batch_size given twice); the evaluation runs."""
    folder = folders["llada"][0]
    lm = H.GiftLM.create_from_arg_string(f"model={folder},batch_size=4,device=cpu",
                                         {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"})
    assert (lm.batch_size, str(lm.device)) == (4, "cpu")
    lm = H.GiftLM.create_from_arg_obj({"model": str(folder)}, {"batch_size": "8", "device": "cpu"})
    assert lm.batch_size == 8
    status, out, err = gift_lm_eval(monkeypatch, capsys, "--device", "cpu", "--batch_size", "2", "--limit", "2",
                                    "--model_args", f"model={folder},batch_size=4,mc_num=2,check_greedy=False")
    assert status == 0 and "gift_mc" in out, err


def test_suppress_tokens_none_is_no_suppression(folders):
    """dllm's suppress_tokens=None (and begin_suppress_tokens): no token suppressed, which GiftLM's samplers do."""
    for args in ("suppress_tokens=None", "begin_suppress_tokens=None", "suppress_tokens=none"):
        H.GiftLM.create_from_arg_string(f"model={folders['llada'][0]},{args}")
    H.GiftLM(model=str(folders["llada"][0]), suppress_tokens=None, begin_suppress_tokens=None)


@pytest.mark.parametrize("device", ["mps", "mps:0", "cuda", "cuda:1", "meta", "xpu"])
def test_a_device_this_torch_has_not_is_refused_before_loading(folders, device, no_model):
    backend = getattr(torch, device.split(":")[0], None)
    if hasattr(backend, "device_count") and backend.device_count() > int((device + ":0").split(":")[1]):
        pytest.skip(f"this machine has {device}")
    with pytest.raises(ValueError) as info:
        H.GiftLM(model=str(folders["llada"][0]), device=device)
    said = str(info.value)
    assert said.startswith(f"GiftLM: device {device!r}: not a device of this machine") and "\n" not in said, said
