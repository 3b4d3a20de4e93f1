"""The embedded task: what `python gift.py` runs with no --model. A tiny LLaDA is trained from scratch on 4x4 Sudoku
(in about 4 minutes on 2 CPU cores), then evaluated on held-out puzzles from solution grids it never saw. This file
holds all of it: its settings, the puzzles (every valid grid, puzzles with one solution, a seeded split by grid), the
character-level tokenizer and the tiny model's config (which tests, benches and experiments also build small models
with), the run's inputs (gift.py's load_inputs calls embedded_inputs), its evaluation and its results.json. The files
the run writes into --out are named here (REPLACED, EXPORTED) and handed to longjob.py, which never imports this file;
eval.py and sample.py are imported only when the task is evaluated (importing gift.py imports neither).

    python embedded.py     # show a Sudoku example of the embedded task
"""

import contextlib
import dataclasses
import functools
import json
import os
import re
import subprocess
import time
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from data import (BOS, CHAT_FORMATS, EOS, SUDOKU_TASK_PROMPT, _token_id, chat_format, data_fingerprint, encode_examples,
                  load_tokenizer, show_example, special_ids)
from longjob import REPLACED as RUN_REPLACED
from longjob import Export, barrier, is_rank0, json_or_empty, print0, rank_and_world, tensors_fingerprint
from model import GENERATION_DEFAULTS, LLaDA, LLaDAConfig, atomic_write_text, generation_defaults

# -----------------------------------------------------------------------------
# Settings: the puzzles, the tokenizer and the model, the training run, the generation

# what `python gift.py` trains on with no --model (a tiny LLaDA learns 4x4 Sudoku): training puzzles; the held-out
# ones (gift.py --eval-puzzles, 8 blanks as d1's) come from `test_grids` of the 288 solution grids, never trained on
EMBEDDED_PUZZLES = dict(n_train=19200, n_blanks=(2, 8), test_grids=32)  # 300 steps of 64 per epoch
# the answer to d1's question (data.SUDOKU_TASK_PROMPT, kept short for a tiny model on a CPU), then <|eot_id|>
SUDOKU_ANSWER = "<answer>{solution}</answer>"
# the 12 units (4 rows, 4 columns, 4 boxes) of a 4x4 grid, as row-major cell indices 0..15
SUDOKU_UNITS = ([[4 * r + c for c in range(4)] for r in range(4)]
                + [[4 * r + c for r in range(4)] for c in range(4)]
                + [[4 * (br + r) + bc + c for r in range(2) for c in range(2)] for br in (0, 2) for bc in (0, 2)])

# characters of the char-level tokenizer: enough for the Sudoku texts, answer tags and the role names
CHAR_VOCAB = "\n :/<>0123456789Sabcdefghijklmnopqrstuvwxyz"
DREAM_CHAR_VOCAB = CHAR_VOCAB + "Y."  # and ChatML's default system turn, "You are a helpful assistant."
FAMILY_CHAT_FORMAT = {"llada": "llada", "dream": "chatml"}  # make_char_tokenizer's `family`; another name: "llada"
# by chat format (data.CHAT_FORMATS' keys): make_char_tokenizer's default characters, and tiny_config_for's LLaDAConfig
# fields (model.py's config reads the family from model_type)
CHARS = dict(llada=CHAR_VOCAB, chatml=DREAM_CHAR_VOCAB)
TINY_MODEL = dict(llada={}, chatml=dict(model_type="Dream", include_qkv_bias=True, rope_theta=1e6, rms_norm_eps=1e-6))
# the embedded run's model (tiny_config_for's model_sizes): 0.17M parameters
EMBEDDED_MODEL = dict(d_model=64, n_heads=4, n_kv_heads=4, n_layers=3, mlp_hidden_size=192, max_sequence_length=256)
# and what LLaDA-8B's config.json says for transformers: its family and its modeling files (configuration_llada.py,
# modeling_llada.py, which the official evaluation code adds), so that AutoConfig / AutoModel open an export as LLaDA's
LLADA_HF_CONFIG = dict(model_type="llada", extra=dict(architectures=["LLaDAModelLM"], auto_map={
    "AutoConfig": "configuration_llada.LLaDAConfig", "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
    "AutoModel": "modeling_llada.LLaDAModelLM"}))
# LLaDA's chat template (data.chat_prompt) in Jinja, as its tokenizer_config.json holds it for apply_chat_template
LLADA_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>"
                       "\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
                       "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}")

# gift.py's options with no --model (TrainOptions fields; one given on the command line wins): a tiny model trained
# from scratch on the 2-core CPU in about 4 minutes. A sweep over seeds (experiments/embedded_sweep/) chose lr 1e-3 and
# batch 64: 94-100% held-out cells in every seed (lr 2e-3 or batch 32 stalled in some).
EMBEDDED = dict(out="runs/sudoku-tiny", loss="gift", epochs=5, grad_accum=1, lr=1e-3,
                schedule="cosine", warmup_steps=50, weight_decay=0.0, log_every=100)
EMBEDDED_GLOBAL_BATCH = 64  # split over the processes, so `python gift.py` and torchrun compute the same run

# the answer "<answer>{16 digits}</answer><|eot_id|>" is 34 tokens: generate exactly that, one token per step. Saved
# in every exported model folder (generation_defaults.json), with the held-out puzzles, for sample.py and eval.py
EMBEDDED_EVAL = dict(task="sudoku", prompt_style="plain", gen_length=34, block_length=34, steps=34,
                     test_data="sudoku_heldout.csv")

# -----------------------------------------------------------------------------
# The puzzles (grids are 16-character strings, row-major, "0" = blank)


@functools.cache
def sudoku_grids():
    """All 288 valid 4x4 grids, in lexicographic order (depth-first fill, cells row-major, digits ascending)."""
    # for each cell, the earlier cells that share a unit with it
    earlier_peers = [sorted({j for unit in SUDOKU_UNITS if i in unit for j in unit if j < i}) for i in range(16)]

    def fill(cells):  # the valid grids that start with `cells`
        i = len(cells)
        if i == 16:
            return [cells]
        return [grid for digit in "1234" if all(cells[j] != digit for j in earlier_peers[i])
                for grid in fill(cells + digit)]

    return tuple(fill(""))


def sudoku_solutions(puzzle):
    """The valid grids that agree with the puzzle's given (non-zero) cells."""
    if not re.fullmatch("[0-4]{16}", puzzle):
        raise ValueError(f"a puzzle is 16 digits 0-4 (0 = blank), got {puzzle!r}")
    pattern = re.compile(puzzle.replace("0", "."))
    return [grid for grid in sudoku_grids() if pattern.fullmatch(grid)]


def make_puzzle(grid, n_blanks, generator, unique=True, max_tries=1000):
    """Blank n_blanks random cells of a solved grid; with unique=True redraw until only `grid` solves it
    (so the target answer is the only right one)."""
    for _ in range(max_tries):
        blanks = set(torch.randperm(16, generator=generator)[:n_blanks].tolist())
        puzzle = "".join("0" if i in blanks else digit for i, digit in enumerate(grid))
        if not unique or len(sudoku_solutions(puzzle)) == 1:
            return puzzle
    raise ValueError(f"no puzzle with {n_blanks} blanks and a unique solution found for {grid} in {max_tries} "
                     "draws; use fewer blanks or unique=False")


def sudoku_split(n_train, n_test, n_blanks=8, seed=0, test_grids=0, unique=True):
    """A seeded train / held-out split of distinct puzzles, no puzzle in both: (train, test), lists of (puzzle,
    solution). n_blanks is an int or an inclusive (low, high) range drawn per puzzle. test_grids > 0 holds out that
    many whole solution grids: test puzzles come only from them and train puzzles never do (a split by grid); 0 splits
    by puzzle (a test puzzle's grid may appear in training under other blanks). The test set is drawn first, so it
    does not change with n_train."""
    generator = torch.Generator().manual_seed(seed)
    grids = sudoku_grids()
    if not 0 <= test_grids < len(grids):
        raise ValueError(f"test_grids must be in [0, {len(grids)}), got {test_grids}")
    order = torch.randperm(len(grids), generator=generator).tolist()
    test_pool = [grids[i] for i in order[:test_grids]] if test_grids else grids
    train_pool = [grids[i] for i in order[test_grids:]]
    low, high = (n_blanks, n_blanks) if isinstance(n_blanks, int) else n_blanks
    taken = set()  # every puzzle drawn so far, train and test

    def draw(pool, n):
        out, tries = [], 10 * n + 1000  # bounded: a request larger than the pool of puzzles fails, not hangs
        while len(out) < n and tries:
            tries -= 1
            grid = pool[torch.randint(len(pool), (1,), generator=generator).item()]
            k = torch.randint(low, high + 1, (1,), generator=generator).item()
            puzzle = make_puzzle(grid, k, generator, unique)
            if puzzle not in taken:
                taken.add(puzzle)
                out.append((puzzle, grid))
        if len(out) < n:
            raise ValueError(f"could not draw {n} distinct puzzles from {len(pool)} grids with {n_blanks} blanks")
        return out

    test = draw(test_pool, n_test)
    return draw(train_pool, n_train), test


def sudoku_messages(puzzle):
    """The user turn asking for a puzzle (d1's question text, without its instruction string)."""
    return [{"role": "user", "content": SUDOKU_TASK_PROMPT.format(puzzle=puzzle)}]


def sudoku_examples(tokenizer, pairs):
    """[(puzzle, solution)] -> training examples [(ids, prompt_len)]."""
    return encode_examples(tokenizer, [(sudoku_messages(p), SUDOKU_ANSWER.format(solution=s)) for p, s in pairs])


# -----------------------------------------------------------------------------
# The character-level tokenizer and the tiny model's config


def make_char_tokenizer(chars=None, family="llada"):
    """A character-level tokenizer for the embedded task: one token per character of `chars` (ids 0..), then the
    family's chat format's special tokens (FAMILY_CHAT_FORMAT: "dream" is ChatML's) as added tokens, matched in text.
    Save it with `tokenizer.save(str(folder / "tokenizer.json"))`; data.load_tokenizer reads it back. Encoding a
    character outside `chars` raises (WordLevel has no unknown token)."""
    name = FAMILY_CHAT_FORMAT.get(family, "llada")
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars or CHARS[name])}))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char alone
    tokenizer.decoder = decoders.Fuse()  # decode joins the characters back without spaces
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_FORMATS[name].specials])
    return tokenizer


def tokenizer_config(tokenizer):
    """The embedded model's tokenizer_config.json for its char tokenizer, in LLaDA-8B-Instruct's fields (the added
    tokens, BOS, EOS = pad, the chat template, a fast tokenizer's class): transformers' AutoTokenizer then reads
    tokenizer.json as it reads LLaDA's; model_max_length is the embedded model's context."""
    added = {str(i): {k: getattr(t, k) for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
             for i, t in sorted(tokenizer.get_added_tokens_decoder().items())}
    return dict(add_bos_token=False, add_eos_token=False, added_tokens_decoder=added, bos_token=BOS,
                chat_template=LLADA_CHAT_TEMPLATE, clean_up_tokenization_spaces=False, eos_token=EOS,
                model_input_names=["input_ids", "attention_mask"],
                model_max_length=EMBEDDED_MODEL["max_sequence_length"], pad_token=EOS,
                tokenizer_class="PreTrainedTokenizerFast")


def tiny_config_for(tokenizer, **model_sizes):
    """An LLaDAConfig for a tokenizer with LLaDA's special tokens (make_char_tokenizer()), or Dream's (a ChatML one: a
    Dream-v0 config, TINY_MODEL): mask and eos = pad ids from it, vocab_size = embedding_size = its size rounded up
    to a multiple of 8. model_sizes are LLaDAConfig fields (d_model, n_heads, n_layers, ...)."""
    name = chat_format(tokenizer)
    vocab = -(-tokenizer.get_vocab_size(with_added_tokens=True) // 8) * 8
    eos = _token_id(tokenizer, EOS)
    mask = _token_id(tokenizer, CHAT_FORMATS[name].mask)
    return LLaDAConfig(vocab_size=vocab, embedding_size=vocab, mask_token_id=mask, eos_token_id=eos, pad_token_id=eos,
                       **(TINY_MODEL[name] | model_sizes))


# -----------------------------------------------------------------------------
# The run's inputs: its options, data, model and the files it writes into --out


def apply_defaults(opts, given):
    """gift.py's options with no --model: EMBEDDED's for each not `given` on the command line, and --batch-size
    EMBEDDED_GLOBAL_BATCH split over the processes."""
    for k, v in EMBEDDED.items():
        if k not in given:
            setattr(opts, k, v)
    if "batch_size" not in given:
        opts.batch_size = max(1, EMBEDDED_GLOBAL_BATCH // int(os.environ.get("WORLD_SIZE", 1)))


def embedded_task(seed, eval_puzzles):
    """The embedded task's data: make_char_tokenizer(), training examples, and `eval_puzzles` held-out (puzzle,
    solution) pairs from solution grids no training puzzle comes from (one seed, one grid split, in both calls)."""
    tokenizer = make_char_tokenizer()
    n_train, n_blanks, test_grids = (EMBEDDED_PUZZLES[k] for k in ("n_train", "n_blanks", "test_grids"))
    train_pairs, _ = sudoku_split(n_train, 0, n_blanks, seed=seed, test_grids=test_grids)
    _, heldout = sudoku_split(0, eval_puzzles, 8, seed=seed, test_grids=test_grids)
    return tokenizer, sudoku_examples(tokenizer, train_pairs), heldout


def describe_embedded(heldout, heldout_file):
    """The embedded task's data in words (gift.py prints it at start-up)."""
    low, high = EMBEDDED_PUZZLES["n_blanks"]
    return (f"data: {EMBEDDED_PUZZLES['n_train']:,} 4x4 Sudoku puzzles with {low}-{high} blanks for training; "
            f"{len(heldout)} held-out puzzles with 8 blanks from {EMBEDDED_PUZZLES['test_grids']} of the 288 solution "
            f"grids, never seen in training ({heldout_file})")


def embedded_inputs(opts, rank, dtype, export_dtype):
    """The fields of gift.py's RunInputs for the embedded task: a tiny LLaDA initialised from the seed and its Sudoku
    puzzles. Its tokenizer, generation settings and held-out puzzles are written into --out, then into every exported
    model folder (in `export_dtype`), with tokenizer_config.json and config.json's fields for transformers' loaders."""
    out = Path(opts.out)
    files = [out / "tokenizer.json", out / GENERATION_DEFAULTS, out / EMBEDDED_EVAL["test_data"],
             out / "tokenizer_config.json"]
    tokenizer, examples, heldout = embedded_task(opts.seed, opts.eval_puzzles)
    config = tiny_config_for(tokenizer, **EMBEDDED_MODEL, **LLADA_HF_CONFIG)
    pad_id, data = special_ids(tokenizer, config).pad, dict(data=data_fingerprint(examples), examples=len(examples))
    description = describe_embedded(heldout, files[2])
    model = LLaDA(config).init_weights(torch.Generator().manual_seed(opts.seed))
    if rank == 0:
        tokenizer.save(str(files[0]))
        atomic_write_text(files[1], json.dumps(EMBEDDED_EVAL, indent=1) + "\n")
        atomic_write_text(files[2], "Puzzle,Solution\n" + "".join(f"{p},{s}\n" for p, s in heldout))
        atomic_write_text(files[3], json.dumps(tokenizer_config(tokenizer), indent=2) + "\n")
    fingerprints = dict(data, model=tensors_fingerprint(model))
    barrier()
    print0(description)
    export = Export(dtype=export_dtype, files=files, base_name="embedded")
    resolved = dict(dtype=str(dtype).removeprefix("torch."), data_format="auto")
    return dict(model=model, tokenizer=tokenizer, examples=examples, pad_id=pad_id, fingerprints=fingerprints,
                export=export, heldout=heldout, resolved=resolved)


# the files an exported model folder holds besides the base folder's usual ones (longjob.EXPORTED): gift.py copies
# them from a --model folder too, so that a model fine-tuned from this one still carries its held-out puzzles
EXPORTED = (EMBEDDED_EVAL["test_data"],)


def _embedded_heldout(path):  # embedded_inputs': a header and (puzzle, solution) rows
    with contextlib.suppress(OSError, UnicodeDecodeError):
        return re.fullmatch(r"Puzzle,Solution\n([0-4]{16},[1-4]{16}\n)*", path.read_text()) is not None
    return False


# the files the embedded run writes into --out besides a run's own, each with the test that tells its own from a
# user's (longjob.claim_output_folder refuses to replace a user's): gift.py hands it to longjob.run_folder
REPLACED = RUN_REPLACED | {
    "results.json": lambda path: {"heldout", "train_seconds", "options"} <= json_or_empty(path).keys(),
    "tokenizer.json": lambda path: json_or_empty(path) == json.loads(make_char_tokenizer().to_str()),
    GENERATION_DEFAULTS: lambda path: json_or_empty(path) == EMBEDDED_EVAL,
    "tokenizer_config.json": lambda path: json_or_empty(path) == tokenizer_config(make_char_tokenizer()),
    EMBEDDED_EVAL["test_data"]: _embedded_heldout}


# -----------------------------------------------------------------------------
# Its evaluation and results


def evaluate_embedded(heldout, checkpoint, seed, device):
    """Held-out Sudoku accuracy (d1's cells among the blanks) of gift.py's embedded-task checkpoint folder and, for
    scale, of the same architecture untrained (from `seed`), sampled as its generation_defaults.json says; heldout:
    (puzzle, solution) pairs. Rank 0 prints a line each and returns {"untrained": ..., "trained": ...}, others {}."""
    from eval import SUDOKU_QUESTION, evaluate  # here, not at the top: importing gift.py imports no evaluation
    from sample import SamplerOptions

    folder = Path(checkpoint) / "model"
    items = [dict(question=SUDOKU_QUESTION.format(puzzle=p), puzzle=p, solution=s) for p, s in heldout]
    trained = LLaDA.from_pretrained(folder, device=device)
    tokenizer = load_tokenizer(folder)
    untrained = LLaDA(trained.config).init_weights(torch.Generator().manual_seed(seed)).to(device)
    defaults = generation_defaults(folder)  # the embedded task's: plain prompts, one 34-token block in 34 steps
    options = SamplerOptions(**{k: defaults[k] for k in ("gen_length", "steps", "block_length")})
    results = {}
    for name, model in (("untrained", untrained), ("trained", trained)):
        t0 = time.time()
        acc, records = evaluate(model, tokenizer, items, "sudoku", options, batch_size=64,
                                prompt_style=defaults["prompt_style"])
        if records is not None:  # rank 0
            solved = 100 * sum(r["correct_cells"] == r["empty_cells"] for r in records) / len(records)
            results[name] = dict(cell_accuracy=round(acc, 2), puzzles_solved=round(solved, 2), puzzles=len(records))
            print(f"held-out Sudoku ({len(records)} puzzles, {name}): cell accuracy {acc:.1f}%, "
                  f"whole puzzles solved {solved:.1f}% ({time.time() - t0:.0f} s)", flush=True)
    return results


def write_results(out, opts, results, folder, train_s, total_s, puzzle):
    """<out>/results.json (accuracies, times, settings, commit), then the commands to chat with and evaluate it."""
    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, text=True,
                                capture_output=True, timeout=10).stdout.strip() or None
    atomic_write_text(out / "results.json", json.dumps(dict(
        heldout=results, model=str(folder), train_seconds=round(train_s, 1), total_seconds=round(total_s, 1),
        processes=rank_and_world()[1], commit=commit, options=dataclasses.asdict(opts)), indent=1) + "\n")
    print(f"results: {out / 'results.json'}\nmodel: {folder}\n"
          f"chat with it:  python sample.py --model {folder} --prompt \"{SUDOKU_TASK_PROMPT.format(puzzle=puzzle)}\"\n"
          f"evaluate it:   python eval.py --model {folder} --task sudoku", flush=True)


def evaluate_run(opts, heldout, checkpoint, device, train_s, t0):
    """gift.py's main after the embedded run has trained (every rank): evaluate_embedded on the held-out puzzles, then
    rank 0 writes results.json (write_results; total time from `t0`, time.time() at the start)."""
    results = evaluate_embedded(heldout, checkpoint, opts.seed, device)
    if is_rank0():
        write_results(Path(opts.out), opts, results, checkpoint / "model", train_s, time.time() - t0, heldout[0][0])


def main():
    """A Sudoku example of the embedded task as the model sees it: the prompt, then the answer."""
    tokenizer = make_char_tokenizer()
    train, _ = sudoku_split(n_train=4, n_test=4)
    show_example(tokenizer, sudoku_examples(tokenizer, train)[0])


if __name__ == "__main__":
    main()
