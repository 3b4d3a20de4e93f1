"""sample.py and eval.py refuse what they cannot run correctly, before the slow work.

Refusals are tables, one test per row: (name, call, fragments); call(tmp) makes the command line (or the function)
refuse, and every fragment (with {tmp} the test's folder) must be in its one-line message."""

import io
import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, latest, train_args
from test_eval import record_lines, sudoku_checkpoint
from test_sample import MASK, no_mask_model, random_prompts, tiny_model

import data
import embedded
import eval as E
import longjob  # noqa: E402
import sample
from adapters import save_adapter
from gift import main as train
from model import LLaDA, add_lora, lora_layers
from longjob import folder_fingerprint
from sample import SamplerOptions, generate
from cached_sample import generate_cached


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread


def refusal(call, capsys):
    """The one-line message of a refused call: a command line's SystemExit (argparse's error on stderr, or the
    exception's own text) or the ValueError / OSError its run_command_line prints in one line."""
    with pytest.raises((SystemExit, ValueError, OSError)) as info:
        call()
    return f"{info.value} {capsys.readouterr().err}"


def retrain(folder, seed=7):
    """The folder's weights changed in place, as a new training run into the same path would."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    for t in tensors.values():
        t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed), dtype=t.dtype) * 0.1)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def model_folder(path, seed=0, specials=None, **sizes):
    """A tiny LLaDA folder (config.json, model.safetensors, tokenizer.json) on the char tokenizer; `specials`: the
    special tokens it has instead of LLaDA's (a tokenizer of another family)."""
    tokenizer = embedded.make_char_tokenizer()
    if specials is not None:
        from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, Regex, decoders
        tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(embedded.CHAR_VOCAB)}))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tokenizer.decoder = decoders.Fuse()
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    config = embedded.tiny_config_for(tokenizer, **{**dict(d_model=32, n_heads=2, n_kv_heads=2, n_layers=2,
                                                           mlp_hidden_size=64), **sizes})
    LLaDA(config).init_weights(torch.Generator().manual_seed(seed)).save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def sample_argv(folder, *flags):
    return ["--model", str(folder), "--prompt", "hi", "--device", "cpu", "--gen-length", "8", "--steps", "8",
            "--block-length", "4", *flags]


def with_defaults(tmp, text):
    """A model folder whose generation_defaults.json holds `text`."""
    folder = model_folder(tmp / "m")
    (folder / "generation_defaults.json").write_text(text)
    return folder


def eval_argv(tmp, *flags):
    return sudoku_checkpoint(tmp, 4) + ["--out", str(tmp / "r.json"), *flags]


def countdown_file(tmp, *lines):
    path = tmp / "countdown.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def run_folder_with_missing_latest(tmp):
    """A run folder whose `latest` names a checkpoint that is gone (step-0000002 is there)."""
    model_folder(tmp / "run" / "checkpoints" / "step-0000002" / "model")
    (tmp / "run" / "latest").write_text("step-0000009\n")
    return tmp / "run"


# -----------------------------------------------------------------------------
# Values that are refused before any work, in both command lines (cases 8 and 12)

REFUSED = [
    # case 8: nonsense sampling values
    ("sample_cfg_scale_inf", lambda t: sample.main(sample_argv(model_folder(t / "m"), "--cfg-scale", "inf")),
     ["--cfg-scale inf: must be 0 (off) or more, a finite number"]),
    ("sample_temperature_inf", lambda t: sample.main(sample_argv(model_folder(t / "m"), "--temperature", "inf")),
     ["--temperature inf: must be 0 (greedy) or more, a finite number"]),
    ("eval_cfg_scale_inf", lambda t: E.main(eval_argv(t, "--cfg-scale", "inf")),
     ["--cfg-scale inf: must be 0 (off) or more, a finite number"]),
    ("eval_temperature_inf", lambda t: E.main(eval_argv(t, "--temperature", "inf")),
     ["--temperature inf: must be 0 (greedy) or more, a finite number"]),
    ("eval_duplicated_key", lambda t: E.main(["--model", str(model_folder(t / "m")), "--task", "countdown", "--data",
                                              str(countdown_file(t, '{"input": "1,2", "output": "3"}',
                                                                 '{"input": "1,2", "output": "3", "input": "4,5"}'))]),
     ["{tmp}/countdown.jsonl, line 2", "the key 'input' is given twice"]),
    # case 12: more steps than tokens, a seed out of range
    ("sample_steps_above_gen_length", lambda t: sample.main(sample_argv(model_folder(t / "m"), "--steps", "800")),
     ["--steps 800: more steps than the 8 tokens to generate", "use at most 8"]),
    ("sample_steps_above_default_gen_length", lambda t: sample.main(
        ["--model", str(model_folder(t / "m")), "--prompt", "hi", "--steps", "12800"]),
     ["--steps 12800: more steps than the 128 tokens"]),
    ("eval_steps_above_gen_length", lambda t: E.main(eval_argv(t, "--steps", "48")),
     ["--steps 48: more steps than the 24 tokens to generate"]),
    ("sample_seed_out_of_range", lambda t: sample.main(sample_argv(model_folder(t / "m"), "--seed", str(10 ** 23))),
     [f"--seed {10 ** 23}: must be in [0, 1000000)"]),
    ("eval_seed_out_of_range", lambda t: E.main(eval_argv(t, "--seeds", "0", str(10 ** 23))),
     [f"--seeds {10 ** 23}: must be in [0, 1000000)"]),
    # case 12: a generation_defaults.json of the wrong shape, type or value names the file and the field
    ("defaults_not_an_object", lambda t: sample.main(sample_argv(with_defaults(t, "[128, 32]"))),
     ["{tmp}/m/generation_defaults.json: expected a JSON object", "got list"]),
    ("defaults_wrong_type", lambda t: sample.main(sample_argv(with_defaults(t, '{"gen_length": "128"}'))),
     ["{tmp}/m/generation_defaults.json: field 'gen_length' = \"128\": expected an integer"]),
    ("defaults_list_value", lambda t: sample.main(sample_argv(with_defaults(t, '{"temperature": [0.5]}'))),
     ["{tmp}/m/generation_defaults.json: field 'temperature' = [0.5]: expected a number"]),
    ("defaults_bad_value", lambda t: sample.main(["--model", str(with_defaults(t, '{"steps": 0}')), "--prompt", "hi"]),
     ["{tmp}/m/generation_defaults.json: field 'steps' = 0: must be at least 1"]),
    ("defaults_more_steps_than_tokens", lambda t: sample.main(
        ["--model", str(with_defaults(t, '{"gen_length": 16, "steps": 64}')), "--prompt", "hi"]),
     ["{tmp}/m/generation_defaults.json: field 'steps' = 64: more steps than the 16 tokens"]),
    ("defaults_bad_choice", lambda t: sample.main(["--model", str(with_defaults(t, '{"cache": "full"}')), "--prompt",
                                                   "hi"]),
     ["{tmp}/m/generation_defaults.json: field 'cache' = \"full\"; expected one of"]),
    ("defaults_bad_value_in_eval", lambda t: E.main(["--model", str(with_defaults(t, '{"temperature": -1}')),
                                                     "--task", "sudoku", "--data", "x.csv"]),
     ["{tmp}/m/generation_defaults.json: field 'temperature' = -1: must be 0 (greedy) or more"]),
    ("defaults_bad_prompt_style_in_eval", lambda t: E.main(
        ["--model", str(with_defaults(t, '{"prompt_style": "chat"}')), "--task", "sudoku", "--data", "x.csv"]),
     ["{tmp}/m/generation_defaults.json: field 'prompt_style' = 'chat': expected one of"]),
    # case 12: `latest` naming a checkpoint that is gone
    ("sample_latest_names_a_missing_checkpoint", lambda t: sample.main(
        sample_argv(run_folder_with_missing_latest(t))),
     ["its `latest` file names the checkpoint 'step-0000009'", "{tmp}/run/checkpoints/step-0000009 is missing",
      "the checkpoints there: step-0000002"]),
    ("eval_latest_names_a_missing_checkpoint", lambda t: E.main(
        ["--model", str(run_folder_with_missing_latest(t)), "--task", "sudoku"]),
     ["its `latest` file names the checkpoint 'step-0000009'", "is missing"]),
    # case 12: a tokenizer of neither family
    ("sample_tokenizer_without_chat_tokens", lambda t: sample.main(sample_argv(model_folder(
        t / "m", specials=(data.EOS, data.MASK)))),
     ["{tmp}/m: its tokenizer has no chat token", "<|start_header_id|>", "neither LLaDA's nor Dream's", "--raw"]),
    # case 12: --out on a file that is not eval.py's records
    ("eval_out_on_a_run_metrics_file", lambda t: (t / "run").mkdir() or (t / "run" / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.5}\n') and E.main(eval_argv(t)[:-2] + ["--out", str(t / "run" / "metrics.json")]),
     ["{tmp}/run/metrics.jsonl, line 1: not an eval.py records file"]),
]


@pytest.mark.parametrize("call, fragments", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_a_bad_value_is_refused_in_one_line_naming_it(tmp_path, call, fragments, capsys):
    message = refusal(lambda: call(tmp_path), capsys)
    for fragment in fragments:
        assert fragment.format(tmp=tmp_path) in message, message


USER_MISTAKES = [  # the same refusals from the command line: one line, exit status 1, no traceback
    (["sample.py", "--model", "{tmp}/m", "--prompt", "hi", "--seed", str(10 ** 23)], "sample.py: error: --seed"),
    (["sample.py", "--model", "{tmp}/m", "--prompt", "hi", "--cfg-scale", "inf"], "sample.py: error: --cfg-scale"),
    (["eval.py", "--model", "{tmp}/m", "--task", "countdown", "--data", "{tmp}/dup.jsonl"],
     "eval.py: error: {tmp}/dup.jsonl, line 1: the key 'output' is given twice"),
]


@pytest.mark.parametrize("argv, start", USER_MISTAKES, ids=[" ".join(a[:1] + a[-2:-1]) for a, _ in USER_MISTAKES])
def test_a_users_mistake_is_one_line_without_traceback(tmp_path, argv, start):
    model_folder(tmp_path / "m")
    (tmp_path / "dup.jsonl").write_text('{"input": "1,2", "output": "3", "output": "4"}\n')
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, *[a.replace("{tmp}", str(tmp_path)) for a in argv]], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith(("usage:", " "))]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(start.replace("{tmp}", str(tmp_path))), result.stderr


def test_eval_py_harness_names_the_new_command(tmp_path):
    """`python eval.py --harness ...` (lm-evaluation-harness's command before harness.py): exit status 1 and one line
    naming `python harness.py`, before anything is read (the model folder does not exist)."""
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "eval.py", "--harness", "--model", str(tmp_path / "none"), "--tasks",
                             "arc_easy"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and result.stdout == "", (result.returncode, result.stdout, result.stderr[-2000:])
    assert result.stderr.count("\n") == 1 and "`python harness.py ...`" in result.stderr, result.stderr
    assert result.stderr.startswith("eval.py: error: --harness is gone"), result.stderr


# -----------------------------------------------------------------------------
# Adapters: a gift.py LoRA run with a merged export (cases 4 and 5)


@pytest.fixture(scope="module")
def lora_run(base, tmp_path_factory):
    """A one-step LoRA run of gift.py with --save-merged, on a copy of the tiny base (a test may change it)."""
    root = tmp_path_factory.mktemp("lora_run")
    shutil.copytree(base / "model", root / "base")
    out = root / "run"
    train(train_args(base, out, "--lora", "--save-merged", "--max-steps", "1", "--log-every", "1") +
          ["--model", str(root / "base")])
    return root, latest(out)


ADAPTER_CASES = [
    # case 5: the merged export and its own adapter
    ("sample_merged_with_its_adapter", lambda c: sample.main(sample_argv(c / "merged", "--adapter",
                                                                         str(c / "adapter")))),
    ("eval_merged_with_its_adapter", lambda c: E.main(["--model", str(c / "merged"), "--adapter", str(c / "adapter"),
                                                       "--task", "sudoku", "--data", "x.csv"])),
    ("sample_checkpoint_with_its_adapter", lambda c: sample.main(sample_argv(c, "--adapter", str(c / "adapter")))),
]


@pytest.mark.parametrize("call", [c[1] for c in ADAPTER_CASES], ids=[c[0] for c in ADAPTER_CASES])
def test_a_merged_export_with_its_own_adapter_is_refused(lora_run, call, capsys):
    _, ckpt = lora_run
    message = refusal(lambda: call(ckpt), capsys)
    assert f"--adapter {ckpt / 'adapter'}: the model" in message and "merged export of the same checkpoint" in message
    assert "applied twice" in message, message


def test_an_adapter_on_another_base_is_refused_with_both_fingerprints(lora_run, tmp_path, capsys):
    root, ckpt = lora_run
    then = json.loads((ckpt / "trainer.json").read_text())["fingerprints"]["model"]
    assert then == folder_fingerprint(root / "base")
    own = sample_argv(root / "base", "--adapter", str(ckpt / "adapter"))
    sample.parse_args(own)  # the adapter on its own base: accepted
    other = model_folder(tmp_path / "other", seed=5)
    for call in (lambda: sample.main(sample_argv(other, "--adapter", str(ckpt / "adapter"))),
                 lambda: E.main(["--model", str(other), "--adapter", str(ckpt / "adapter"), "--task", "sudoku",
                                 "--data", "x.csv"])):
        message = refusal(call, capsys)
        assert f"fingerprint {then}" in message and f"fingerprint {folder_fingerprint(other)}" in message, message
    weights = root / "base" / "model.safetensors"
    saved = weights.read_bytes()
    try:  # the base retrained into the same path: the checkpoint's own adapter is refused too
        retrain(root / "base")
        message = refusal(lambda: sample.main(own), capsys)
        assert f"trained on a base model with fingerprint {then}" in message, message
        assert f"{root / 'base'} has fingerprint {folder_fingerprint(root / 'base')}" in message
    finally:
        weights.write_bytes(saved)


# -----------------------------------------------------------------------------
# Case 3: a resumed eval never mixes two models


def test_a_resumed_eval_refuses_another_model_at_the_same_path(tmp_path, capsys):
    argv = eval_argv(tmp_path, "--batch-size", "2")
    E.main(argv + ["--limit", "2"])
    model = tmp_path / "ckpt"
    first = folder_fingerprint(model)
    assert {r["settings"]["model_fingerprint"] for r in record_lines(tmp_path / "r.jsonl")} == {first}
    retrain(model)
    with pytest.raises(SystemExit) as info:
        E.main(argv + ["--limit", "4"])
    assert "generations of another model" in str(info.value)
    assert f"fingerprint {first} in the file, {folder_fingerprint(model)} now" in str(info.value)
    assert len(record_lines(tmp_path / "r.jsonl")) == 2  # nothing added


def test_records_without_a_fingerprint_still_resume(tmp_path):
    """Records written before the fingerprints were recorded (no such field) are accepted: paths and data hash match."""
    argv = eval_argv(tmp_path, "--batch-size", "2")
    E.main(argv + ["--limit", "2"])
    path = tmp_path / "r.jsonl"
    old = [dict(r, settings={k: v for k, v in r["settings"].items() if k != "model_fingerprint"})
           for r in record_lines(path)]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    E.main(argv + ["--limit", "4"])
    assert sorted(r["index"] for r in record_lines(path)) == [0, 1, 2, 3]


def test_a_resumed_eval_refuses_another_adapter_at_the_same_path(tmp_path):
    argv = eval_argv(tmp_path, "--batch-size", "2", "--adapter", str(tmp_path / "adapter"))

    def train_adapter(seed):  # an adapter (re)trained into the same folder
        model = LLaDA.from_pretrained(tmp_path / "ckpt")
        add_lora(model, r=2, alpha=4, generator=torch.Generator().manual_seed(seed))
        for _, m in lora_layers(model):
            m.lora_B.data.normal_(generator=torch.Generator().manual_seed(seed))
        save_adapter(model, tmp_path / "adapter")

    train_adapter(1)
    E.main(argv + ["--limit", "2"])
    train_adapter(2)
    with pytest.raises(SystemExit) as info:
        E.main(argv + ["--limit", "4"])
    assert "generations of another adapter" in str(info.value) and f"now ({tmp_path / 'adapter'}" in str(info.value)


# -----------------------------------------------------------------------------
# Case 8: several seeds that cannot differ; case 12: a spreadsheet's CSV, the chat's context, a rotated checkpoint


def test_seeds_that_cannot_differ_are_said_in_one_line(tmp_path, capsys):
    """Chosen: the seeds still run (the summary lists each, as asked), with one line saying they repeat one
    evaluation; a seed that changes something (sampling, shots) is not warned about."""
    E.main(eval_argv(tmp_path, "--limit", "2", "--seeds", "0", "1"))
    out = capsys.readouterr().out
    assert "warning: --seeds 0 1: greedy decoding with 0 shots draws nothing from the seed" in out
    E.main(sudoku_checkpoint(tmp_path, 4) + ["--out", str(tmp_path / "t.json"), "--limit", "2", "--seeds", "0", "1",
                                             "--temperature", "0.5"])
    assert "warning" not in capsys.readouterr().out


@pytest.mark.parametrize("options, shots, free", [
    (SamplerOptions(), 0, True), (SamplerOptions(), 2, False), (SamplerOptions(temperature=0.5), 0, False),
    (SamplerOptions(remasking="random"), 0, False), (SamplerOptions(cache="dual", threshold=0.9), 0, True),
    (SamplerOptions(sampler="dream", alg="origin"), 0, False),
    (SamplerOptions(sampler="dream", alg="entropy"), 0, True),
    (SamplerOptions(sampler="dream", alg="entropy", alg_temp=0.5), 0, False)])
def test_which_settings_draw_nothing_from_the_seed(options, shots, free):
    from types import SimpleNamespace
    assert E.seed_free(SimpleNamespace(options=options, shots=shots)) is free


def test_a_sudoku_csv_saved_by_a_spreadsheet_is_read(tmp_path):
    rows = ["Puzzle,Solution", "3102200002100320,3142243142131324", "0142243142131320,3142243142131324"]
    (tmp_path / "plain.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "excel.csv").write_bytes(b"\xef\xbb\xbf" + "\r\n".join(rows).encode() + b"\r\n")
    assert E.load_sudoku(tmp_path / "excel.csv") == E.load_sudoku(tmp_path / "plain.csv")
    assert len(E.load_sudoku(tmp_path / "excel.csv")) == 2


def test_a_chat_outgrowing_the_context_starts_over(tmp_path, capsys, monkeypatch):
    """Turn 2 (turn 1 + its answer + the new message) exceeds the context: the conversation is cleared and the
    message answered alone, so turn 3 works too; /reset clears it at will."""
    fmt_len = len(data.encode(embedded.make_char_tokenizer(), data.chat_prompt([{"role": "user", "content": "hi"}])))
    folder = model_folder(tmp_path / "m", max_sequence_length=fmt_len + 8 + 4)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nhi\nhi\n/reset\nhi\n"))
    sample.main(["--model", str(folder), "--device", "cpu", "--gen-length", "8", "--steps", "8", "--block-length",
                 "8"])
    out = capsys.readouterr().out
    assert out.count("assistant> ") == 4, out
    assert "conversation cleared (/reset does it at will), answering this message alone" in out
    assert "sample.py: conversation cleared\n" in out  # /reset


def test_a_checkpoint_rotated_away_while_loading_is_said(tmp_path, capsys):
    ckpt = tmp_path / "run" / "checkpoints" / "step-0000002"
    model_folder(ckpt / "model")
    args, _ = sample.parse_args(sample_argv(ckpt))
    shutil.rmtree(ckpt)  # a running gift.py rotates it away before the weights are read
    with pytest.raises(FileNotFoundError, match="step-0000002/model was removed while it loaded"):
        sample.load_model(args)
    with pytest.raises(FileNotFoundError, match="was removed while it loaded"):  # eval.py's call
        longjob.load_weights(args.folder, None, torch.float32, "cpu", merge=True)


# -----------------------------------------------------------------------------
# Case 15b: what "cache_refresh=1 gives the exact tokens" holds for


def leftover_masks(model, prompt, **kw):
    """generate()'s output and whether a block ended with a mask left (a candidate equal to the mask token)."""
    seen = []
    hook = model.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
    out = generate(model, prompt, **kw)
    hook.remove()
    P, Lb, per_block = prompt.shape[1], kw["block_length"], kw["steps"] // (kw["gen_length"] // kw["block_length"])
    left = any((seen[b * per_block][:, P:P + b * Lb] == MASK).any() for b in range(1, len(seen) // per_block))
    return out, left or bool((out == MASK).any())


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_cache_refreshed_every_step_is_exact_when_every_block_ends_unmasked(cache):
    """steps = gen length and a model that never proposes the mask token: every block ends fully unmasked, and the
    refreshed cache gives the exact tokens; a random model that does propose it gives them whenever no block left a
    mask, and differs on a case where one did (the exact sampler offers it again, the cached one does not)."""
    kw = dict(steps=12, gen_length=12, block_length=4)
    for seed in range(3):
        prompt = random_prompts(3, 5, seed)
        model = no_mask_model(seed).double()
        exact, left = leftover_masks(model, prompt, **kw)
        assert not left
        assert torch.equal(generate_cached(model, prompt, options=SamplerOptions(cache=cache, cache_refresh=1, **kw)),
                           exact)
    differed = 0
    for seed in range(12):
        model, prompt = tiny_model(seed, std=0.6).double(), random_prompts(2, 5, seed)
        exact, left = leftover_masks(model, prompt, **kw)
        cached = generate_cached(model, prompt, options=SamplerOptions(cache=cache, cache_refresh=1, **kw))
        if not left:
            assert torch.equal(cached, exact), seed
        differed += left and not torch.equal(cached, exact)
    assert differed, "no case where a leftover mask made the samplers differ: pick other seeds"
