"""Model inputs and data files that could hang, run out of memory or fail far from
their cause are refused at once, in one line naming the file and the field or line.

As tests/test_inputs.py: one table, one test per row, (name, setup, exception type, fragments); setup(tmp) writes a
tiny model folder or data file with one thing wrong and makes the call that must refuse it, within a second (at_once:
a hang is cut off after 10 s and fails); every fragment (with {tmp} the test's folder) must be in the message."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO

import data
import embedded
import model as model_py
from model import LLaDA, LLaDAConfig

SIZES = dict(d_model=8, n_heads=2, n_kv_heads=2, n_layers=2, mlp_hidden_size=16)  # a 2-layer model


def tiny_folder(tmp, family="llada"):
    """A model folder (config.json, model.safetensors, tokenizer.json) of a 2-layer char-level LLaDA or Dream."""
    tokenizer = embedded.make_char_tokenizer(family=family)
    LLaDA(embedded.tiny_config_for(tokenizer, **SIZES)).init_weights(torch.Generator().manual_seed(0)).save_pretrained(
        tmp / "model")
    tokenizer.save(str(tmp / "model" / "tokenizer.json"))
    return tmp / "model"


def lying_folder(tmp, family="llada", **fields):
    """A tiny folder whose config.json has `fields` set as written (config.json's own names, any JSON value)."""
    folder = tiny_folder(tmp, family)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, **fields}, indent=2))
    return folder


def at_once(call, limit=1.0):
    """call(), which must raise within `limit` seconds; still running after 10 s (building 10^6 blocks), it is stopped
    with a TimeoutError, which fails the row."""
    def stop(*_):
        raise TimeoutError("still running after 10 s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 10)
    start = time.perf_counter()
    try:
        call()
    except (ValueError, OSError) as e:
        took = time.perf_counter() - start
        if took > limit and not isinstance(e, TimeoutError):
            raise AssertionError(f"refused after {took:.2f} s, not at once: {e}") from None
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def load(folder):
    """from_pretrained, what LoRA runs, sample.py and eval.py call."""
    return at_once(lambda: LLaDA.from_pretrained(folder))


def check(folder):
    """check_config_against_weights, what gift.py's full fine-tuning calls before building on the meta device."""
    config = LLaDAConfig.from_json(folder / "config.json")
    return at_once(lambda: model_py.check_config_against_weights(folder, config))


def read_config(folder):
    return at_once(lambda: LLaDAConfig.from_json(folder / "config.json"))


def data_file(tmp, content, name="data.jsonl"):
    """A data file of `content`: bytes as written, or a str encoded as UTF-8."""
    path = tmp / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def read_data(path, **kwargs):
    return at_once(lambda: data.load_dataset(path, embedded.make_char_tokenizer(), **kwargs))


def fifo(tmp):
    os.mkfifo(tmp / "pipe.jsonl")
    return tmp / "pipe.jsonl"


GOOD = json.dumps({"prompt": "say hi", "response": "hi"})
DEEP = '{"prompt": "say hi", "response": ' + "[" * 100_000 + "]" * 100_000 + "}"  # a RecursionError in json.loads
CONFIG = "{tmp}/model/config.json"
DIGIT = embedded.CHAR_VOCAB.index("3")  # an ordinary token of the char tokenizers

CASES = [
    # 9. a config.json that does not describe its weights: refused from the safetensors headers, nothing built
    ("config_n_layers_huge_from_pretrained", lambda t: load(lying_folder(t, n_layers=10**6)),
     ValueError, [CONFIG, "'n_layers' = 1000000", "2 blocks"]),
    ("config_d_model_huge_from_pretrained", lambda t: load(lying_folder(t, d_model=10**9)),
     ValueError, [CONFIG, "'d_model' = 1000000000", "model.transformer.wte.weight of shape (56, 8)"]),
    ("config_n_layers_huge_check", lambda t: check(lying_folder(t, n_layers=10**6)),
     ValueError, [CONFIG, "'n_layers' = 1000000"]),
    ("config_d_model_huge_check", lambda t: check(lying_folder(t, d_model=10**9)),
     ValueError, [CONFIG, "'d_model' = 1000000000"]),
    ("config_too_few_layers_check", lambda t: check(lying_folder(t, n_layers=1)),
     ValueError, [CONFIG, "'n_layers' = 1", "2 blocks"]),
    ("config_mlp_check", lambda t: check(lying_folder(t, mlp_hidden_size=32)),
     ValueError, [CONFIG, "'mlp_hidden_size' = 32", "ff_proj.weight of shape (16, 8)"]),
    ("dream_layers_huge_from_pretrained", lambda t: load(lying_folder(t, "dream", num_hidden_layers=10**6)),
     ValueError, [CONFIG, "'num_hidden_layers' = 1000000", "2 blocks, model.layers.0"]),
    ("dream_width_huge_from_pretrained", lambda t: load(lying_folder(t, "dream", hidden_size=10**9)),
     ValueError, [CONFIG, "'hidden_size' = 1000000000", "model.embed_tokens.weight"]),
    ("dream_mlp_check", lambda t: check(lying_folder(t, "dream", intermediate_size=48)),
     ValueError, [CONFIG, "'intermediate_size' = 48", "model.layers.0.mlp.gate_proj.weight"]),
    # 13. values that make every loss NaN: RoPE's base, RMSNorm's epsilon
    ("config_rope_theta_zero", lambda t: read_config(lying_folder(t, rope_theta=0)),
     ValueError, [CONFIG, "'rope_theta' = 0", "greater than 1"]),
    ("config_rope_theta_negative", lambda t: read_config(lying_folder(t, rope_theta=-10000.0)),
     ValueError, [CONFIG, "'rope_theta' = -10000.0"]),
    ("config_rope_theta_nan", lambda t: read_config(lying_folder(t, rope_theta=float("nan"))),
     ValueError, [CONFIG, "'rope_theta' = NaN", "finite"]),
    ("config_rope_theta_inf_from_pretrained", lambda t: load(lying_folder(t, rope_theta=float("inf"))),
     ValueError, [CONFIG, "'rope_theta' = Infinity"]),
    ("config_rms_norm_eps_negative", lambda t: read_config(lying_folder(t, rms_norm_eps=-1)),
     ValueError, [CONFIG, "'rms_norm_eps' = -1", "positive"]),
    ("config_rms_norm_eps_zero", lambda t: read_config(lying_folder(t, rms_norm_eps=0.0)),
     ValueError, [CONFIG, "'rms_norm_eps' = 0.0"]),
    ("config_rms_norm_eps_nan", lambda t: read_config(lying_folder(t, rms_norm_eps=float("nan"))),
     ValueError, [CONFIG, "'rms_norm_eps' = NaN"]),
    ("config_rms_norm_eps_underflows_float32", lambda t: read_config(lying_folder(t, rms_norm_eps=1e-50)),
     ValueError, [CONFIG, "'rms_norm_eps' = 1e-50", "float32"]),
    ("dream_rope_theta_zero", lambda t: read_config(lying_folder(t, "dream", rope_theta=0)),
     ValueError, [CONFIG, "'rope_theta' = 0"]),
    ("dream_rms_norm_eps_inf_from_pretrained", lambda t: load(lying_folder(t, "dream", rms_norm_eps=float("inf"))),
     ValueError, [CONFIG, "'rms_norm_eps' = Infinity"]),
    # 10. data files that are not UTF-8 JSONL with LF lines, or not files at all
    ("data_utf16_without_bom", lambda t: read_data(data_file(t, (GOOD + "\n" + GOOD + "\n").encode("utf-16-le"))),
     ValueError, ["{tmp}/data.jsonl", "not UTF-8", "looks like UTF-16 (every other byte is 0)", "iconv -f UTF-16LE"]),
    ("data_utf16_big_endian_skip_bad_rows", lambda t: read_data(
        data_file(t, (GOOD + "\n").encode("utf-16-be")), skip_bad_rows=True),
     ValueError, ["{tmp}/data.jsonl", "looks like UTF-16", "UTF-16BE"]),
    ("data_utf16_with_bom", lambda t: read_data(data_file(t, (GOOD + "\n").encode("utf-16"))),
     ValueError, ["{tmp}/data.jsonl", "UTF-16 byte order mark"]),
    ("data_utf32", lambda t: read_data(data_file(t, (GOOD + "\n").encode("utf-32-le"))),
     ValueError, ["{tmp}/data.jsonl", "looks like UTF-32"]),
    ("data_cr_only_lines", lambda t: read_data(data_file(t, GOOD + "\r" + GOOD + "\r")),
     ValueError, ["{tmp}/data.jsonl", "lines end in CR only"]),
    ("data_cr_only_lines_skip_bad_rows", lambda t: read_data(data_file(t, GOOD + "\r" + GOOD + "\r" + GOOD),
                                                             skip_bad_rows=True),
     ValueError, ["{tmp}/data.jsonl", "lines end in CR only"]),
    ("data_nested_100000_deep", lambda t: read_data(data_file(t, GOOD + "\n" + DEEP + "\n")),
     data.DataError, ["{tmp}/data.jsonl, line 2", "nested too deeply", "--skip-bad-rows"]),
    ("data_fifo", lambda t: read_data(fifo(t)),
     ValueError, ["{tmp}/pipe.jsonl", "not a regular file", "FIFO"]),
    ("data_dev_zero", lambda t: read_data("/dev/zero"),
     ValueError, ["/dev/zero", "not a regular file", "character device"]),
    ("data_a_folder", lambda t: read_data(t),
     ValueError, ["{tmp}", "not a regular file", "a directory"]),
    # what neither family computes is refused alike (model.TURNED_OFF): Dream's were, LLaDA's were read and ignored
    ("llada_rope_scaling", lambda t: read_config(lying_folder(t, rope_scaling={"rope_type": "linear", "factor": 2.0})),
     ValueError, [CONFIG, "field 'rope_scaling' = {{'rope_type': 'linear', 'factor': 2.0}}", "LLaDA-8B"]),
    ("llada_sliding_window", lambda t: read_config(lying_folder(t, sliding_window=512)),
     ValueError, [CONFIG, "field 'sliding_window' = 512", "sliding_window = None"]),
    ("llada_use_sliding_window", lambda t: read_config(lying_folder(t, use_sliding_window=True, sliding_window=512)),
     ValueError, [CONFIG, "field 'use_sliding_window' = True", "use_sliding_window = False"]),
    ("dream_sliding_window_without_its_flag", lambda t: read_config(lying_folder(t, "dream", sliding_window=512)),
     ValueError, [CONFIG, "field 'sliding_window' = 512", "Dream-v0"]),
    # an EOS the tokenizer reads as an ordinary token (a digit: every 3 would end a generation)
    ("eos_id_an_ordinary_token", lambda t: at_once(lambda: data.check_mask_token(
        embedded.make_char_tokenizer(), LLaDAConfig.from_json(lying_folder(t, eos_token_id=DIGIT) / "config.json"))),
     ValueError, [f"config.json field 'eos_token_id' = {DIGIT}", "ordinary token '3'", "'<|endoftext|>'"]),
    ("eos_id_an_ordinary_token_dream", lambda t: at_once(lambda: data.check_mask_token(
        embedded.make_char_tokenizer(family="dream"), LLaDAConfig.from_json(
            lying_folder(t, "dream", eos_token_id=DIGIT) / "config.json"))),
     ValueError, [f"config.json field 'eos_token_id' = {DIGIT}", "ordinary token '3'"]),
]


@pytest.mark.parametrize("setup, error, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_at_once_with_its_name(tmp_path, setup, error, fragments):
    with pytest.raises(error) as info:
        setup(tmp_path)
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment.format(tmp=tmp_path) in message, message


def test_what_neither_family_computes_turned_off_is_read(tmp_path):
    """The refusals above are of values that ask for RoPE scaling or a window: Qwen2's sliding_window under
    use_sliding_window false (Dream-v0's own config.json), and null fields, load."""
    read_config(lying_folder(tmp_path / "d", "dream", use_sliding_window=False, sliding_window=4096))
    read_config(lying_folder(tmp_path / "l", rope_scaling=None, sliding_window=None))
    read_config(lying_folder(tmp_path / "f", use_sliding_window=False, sliding_window=512))


# each (a model folder's file made a FIFO, the folder it is in, the read that meets it): one process runs them all
FIFO_READS = [("tokenizer.json", "llada", "load_tokenizer"), ("vocab.json", "dream", "load_tokenizer"),
              ("merges.txt", "dream", "load_tokenizer"), ("tokenizer_config.json", "dream", "load_tokenizer"),
              ("added_tokens.json", "dream_old", "load_tokenizer"), ("model.safetensors", "llada", "from_pretrained"),
              ("model.safetensors.index.json", "sharded", "from_pretrained"),
              ("generation_defaults.json", "llada", "generation_defaults")]


def fifo_folder(tmp, name, kind):
    """A model folder of `kind` whose file `name` is a FIFO no one writes to."""
    if kind == "llada":
        folder = tiny_folder(tmp)
    elif kind == "sharded":
        folder = tmp / "model"
        LLaDA(embedded.tiny_config_for(embedded.make_char_tokenizer(), **SIZES)).save_pretrained(folder, 2000)
    else:  # Dream's slow tokenizer files; "dream_old": without tokenizer_config.json's added_tokens_decoder
        folder = shutil.copytree(REPO / "tests" / "data" / "dream_tokenizer", tmp / "model")
        if kind == "dream_old":  # the older layout, whose added tokens are added_tokens.json's
            config = json.loads((folder / "tokenizer_config.json").read_text())
            del config["added_tokens_decoder"]
            (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / name).unlink(missing_ok=True)
    os.mkfifo(folder / name)
    return folder


def test_a_model_folders_file_that_is_a_fifo_is_refused_not_read(tmp_path):
    """Every read of a model folder's files refuses a FIFO in one line naming it (model.open_regular), where before
    safe_open and the index's read blocked, a FIFO tokenizer_config.json, added_tokens.json or generation_defaults.json
    was read as none, a tokenizer.json, vocab.json or merges.txt as missing. One process of its own runs every read
    (a blocked one cannot hang the suite)."""
    calls = [(str(fifo_folder(tmp_path / str(i), name, kind)), read) for i, (name, kind, read) in enumerate(FIFO_READS)]
    script = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import data, model\n"
              "reads = dict(load_tokenizer=data.load_tokenizer, from_pretrained=model.LLaDA.from_pretrained, "
              "generation_defaults=model.generation_defaults)\n"
              f"for folder, read in {calls!r}:\n"
              "    try:\n        reads[read](folder)\n        print('read, not refused')\n"
              "    except (ValueError, OSError) as e:\n        print(type(e).__name__, repr(str(e)))\n")
    try:
        done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        pytest.fail("a read blocked on its FIFO for 120 s")
    said = done.stdout.splitlines()
    assert done.returncode == 0 and len(said) == len(FIFO_READS), done.stdout + done.stderr
    for (folder, _), (name, _, _), line in zip(calls, FIFO_READS, said):
        assert line == "ValueError " + repr(f"{folder}/{name}: not a regular file but a named pipe (FIFO): not read")


def test_a_deep_row_is_skipped_and_counted(tmp_path):
    path = data_file(tmp_path, GOOD + "\n" + DEEP + "\n" + GOOD + "\n")
    examples, stats = data.load_dataset(path, embedded.make_char_tokenizer(), skip_bad_rows=True)
    assert len(examples) == 2 and stats["rows"] == 3 and stats["skipped_bad_rows"] == 1
    assert stats["bad_rows"][0].startswith(f"{path}, line 2: nested too deeply")


class NoLongTexts:
    """A tokenizer that refuses to tokenize a text of more than 100,000 characters (the real one would spend ~8 GB
    on 20 MB): every other call goes to the tokenizer it wraps."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode_batch(self, texts, **kwargs):
        assert max(map(len, texts)) <= 100_000, "a text that cannot fit max_len tokens was tokenized"
        return self.tokenizer.encode_batch(texts, **kwargs)

    def encode(self, text, **kwargs):
        assert len(text) <= 100_000, "a text that cannot fit max_len tokens was tokenized"
        return self.tokenizer.encode(text, **kwargs)


def test_a_20mb_line_is_dropped_before_tokenizing(tmp_path):
    """A 20 MB answer cannot fit max_len tokens of a tokenizer whose longest token has 19 characters: dropped and
    counted as too long without being tokenized; the rows around it load as before."""
    huge = json.dumps({"prompt": "say hi", "response": "a" * 20_000_000})
    path = data_file(tmp_path, GOOD + "\n" + huge + "\n" + GOOD + "\n")
    tokenizer = embedded.make_char_tokenizer()
    examples, stats = data.load_dataset(path, NoLongTexts(tokenizer), max_len=64)
    assert stats["rows"] == 3 and stats["dropped_too_long"] == 1 and stats["examples"] == 2
    expected, _ = data.load_dataset(data_file(tmp_path, GOOD + "\n" + GOOD + "\n", "good.jsonl"), tokenizer, max_len=64)
    assert [(ids.tolist(), p) for ids, p in examples] == [(ids.tolist(), p) for ids, p in expected]


def test_an_endless_line_is_dropped_unread(tmp_path, monkeypatch):
    """A line longer than the byte bound (MAX_LINE_BYTES, here lowered, or 64 x the characters max_len tokens can
    hold) is skipped unread, counted as too long; the next line is read."""
    monkeypatch.setattr(data, "MAX_LINE_BYTES", 0)  # the bound becomes 64 x 64 tokens x 19 characters = 77,824 bytes
    path = data_file(tmp_path, GOOD + "\n" + "x" * 200_000 + "\n" + GOOD)
    examples, stats = data.load_dataset(path, NoLongTexts(embedded.make_char_tokenizer()), max_len=64)
    assert stats["rows"] == 3 and stats["dropped_too_long"] == 1 and stats["skipped_bad_rows"] == 0
    assert len(examples) == 2


def test_the_char_bound_never_drops_a_row_that_fits():
    """max_token_chars bounds the characters of one token: every token of the char tokenizer's vocabulary, and
    max_len x it characters of text give more than max_len tokens only when the text is longer."""
    tokenizer = embedded.make_char_tokenizer()
    assert data.max_token_chars(tokenizer) == max(map(len, tokenizer.get_vocab())) == len(data.START_HEADER)
    text = data.START_HEADER * 10  # 10 tokens of the longest length: exactly max_len x max_token_chars characters
    assert len(data.encode(tokenizer, text)) == 10 and len(text) == 10 * data.max_token_chars(tokenizer)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_a_clean_folder_passes_and_loads_as_before(tmp_path, family):
    folder = tiny_folder(tmp_path, family)
    config = LLaDAConfig.from_json(folder / "config.json")
    assert model_py.check_config_against_weights(folder, config) == [folder / "model.safetensors"]
    loaded = LLaDA.from_pretrained(folder)
    saved = LLaDA(config).init_weights(torch.Generator().manual_seed(0))
    for k, v in saved.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
