import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"  # golden vectors of the official LLaDA code and their tiny checkpoint (README.md)
DATA = REPO / "tests" / "data"  # the grader fixture: d1's generations with d1's verdicts, benchmark cuts (README.md)
FULL_DATA = os.environ.get("GIFT_DATA")  # the full data folder (d1_generations/, gsm8k_test.jsonl, ...), opt-in
sys.path.insert(0, str(REPO))  # the top-level files are plain modules, not a package
# model.file_sha256's on-disk cache (default ~/.cache/gift) in a folder of this session's, set before `model` is
# imported (it reads the variable then), and inherited by the command lines the tests start: nothing written outside
os.environ["GIFT_CACHE_DIR"] = tempfile.mkdtemp(prefix="gift-test-cache-")
atexit.register(shutil.rmtree, os.environ["GIFT_CACHE_DIR"], ignore_errors=True)


def shared_path(*parts):
    """A file the tests once read from ../shared, now in the repository: ("golden", ...) -> tests/golden/...,
    ("data", ...) -> tests/data/... A missing file is an error, not a skip."""
    roots = dict(golden=GOLDEN, data=DATA)
    if parts[0] not in roots:
        raise ValueError(f"shared_path{parts}: only 'golden' and 'data' files are kept in tests/")
    p = roots[parts[0]].joinpath(*parts[1:])
    if not p.exists():
        raise FileNotFoundError(f"{p} not found: it is part of the repository")
    return p


# -----------------------------------------------------------------------------
# Opt-in tests on the full data: marked full_data, they run when $GIFT_DATA names the data folder, e.g.
#     GIFT_DATA=/path/to/data python -m pytest -q tests
# and are deselected (not skipped) without it, so that a clean clone runs every test it collects.


def pytest_configure(config):
    config.addinivalue_line("markers", "full_data: needs the full benchmark data in the folder $GIFT_DATA names; "
                                       "deselected when GIFT_DATA is unset")
    config.addinivalue_line("markers", "numerics: float32 numbers compared with numbers computed elsewhere (goldens "
                                       "of the official code, another code path); .ci/run reruns them under other "
                                       "CPU kernels (-m numerics)")
    config.addinivalue_line("markers", "bf16: needs bfloat16 kernels (left out of the forced-kernel reruns, which "
                                       "lack some)")


# -----------------------------------------------------------------------------
# Tolerances for float32 numbers computed another way (the numerics tests)
#
# Two float32 computations of one quantity that differ in summation order (the official code, another CPU's kernels,
# the head over every position instead of the selected ones) each lie within gamma_n = n u of the exact value per
# inner product of length n, relative to sum_i |a_i b_i| (Higham, Accuracy and Stability of Numerical Algorithms,
# 2nd ed., eq. 3.5), u = 2^-24 being float32's unit roundoff. In these small random models sum_i |a_i b_i| is of the
# order of the output's largest magnitude, and a value passes through one such product per layer (the longest: the
# model width or the MLP's) plus the head's, so two computations differ by at most
#     atol = 2 * depth * u * max|x|,  depth = (n_layers + 1) * max(d_model, mlp_hidden_size)  (x2 for gradients).
# That is a worst case (errors of random sign grow like sqrt(n)): 10-20x what Intel and AMD kernels differ by, and
# still 100x below what a wrong mask, position, head or weight changes (each numerics test fails on such a bug).

U32 = 2.0 ** -24  # float32's unit roundoff


def model_depth(config):
    """The inner-product length a tiny model's output accumulates: (n_layers + 1) * max(d_model, mlp width)."""
    return (config.n_layers + 1) * max(config.d_model, config.mlp_hidden_size)


def float32_atol(reference, depth):
    """The absolute tolerance for two float32 computations of `reference` through `depth` accumulated products."""
    return 2 * depth * U32 * float(reference.detach().abs().max())


def assert_float32_close(actual, expected, depth):
    """actual and expected, float32 computations of one quantity, agree within float32_atol(expected, depth)."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=float32_atol(expected, depth))


def pytest_collection_modifyitems(config, items):
    if FULL_DATA:
        return
    deselected = [item for item in items if item.get_closest_marker("full_data")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("full_data")]


@pytest.fixture(scope="session")
def full_data():
    """The full data folder named by $GIFT_DATA (only full_data tests, which run only when it is set, use it)."""
    path = Path(FULL_DATA)
    if not (path / "d1_generations").is_dir():
        raise FileNotFoundError(f"GIFT_DATA={FULL_DATA}: no d1_generations/ folder there (the folder holding "
                                "d1_generations/, gsm8k_test.jsonl, math500_test.jsonl, ...)")
    return path


# -----------------------------------------------------------------------------
# Tiny models built in memory, without a tokenizer (tests/test_losses.py, tests/test_model.py, tests/test_bench.py,
# tests/test_memory_plan.py): the last id is the mask token, the one before it EOS = pad


def tiny_config(vocab=48, **fields):
    """An LLaDAConfig small enough for a test: vocab_size = embedding_size = `vocab`, mask id vocab - 1, EOS = pad
    id vocab - 2; `fields` (any LLaDAConfig field) override d_model 32, 4 heads, 4 kv heads, 2 layers, mlp 64."""
    from model import LLaDAConfig
    sizes = dict(d_model=32, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=64)
    return LLaDAConfig(**{**sizes, **fields}, vocab_size=vocab, embedding_size=vocab, mask_token_id=vocab - 1,
                       eos_token_id=vocab - 2, pad_token_id=vocab - 2)


def tiny_model(seed=0, std=0.02, **fields):
    """LLaDA(tiny_config(**fields)), its weights drawn from normal(0, std) by a generator seeded with `seed`."""
    from model import LLaDA
    return LLaDA(tiny_config(**fields)).init_weights(torch.Generator().manual_seed(seed), std=std)


# -----------------------------------------------------------------------------
# A tiny base model and data set for the training tests (tests/test_train.py, tests/test_resume.py)

ROWS = [("what is two plus three", "five"), ("name a color", "blue is a color"), ("count to four", "1 2 3 4"),
        ("say hi", "hi"), ("spell cat", "c a t"), ("is ten even", "yes: ten is even 10/2 is 5"),
        ("reverse abc", "cba"), ("largest of 3 9 4", "9"), ("what is 7 times 6", "42"),
        ("a word with q", "quiz"), ("first letter of zebra", "z"), ("sum 1 to 4", "1 2 3 4 sum to 10")]


def write_rows(path, rows):
    with open(path, "w") as f:
        for prompt, response in rows:
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    """A tiny LLaDA folder (config.json, model.safetensors, tokenizer.json) and a 12-row prompt/response JSONL.
    Initialised with std 0.2, so that its entropies (GIFT's betas) differ from token to token."""
    from embedded import make_char_tokenizer, tiny_config_for
    from model import LLaDA
    root = tmp_path_factory.mktemp("base")
    tokenizer = make_char_tokenizer()
    config = tiny_config_for(tokenizer, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=64)
    LLaDA(config).init_weights(torch.Generator().manual_seed(0), std=0.2).save_pretrained(root / "model")
    tokenizer.save(str(root / "model" / "tokenizer.json"))
    write_rows(root / "data.jsonl", ROWS)
    return root


def train_args(base, out, *extra, batch_size=2, data=None):
    """gift.py flags for a tiny run: 12 examples, global batch 4 on one process = 3 steps per epoch."""
    return ["--model", str(base / "model"), "--data", str(data or base / "data.jsonl"), "--out", str(out),
            "--lr", "3e-3", "--epochs", "2", "--batch-size", str(batch_size), "--grad-accum", "2", "--log-every", "1",
            "--lora-r", "4", "--lora-alpha", "8", "--lora-dropout", "0", "--warmup-steps", "1", *extra]


def latest(out):
    return out / "checkpoints" / (out / "latest").read_text().strip()


def metrics(out):
    """metrics.jsonl, parsed strictly (NaN or Infinity in it is an error: it is not JSON)."""
    def refuse(constant):
        raise ValueError(f"metrics.jsonl holds {constant}, which is not JSON")
    return [json.loads(line, parse_constant=refuse) for line in (out / "metrics.jsonl").read_text().splitlines()]


def final_weights(out, lora):
    from safetensors.torch import load_file
    return load_file(latest(out) / ("adapter/adapter_model.safetensors" if lora else "model/model.safetensors"))


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from threads, and on a busy shared CPU spinning threads slow them 10x."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# -----------------------------------------------------------------------------
# --device: where the device-capable tests run (tests/test_device.py); bench/gpu.py passes --device cuda


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="torch device of the device-capable tests (cpu, cuda, cuda:1)")


@pytest.fixture(scope="session")
def device(request):
    d = torch.device(request.config.getoption("--device"))
    if d.type == "cuda" and not torch.cuda.is_available():
        pytest.fail("--device cuda, but torch sees no CUDA device", pytrace=False)
    return d
