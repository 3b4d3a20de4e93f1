"""harness.py's checks around lm-evaluation-harness (GiftLM, python harness.py) and eval.py's around its --out files:
a user's mistake is refused in one line naming the flag, model_arg, task or file, before the model loads (the tests
make loading it fail); no file eval.py or harness.py did not write is replaced, truncated or renamed; the likelihood
estimate does not depend on --batch-size. Skipped without lm-eval (pip install -r requirements-extras.txt)."""

import fcntl
import json
import os
import shutil

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is optional: pip install -r requirements-extras.txt")

import lm_eval.tasks  # noqa: E402
from conftest import REPO  # noqa: E402
from test_eval import record_lines, sudoku_checkpoint  # noqa: E402
from test_harness import TASKS, elbo_draws, requests_of, tiny_folder  # noqa: E402  (it sets the offline variables)

import data  # noqa: E402
import embedded  # noqa: E402
import eval as E  # noqa: E402
import harness as H  # noqa: E402
from model import atomic_write_text  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread


@pytest.fixture(autouse=True)
def at_repo_root(monkeypatch):
    """The task YAMLs of tests/data/harness name their data files from the repository root."""
    monkeypatch.chdir(REPO)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness_checks")
    return {family: (root / family, *tiny_folder(root / family, family)) for family in ("llada", "dream")}


@pytest.fixture
def no_model(monkeypatch):
    """Loading the model (or starting torchrun's process group) fails the test: refusals come before it (eval.py's
    and harness.py's)."""
    def loaded(*_, **__):
        raise AssertionError("the model loaded before the refusal")
    for module in (E, H):
        monkeypatch.setattr(module, "load_weights", loaded)
        monkeypatch.setattr(module, "setup_distributed", loaded)


@pytest.fixture
def local_tasks_only(monkeypatch):
    """lm-eval's own task index (some 40 s to build) left out: an unknown name is unknown among the local YAMLs."""
    real = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda include_path=None, **_: real(
        include_path=include_path, include_defaults=False))


def refusal(call, capsys):
    """The one-line message of a refused call (argparse's error on stderr, or the exception's text)."""
    with pytest.raises((SystemExit, ValueError, OSError)) as info:
        call()
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) <= 1, err
    return f"{info.value} {' '.join(err)}"


def harness_argv(folder, *extra, tasks="gift_mc", include=TASKS):
    return ["--model", str(folder), "--tasks", tasks, "--include-path", str(include), "--mc-num", "2",
            "--dtype", "float64", "--no-check-greedy", *extra]


def task_yaml(folder, name, base="gift_gen", **changes):
    """A copy of tests/data/harness/<base>.yaml named `name` in `folder`, its data file absolute, lines changed."""
    text = (TASKS / f"{base}.yaml").read_text().replace(f"task: {base}", f"task: {name}")
    text = text.replace(f"tests/data/harness/{base}.jsonl", str(TASKS / f"{base}.jsonl"))
    for old, new in changes.items():
        assert old in text
        text = text.replace(old, new)
    (folder / f"{name}.yaml").write_text(text)


# -----------------------------------------------------------------------------
# 1. harness.py --out replaces only the results of an earlier harness.py


def test_harness_out_replaces_only_its_own_results(folders, tmp_path, capsys, no_model):
    folder = folders["llada"][0]
    user = tmp_path / "mine.json"
    user.write_text('{"my": "notes"}')
    (tmp_path / "tasks").mkdir()
    shutil.copy(TASKS / "gift_mc.jsonl", tmp_path / "tasks" / "gift_mc.jsonl")
    task_yaml(tmp_path / "tasks", "mc_here", "gift_mc", **{str(TASKS / "gift_mc.jsonl"): str(
        tmp_path / "tasks" / "gift_mc.jsonl")})
    cases = [(user, "not the results of harness.py"), (folder / "config.json", "not the results"),
             (tmp_path / "tasks" / "gift_mc.jsonl", "not the results"), (tmp_path, "a folder"),
             (tmp_path / "no" / "r.json", "its folder does not exist")]
    for out, message in cases:
        before = out.read_bytes() if out.is_file() else None
        said = refusal(lambda: H.harness_main(harness_argv(folder, "--out", str(out), include=tmp_path / "tasks",
                                                           tasks="mc_here")), capsys)
        assert f"--out {out}" in said and message in said, said
        assert (out.read_bytes() if out.is_file() else None) == before
    assert not (tmp_path / "no").exists()


def test_harness_out_of_an_earlier_run_is_replaced(folders, tmp_path, capsys):
    out = tmp_path / "r.json"
    for _ in range(2):
        H.harness_main(harness_argv(folders["dream"][0], "--out", str(out)))
        assert "acc,none" in json.loads(out.read_text())["results"]["gift_mc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary file left


# -----------------------------------------------------------------------------
# 2. Beside eval.py's --out X.json: a user's X.jsonl, X.lock, X.json.<pid>.tmp are never written or renamed


def test_a_users_jsonl_beside_out_is_refused_not_truncated(tmp_path, capsys, no_model):
    argv = sudoku_checkpoint(tmp_path, 2) + ["--out", str(tmp_path / "r.json")]
    for text in ("my notes, one line\n", "no line break", ""):
        (tmp_path / "r.jsonl").write_text(text)
        said = refusal(lambda: E.main(argv), capsys)
        assert f"{tmp_path / 'r.jsonl'}, line 1: not an eval.py records file" in said, said
        assert (tmp_path / "r.jsonl").read_text() == text


def test_a_users_lock_and_tmp_files_are_left_alone(tmp_path):
    argv = sudoku_checkpoint(tmp_path, 3) + ["--batch-size", "2", "--out", str(tmp_path / "r.json")]
    mine = {tmp_path / "r.lock": "my lock\n", tmp_path / f"r.json.{os.getpid()}.tmp": '{"my": "draft"}',
            tmp_path / "r.json.tmp": "draft"}
    for path, text in mine.items():
        path.write_text(text)
    E.main(argv)
    E.main(argv)  # a rerun continues (and rewrites the summary) the same way
    assert {path: path.read_text() for path in mine} == mine
    assert json.loads((tmp_path / "r.json").read_text())["n_items"] == 3
    assert sorted(r["index"] for r in record_lines(tmp_path / "r.jsonl")) == [0, 1, 2]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp") and p not in mine]  # none of its own left


def test_the_records_file_itself_is_locked(tmp_path, capsys):
    argv = sudoku_checkpoint(tmp_path, 2) + ["--out", str(tmp_path / "r.json")]
    E.main(argv + ["--limit", "1"])
    before = (tmp_path / "r.jsonl").read_bytes()
    with open(tmp_path / "r.jsonl", "rb") as holder:  # another eval.py writes there
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        said = refusal(lambda: E.main(argv), capsys)
    assert "another eval.py is writing" in said and (tmp_path / "r.jsonl").read_bytes() == before
    assert not (tmp_path / "r.lock").exists()


def test_atomic_write_text_writes_no_file_but_its_own(tmp_path):
    theirs = tmp_path / f"a.json.{os.getpid()}.tmp"  # the per-process name it used to write, then rename
    theirs.write_text("a user's")
    atomic_write_text(tmp_path / "a.json", "{}")
    assert (tmp_path / "a.json").read_text() == "{}" and theirs.read_text() == "a user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", theirs.name]
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o666 & ~umask  # others may read it, as a plain write


# -----------------------------------------------------------------------------
# 3. A generation that leaves no room for its prompt in the context is refused by task name


@pytest.mark.parametrize("context, max_gen_toks", [("q: hi", 248), ("q: hi", 1000), ("", 255), ("q: hi" * 60, 64)])
def test_a_prompt_without_room_for_its_answer_is_refused(folders, context, max_gen_toks):
    lm = H.GiftLM(model=str(folders["llada"][0]), dtype="float64")  # max_sequence_length 256
    requests = requests_of("generate_until", [("q: ok", {"until": [], "max_gen_toks": 8}),
                                              (context, {"until": [], "max_gen_toks": max_gen_toks})], "long_one")
    with pytest.raises(ValueError, match="task 'long_one': a prompt of .* tokens \\+ .* to generate exceed the "
                                         "model's max_sequence_length 256"):
        lm.generate_until(requests)


# -----------------------------------------------------------------------------
# 4. The likelihood draws do not depend on the batch size


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_the_elbo_draws_are_the_same_at_any_batch_size(folders, family, monkeypatch):
    """Whether 1, 3, 8 or 16 draws run per forward pass: the same counts (stratified over all mc_num draws) and masks
    (each drawn in turn), bit for bit, and so the same draws up to float64 rounding (a pass of another size rounds
    its matrix products otherwise, ~1e-15 here; another mask moves a draw by ~1)."""
    _, model, tokenizer = folders[family]
    context, continuation = data.encode(tokenizer, "q: say hi\na:"), data.encode(tokenizer, " hi there")
    real, masks = H.continuation_masks, []
    monkeypatch.setattr(H, "continuation_masks", lambda *a: masks.append(real(*a)) or masks[-1])
    draws = []
    for b in (1, 3, 8, 16):
        masks.clear()
        draws.append((elbo_draws(model, context, continuation, 16, b, torch.Generator().manual_seed(5)),
                      torch.cat(masks)))
    for d, m in draws[1:]:
        assert torch.equal(m, draws[0][1])
        torch.testing.assert_close(d, draws[0][0], rtol=0, atol=1e-9)
    assert len(set(draws[0][0].tolist())) > 8  # different masks: the draws differ


# -----------------------------------------------------------------------------
# 5. GiftLM checks the chat format's tokens as eval.py does


def test_a_dream_folder_without_chatml_tokens_is_refused(folders, tmp_path, no_model):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    folder = tmp_path / "dream"
    shutil.copytree(folders["dream"][0], folder)
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(embedded.DREAM_CHAR_VOCAB)}))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in data.DREAM_SPECIAL_TOKENS
                                  if t not in (data.IM_START, data.IM_END)])
    tokenizer.save(str(folder / "tokenizer.json"))
    with pytest.raises(ValueError, match=f"{folder}: its tokenizer has no chat token"):
        H.GiftLM(model=str(folder))


# -----------------------------------------------------------------------------
# 6. The shots are never drawn from the test file


def test_shot_data_that_is_the_test_file_is_refused(tmp_path, capsys, no_model):
    argv = sudoku_checkpoint(tmp_path, 4)
    link = tmp_path / "same.csv"
    link.symlink_to(tmp_path / "sudoku.csv")
    for shot_data in (tmp_path / "sudoku.csv", link):
        said = refusal(lambda: E.main(argv + ["--shots", "1", "--shot-data", str(shot_data)]), capsys)
        assert f"--shot-data {shot_data}: it is the --data file" in said, said


# -----------------------------------------------------------------------------
# 7. Rough model_args and flags, each refused in one line before the model loads

BAD_MODEL_ARGS = [
    (dict(dtype="foo"), "dtype 'foo'; expected one of ('auto', 'bfloat16', 'float32', 'float64')"),
    (dict(check_greedy="maybe"), "check_greedy 'maybe': expected true or false"),
    (dict(check_greedy=1), "check_greedy 1: expected true or false"),
    (dict(device="cuda:%d" % torch.cuda.device_count()), "device 'cuda:"),
    (dict(device="gpu"), "device 'gpu': not a device of this machine"),
    (dict(seed="3"), "seed '3': expected an integer"),
    (dict(seed=1.5), "seed 1.5: expected an integer"),
    (dict(seed=2 ** 70), f"seed {2 ** 70}: must be"),
    (dict(seed=True), "seed True: expected an integer"),
    (dict(mc_num=True), "mc_num True: expected an integer"),
    (dict(mc_num=2.0), "mc_num 2.0: expected an integer"),
    (dict(adapter=5), "adapter 5"),
]


@pytest.mark.parametrize("model_args, message", BAD_MODEL_ARGS, ids=[str(a) for a, _ in BAD_MODEL_ARGS])
def test_a_bad_model_arg_is_refused_naming_it(folders, model_args, message, no_model):
    with pytest.raises(ValueError, match="GiftLM: ") as info:
        H.GiftLM(model=str(folders["llada"][0]), **model_args)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_model_args_from_lm_evals_command_line_are_checked(folders, no_model):
    """lm_eval --model gift --model_args ...: the string parsed by lm-eval's own parser reaches the same checks."""
    from lm_eval.api.registry import get_model
    for args, message in (("check_greedy=maybe", "check_greedy 'maybe'"), ("seed=0.5", "seed 0.5"),
                          ("dtype=half", "dtype 'half'")):
        with pytest.raises(ValueError, match=message):
            get_model("gift").create_from_arg_string(f"model={folders['llada'][0]},{args}")


def bad_yamls(folder):
    """Task YAMLs of a user's: one lm-eval cannot parse, one whose template does not render, one with max_gen_toks 0."""
    (folder / "broken.yaml").write_text("task: broken\ndataset_path: json\n  oops: [\n")
    task_yaml(folder, "unrendered", "gift_mc", **{"q: {{question}}": "q: {{question"})
    task_yaml(folder, "no_tokens", **{"max_gen_toks: 16": "max_gen_toks: 0"})
    return folder


BAD_HARNESS_FLAGS = [
    (["--limit", "0"], "--limit 0: must be > 0"),
    (["--limit", "-1"], "--limit -1: must be > 0"),
    (["--num-fewshot", "-1"], "--num-fewshot -1: must be 0 or more"),
    (["--num-fewshot", "4"], "--num-fewshot 4: task gift_mc has 3 few-shot examples"),
    (["--tasks", ""], "--tasks '': an empty name (names are separated by commas)"),
    (["--tasks", "gift_mc,"], "--tasks 'gift_mc,': an empty name"),
    (["--tasks", "no_such_task"], "--tasks no_such_task: lm-eval cannot load it (KeyError: \"Spec 'no_such_task'"),
    (["--include-path", "{tmp}/missing"], "--include-path {tmp}/missing: no such folder"),
    (["--include-path", "{tmp}", "--tasks", "broken"], "; it cannot read {tmp}/broken.yaml (mapping values are not"),
    (["--include-path", "{tmp}", "--tasks", "unrendered"], "--tasks unrendered: lm-eval cannot load it (Template"),
    (["--include-path", "{tmp}", "--tasks", "no_tokens"], "task 'no_tokens': max_gen_toks 0: must be an integer"),
    (["--seed", str(10 ** 7)], f"seed {10 ** 7}: must be in"),
    (["--mc-num", "0"], "mc_num 0: must be an integer >= 1"),
]


@pytest.mark.parametrize("flags, message", BAD_HARNESS_FLAGS, ids=[" ".join(f) for f, _ in BAD_HARNESS_FLAGS])
def test_a_bad_harness_flag_or_task_is_refused_naming_it(folders, tmp_path, flags, message, capsys, no_model,
                                                         local_tasks_only):
    bad_yamls(tmp_path)
    argv = harness_argv(folders["llada"][0]) + [f.replace("{tmp}", str(tmp_path)) for f in flags]
    said = refusal(lambda: H.harness_main(argv), capsys)
    assert message.replace("{tmp}", str(tmp_path)) in said, said


def test_torchrun_ranks_without_a_document_are_refused(folders, monkeypatch, capsys, no_model):
    """lm-eval gives rank r the documents r, r + world, ...: with fewer documents than ranks one would have none (and
    stop with an error while the others wait for it); refused before the process group starts."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    said = refusal(lambda: H.harness_main(harness_argv(folders["llada"][0], "--limit", "2")), capsys)
    assert "task gift_mc: fewer documents to evaluate (--limit 2.0) than the 4 ranks" in said, said


def test_likelihood_requests_report_their_progress(folders, monkeypatch, capsys):
    """A likelihood request is mc_num / batch_size forward passes: rank 0 says how far it is (here after each)."""
    monkeypatch.setattr(H, "PROGRESS_SECONDS", 0)
    lm = H.GiftLM(model=str(folders["llada"][0]), dtype="float64", mc_num=2, check_greedy=False)
    lm.loglikelihood(requests_of("loglikelihood", [("q: hi\na:", " x"), ("q: ok\na:", " y"), ("q\na:", " z")]))
    lm.loglikelihood_rolling(requests_of("loglikelihood_rolling", [("some text",)]))
    out = capsys.readouterr().out
    assert [line.split(", ETA")[0] for line in out.splitlines() if line.startswith("GiftLM:")] == [
        "GiftLM: loglikelihood: 1/3 requests", "GiftLM: loglikelihood: 2/3 requests",
        "GiftLM: loglikelihood: 3/3 requests", "GiftLM: loglikelihood_rolling: 1/1 requests"]
