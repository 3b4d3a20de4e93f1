import itertools
import json
import string
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, models, processors

import data
import embedded
import longjob
from conftest import DATA

# a char tokenizer that can spell any printable text, with LLaDA's special tokens
PRINTABLE = "".join(dict.fromkeys(string.printable))


@pytest.fixture(scope="module")
def tok():
    return embedded.make_char_tokenizer(PRINTABLE)


def chars(tokenizer, text):
    """Ids of text spelled one character at a time, independent of tokenizer.encode."""
    return [tokenizer.token_to_id(c) for c in text]


def sid(tokenizer, token):
    return tokenizer.token_to_id(token)


def prompt_ids(tokenizer, messages):
    """The ids generation is given to answer `messages`: the chat prompt in the tokenizer's format, encoded."""
    return data.encode(tokenizer, data.chat_prompt(messages, data.chat_format(tokenizer)))


def example(tokenizer, messages, answer):
    """One training sequence (prompt + answer + <|eot_id|> ids, prompt length), as load_dataset builds it."""
    return data.encode_examples(tokenizer, [(messages, answer)])[0]


def write_jsonl(path, rows):
    """rows: dicts (dumped as JSON) or raw strings (written as they are)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# -----------------------------------------------------------------------------
# Tokenizer, special ids, chat format


def test_chat_prompt_text():
    messages = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "\nHi\n"}]
    assert data.chat_prompt(messages) == (
        "<|startoftext|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_prompt_tokens_exact(tok):
    ids = prompt_ids(tok, [{"role": "user", "content": "Add 2 and 3."}])
    bos, sh, eh, eot = (sid(tok, t) for t in (data.BOS, data.START_HEADER, data.END_HEADER, data.EOT))
    assert ids == ([bos, sh] + chars(tok, "user") + [eh] + chars(tok, "\n\nAdd 2 and 3.") + [eot]
                   + [sh] + chars(tok, "assistant") + [eh] + chars(tok, "\n\n"))


def test_training_pair_tokens_prompt_len_and_answer_mask(tok):
    messages = [{"role": "user", "content": "Q?"}]
    ids, prompt_len = example(tok, messages, " A1 \n")
    prompt = prompt_ids(tok, messages)
    answer = chars(tok, "A1") + [sid(tok, data.EOT)]  # stripped answer, then <|eot_id|>, no stray header
    assert ids == prompt + answer and prompt_len == len(prompt)
    # batched with a longer example: pads are <|endoftext|> and belong to the answer
    eos = sid(tok, data.EOS)
    other = example(tok, messages, "A much longer answer")
    input_ids, answer_mask = data.collate([(ids, prompt_len), other], pad_id=eos)
    L = len(other[0])
    assert input_ids.shape == (2, L) and input_ids.dtype == torch.long
    assert input_ids[0].tolist() == ids + [eos] * (L - len(ids))
    assert answer_mask[0].tolist() == [False] * prompt_len + [True] * (L - prompt_len)
    assert answer_mask[1].tolist() == [False] * other[1] + [True] * (L - other[1])


def test_multi_turn_trains_on_last_assistant_turn(tok):
    row = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
                        {"role": "assistant", "content": "a2"}]}
    prompt_messages, answer = data.parse_row(row, "messages")
    ids, prompt_len = example(tok, prompt_messages, answer)
    bos, sh, eh, eot = (sid(tok, t) for t in (data.BOS, data.START_HEADER, data.END_HEADER, data.EOT))

    def turn(role, content):
        return [sh] + chars(tok, role) + [eh] + chars(tok, "\n\n" + content) + [eot]

    prompt = [bos] + turn("system", "S") + turn("user", "u1") + turn("assistant", "a1") + turn("user", "u2")
    prompt += [sh] + chars(tok, "assistant") + [eh] + chars(tok, "\n\n")
    assert ids == prompt + chars(tok, "a2") + [eot]
    assert prompt_len == len(prompt)


def test_no_bos_or_eos_added_implicitly(tmp_path):
    # a tokenizer.json whose post-processor would add BOS / EOS around every encode
    tokenizer = embedded.make_char_tokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{data.BOS} $A {data.EOS}", special_tokens=[(t, sid(tokenizer, t)) for t in (data.BOS, data.EOS)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = data.load_tokenizer(tmp_path)
    assert data.encode(loaded, "ab") == chars(loaded, "ab")
    ids = prompt_ids(loaded, [{"role": "user", "content": "a"}])
    assert ids.count(sid(loaded, data.BOS)) == 1 and ids[0] == sid(loaded, data.BOS)
    assert sid(loaded, data.EOS) not in ids
    # special tokens written in text are matched as one token each
    assert data.encode(loaded, "1<|eot_id|>2") == [sid(loaded, "1"), sid(loaded, data.EOT), sid(loaded, "2")]


def test_load_tokenizer_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        data.load_tokenizer(tmp_path)


def test_special_ids(tok):
    config = SimpleNamespace(mask_token_id=7, eos_token_id=5, pad_token_id=6)  # from the config, not the tokenizer
    ids = data.special_ids(tok, config)
    assert (ids.mask, ids.eos, ids.pad) == (7, 5, 6)
    assert (ids.bos, ids.eot, ids.start_header, ids.end_header) == tuple(
        sid(tok, t) for t in (data.BOS, data.EOT, data.START_HEADER, data.END_HEADER))


def test_special_ids_errors():
    config = SimpleNamespace(mask_token_id=7, eos_token_id=5, pad_token_id=5)
    # a special token missing entirely: the error names it
    without_eot = Tokenizer(models.WordLevel({c: i for i, c in enumerate("ab")}))
    without_eot.add_special_tokens([data.BOS, data.START_HEADER, data.END_HEADER])
    with pytest.raises(ValueError, match=r"<\|eot_id\|>"):
        data.special_ids(without_eot, config)
    # present in the vocabulary but not an added token, so text "<|eot_id|>" would not be read as it
    plain = embedded.make_char_tokenizer()
    vocab = plain.get_vocab()
    vocab = {t: i for t, i in vocab.items() if t != data.EOT} | {data.EOT: len(vocab) + 10}
    not_added = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    not_added.pre_tokenizer = plain.pre_tokenizer  # one character at a time, so the literal text gets split
    not_added.add_special_tokens([data.BOS, data.START_HEADER, data.END_HEADER])
    with pytest.raises(ValueError, match="added_tokens"):
        data.special_ids(not_added, config)
    # a config without a mask id
    with pytest.raises(ValueError, match="mask_token_id"):
        data.special_ids(plain, SimpleNamespace(mask_token_id=None, eos_token_id=5, pad_token_id=5))


def test_sft_system_prompt_matches_d1():
    prompts = json.loads((DATA / "d1_prompts.json").read_text())  # d1's strings (tests/data/README.md)
    assert data.SFT_SYSTEM_PROMPT == prompts["SFT_SYSTEM_PROMPT"]


# -----------------------------------------------------------------------------
# JSONL readers

ROWS = {
    "messages": {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
                              {"role": "assistant", "content": "ans"}], "id": 3},
    "prompt-response": {"prompt": "q", "response": "ans"},
    "s1k": {"question": "q", "thinking_trajectories": ["think"], "attempt": "ans", "cot": None},
    "s1k-1.1": {"question": "q", "deepseek_thinking_trajectory": "think", "deepseek_attempt": "ans",
                "gemini_attempt": "other"},
}
S1K_USER = data.SFT_SYSTEM_PROMPT + "\n\nq"  # d1: instruction + "\n\n" + question, then stripped
EXPECTED = {  # (prompt messages after stripping, answer) of each row above
    "messages": ([("system", "sys"), ("user", "q")], "ans"),
    "prompt-response": ([("user", "q")], "ans"),
    "s1k": ([("user", S1K_USER)], "<reasoning>think</reasoning>\n<answer>ans</answer>"),
    "s1k-1.1": ([("user", S1K_USER)], "<reasoning>think</reasoning>\n<answer>ans</answer>"),
}


@pytest.mark.parametrize("fmt", data.FORMATS)
def test_each_format_parses(tmp_path, tok, fmt):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[fmt], "", ROWS[fmt]])  # a blank line is ignored
    for forced in ("auto", fmt):
        examples, stats = data.load_dataset(path, tok, fmt=forced)
        assert stats["format"] == fmt and stats["rows"] == stats["examples"] == 2 and len(examples) == 2
        ids, prompt_len = examples[0]
        assert ids.dtype == torch.int32
        turns, answer = EXPECTED[fmt]
        want_prompt = data.chat_prompt([{"role": r, "content": c} for r, c in turns])
        assert tok.decode(ids[:prompt_len].tolist(), skip_special_tokens=False) == want_prompt
        assert tok.decode(ids[prompt_len:].tolist(), skip_special_tokens=False) == answer + data.EOT
        assert stats["tokens"] == 2 * len(ids)


GOOD = ROWS["prompt-response"]
BAD_ROWS = [  # (bad line 2 of a prompt-response file, field named in the error, words in the message)
    ('{"prompt": "q", "response": ', None, "invalid JSON"),
    ({"prompt": "q"}, "response", "missing"),
    ({"prompt": "q", "response": "  \n"}, "response", "empty"),
    ({"prompt": "q", "response": 5}, "response", "must be a string, got int"),
    ({"prompt": ["q"], "response": "a"}, "prompt", "must be a string, got list"),
    ('["q", "a"]', None, "JSON object"),
]


@pytest.mark.parametrize("bad, field, words", BAD_ROWS)
def test_bad_row_error_names_file_line_field(tmp_path, tok, bad, field, words):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, bad, GOOD])
    with pytest.raises(data.DataError) as info:
        data.load_dataset(path, tok)
    error = info.value
    assert (error.path, error.line, error.field) == (str(path), 2, field)
    assert words in str(error) and f"{path}, line 2" in str(error) and "skip" in str(error)
    if field:
        assert f"field '{field}'" in str(error)


BAD_CHAT_ROWS = [  # (bad messages row, field named in the error)
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "a"}]}, "messages[1].role"),
    ({"messages": [{"role": "user", "content": "q"}, {"content": "a"}]}, "messages[1].role"),
    ({"messages": [{"role": "human", "content": "q"}, {"role": "assistant", "content": "a"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 1}, {"role": "assistant", "content": "a"}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant", "content": "a"}]}, "messages"),
    ({"messages": "hello"}, "messages"),
]


@pytest.mark.parametrize("bad, field", BAD_CHAT_ROWS)
def test_bad_chat_rows(tmp_path, tok, bad, field):
    path = write_jsonl(tmp_path / "chat.jsonl", [ROWS["messages"], bad])
    with pytest.raises(data.DataError) as info:
        data.load_dataset(path, tok)
    assert (info.value.line, info.value.field) == (2, field)


def test_bad_s1k_rows(tmp_path, tok):
    for bad, field in [({"question": "q", "thinking_trajectories": [], "attempt": "a"}, "thinking_trajectories"),
                       ({"question": "q", "thinking_trajectories": [""], "attempt": "a"}, "thinking_trajectories[0]"),
                       ({"question": "q", "thinking_trajectories": ["t"]}, "attempt"),
                       ({"question": "q", "deepseek_thinking_trajectory": "t"}, "deepseek_attempt")]:
        path = write_jsonl(tmp_path / "s1k.jsonl", [bad])
        with pytest.raises(data.DataError) as info:
            data.load_dataset(path, tok)
        assert (info.value.line, info.value.field) == (1, field)


def test_undetectable_and_mismatched_format(tmp_path, tok):
    path = write_jsonl(tmp_path / "x.jsonl", [{"text": "hello"}])
    with pytest.raises(data.DataError, match="cannot tell the format"):
        data.load_dataset(path, tok)
    # the first good row fixes the format: a later row of another format is a missing-field error
    path = write_jsonl(tmp_path / "mixed.jsonl", [GOOD, ROWS["s1k"]])
    with pytest.raises(data.DataError) as info:
        data.load_dataset(path, tok)
    assert (info.value.line, info.value.field) == (2, "prompt")
    # a forced format reads only its own fields
    with pytest.raises(data.DataError) as info:
        data.load_dataset(write_jsonl(tmp_path / "pr.jsonl", [GOOD]), tok, fmt="s1k")
    assert (info.value.line, info.value.field) == (1, "question")
    with pytest.raises(ValueError, match="unknown data format"):
        data.load_dataset(path, tok, fmt="alpaca")


def test_skip_bad_rows_counts(tmp_path, tok):
    bad = [b for b, _, _ in BAD_ROWS]
    # the first line is bad too: the format is detected from the first good row
    path = write_jsonl(tmp_path / "d.jsonl", [bad[0], GOOD] + bad[1:] + [GOOD, {"text": "?"}])
    examples, stats = data.load_dataset(path, tok, skip_bad_rows=True)
    assert stats["format"] == "prompt-response"
    assert len(examples) == stats["examples"] == 2 and stats["rows"] == 9
    assert stats["skipped_bad_rows"] == 7 and len(stats["bad_rows"]) == 7
    assert stats["bad_rows"][0].startswith(f"{path}, line 1: invalid JSON")


def test_no_usable_example_is_an_error(tmp_path, tok):
    with pytest.raises(ValueError, match="no usable example"):
        data.load_dataset(write_jsonl(tmp_path / "empty.jsonl", []), tok)
    with pytest.raises(ValueError, match="no usable example.*2 skipped as bad"):
        data.load_dataset(write_jsonl(tmp_path / "bad.jsonl", ["{", "}"]), tok, skip_bad_rows=True)
    with pytest.raises(ValueError, match="1 longer than max_len=5"):
        data.load_dataset(write_jsonl(tmp_path / "long.jsonl", [GOOD]), tok, max_len=5)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        data.load_dataset(tmp_path / "nope.jsonl", tok)


def test_too_long_dropped_and_counted_never_truncated(tmp_path, tok):
    rows = [{"prompt": "q", "response": "a" * n} for n in (1, 30, 2, 40)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    full = [example(tok, [{"role": "user", "content": "q"}], r["response"]) for r in rows]
    max_len = len(full[2][0]) + 5  # keeps rows 0 and 2
    examples, stats = data.load_dataset(path, tok, max_len=max_len)
    assert stats["dropped_too_long"] == 2 and stats["examples"] == 2
    assert [(ids.tolist(), p) for ids, p in examples] == [full[0], full[2]]
    examples, stats = data.load_dataset(path, tok, max_len=None)
    assert stats["dropped_too_long"] == 0 and len(examples) == 4


# -----------------------------------------------------------------------------
# Batching and sharding


def test_collate_pad_to_and_errors():
    examples = [([1, 2, 3], 1), (torch.tensor([4, 5], dtype=torch.int32), 2)]
    input_ids, answer_mask = data.collate(examples, pad_id=9, pad_to=6)
    assert input_ids.tolist() == [[1, 2, 3, 9, 9, 9], [4, 5, 9, 9, 9, 9]] and input_ids.dtype == torch.long
    assert answer_mask.tolist() == [[False] + [True] * 5, [False] * 2 + [True] * 4] and answer_mask.dtype == torch.bool
    assert data.collate(examples, pad_id=0)[0].tolist() == [[1, 2, 3], [4, 5, 0]]
    with pytest.raises(ValueError, match="more than pad_to=2"):
        data.collate(examples, pad_id=0, pad_to=2)
    with pytest.raises(ValueError, match="no examples"):
        data.collate([], pad_id=0)


def test_epoch_order_deterministic_fresh_per_epoch():
    n = 50
    orders = [data.epoch_order(n, epoch, seed=42) for epoch in range(3)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert len({tuple(o) for o in orders}) == 3
    assert data.epoch_order(n, 1, seed=42) == orders[1]
    assert data.epoch_order(n, 0, seed=43) != orders[0]


def test_the_seed_rule_is_written_once():
    """One seed rule, data.py's (eval.py's too), and the largest seed it derives (an example's noise in epoch 1,000 of
    10^7 examples, under the largest user seed) fits a generator's 64 bits (longjob.SEED_RULE)."""
    assert not hasattr(longjob, "mixed_seed") and not hasattr(longjob, "SEED_MIX")
    assert data.mixed_seed(max(longjob.SEEDS), 1000) * 10_000_019 + 10 ** 7 < 2 ** 64


def test_step_batches():
    assert data.step_batches(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]


@pytest.mark.parametrize("n, world_size, micro_batch, accum",
                         [(10, 1, 1, 1), (37, 2, 3, 2), (100, 4, 2, 3), (7, 2, 4, 2), (64, 8, 1, 4), (13, 3, 2, 2),
                          (9, 2, 2, 2)])
def test_sharding_covers_epoch_once(n, world_size, micro_batch, accum):
    global_batch = world_size * micro_batch * accum
    for epoch in range(2):
        seen = []
        for step in data.step_batches(data.epoch_order(n, epoch, seed=0), global_batch):
            per_rank = [data.rank_micro_batches(step, r, world_size, micro_batch, accum) for r in range(world_size)]
            single = data.rank_micro_batches(step, 0, 1, world_size * micro_batch, accum)
            for j in range(accum):
                # the union over ranks of micro-batch j is the single-process micro-batch j, in rank order
                assert sum((per_rank[r][j] for r in range(world_size)), []) == single[j]
                for r in range(world_size):
                    assert len(per_rank[r]) == accum and len(per_rank[r][j]) <= micro_batch
                    if len(step) == global_batch:
                        assert len(per_rank[r][j]) == micro_batch
            seen += [i for mbs in per_rank for mb in mbs for i in mb]
        assert sorted(seen) == list(range(n))  # disjoint across ranks and micro-batches, every example once


def test_sharding_end_of_epoch_has_empty_micro_batches():
    # 9 examples, global batch 8: the last step is one example, so rank 1 gets two empty micro-batches
    last = data.step_batches(data.epoch_order(9, 0, seed=0), 8)[-1]
    assert data.rank_micro_batches(last, 0, 2, 2, 2) == [last, []]
    assert data.rank_micro_batches(last, 1, 2, 2, 2) == [[], []]
    with pytest.raises(ValueError, match="does not fit"):
        data.rank_micro_batches(list(range(9)), 0, 2, 2, 2)
    with pytest.raises(ValueError, match="rank 2"):
        data.rank_micro_batches(last, 2, 2, 2, 2)


# -----------------------------------------------------------------------------
# The embedded task's Sudoku (embedded.py)


def brute_force_grids():
    """Independent enumeration: choose rows as permutations, keep the ones with valid columns and boxes."""
    rows = ["".join(p) for p in itertools.permutations("1234")]
    top = [a + b for a in rows for b in rows
           if all(a[c] != b[c] for c in range(4)) and set(a[:2] + b[:2]) == set(a[2:] + b[2:]) == set("1234")]
    return sorted(t + u for t in top for u in top
                  if all(len({t[c], t[4 + c], u[c], u[4 + c]}) == 4 for c in range(4)))


def sudoku_valid(grid):
    """Whether a 16-character string is a solved 4x4 Sudoku."""
    return len(grid) == 16 and all(sorted(grid[i] for i in unit) == list("1234") for unit in embedded.SUDOKU_UNITS)


def test_sudoku_grids():
    grids = embedded.sudoku_grids()
    assert len(grids) == 288 and len(set(grids)) == 288
    assert all(sudoku_valid(g) for g in grids)
    assert list(grids) == brute_force_grids()  # same set, and the documented lexicographic order


def test_sudoku_valid_rejects():
    grid = "1234341221434321"
    assert sudoku_valid(grid)
    assert not sudoku_valid("2134341221434321")  # columns 0 and 1 broken
    assert not sudoku_valid("1234214334124321")  # rows and columns fine, top-left box is not
    assert not sudoku_valid(grid[:15])


def test_make_puzzle_consistent_and_unique():
    generator = torch.Generator().manual_seed(0)
    for grid in embedded.sudoku_grids()[::7]:
        for n_blanks in (0, 6, 10):
            puzzle = embedded.make_puzzle(grid, n_blanks, generator)
            assert puzzle.count("0") == n_blanks
            assert all(p in ("0", g) for p, g in zip(puzzle, grid))
            assert embedded.sudoku_solutions(puzzle) == [grid]
    a = embedded.make_puzzle(grid, 8, torch.Generator().manual_seed(3))
    assert a == embedded.make_puzzle(grid, 8, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="unique"):
        embedded.make_puzzle(grid, 16, generator, max_tries=5)


def test_sudoku_split_by_puzzle():
    train, test = embedded.sudoku_split(n_train=300, n_test=50, n_blanks=(4, 10), seed=1)
    assert len(train) == 300 and len(test) == 50
    train_puzzles, test_puzzles = {p for p, _ in train}, {p for p, _ in test}
    assert len(train_puzzles) == 300 and len(test_puzzles) == 50 and not train_puzzles & test_puzzles
    for puzzle, solution in train + test:
        assert 4 <= puzzle.count("0") <= 10 and embedded.sudoku_solutions(puzzle) == [solution]
    assert embedded.sudoku_split(n_train=300, n_test=50, n_blanks=(4, 10), seed=1) == (train, test)  # seeded
    assert embedded.sudoku_split(n_train=10, n_test=50, n_blanks=(4, 10), seed=1)[1] == test  # test set fixed first
    assert embedded.sudoku_split(n_train=10, n_test=50, n_blanks=(4, 10), seed=2)[1] != test


def test_sudoku_split_by_grid():
    train, test = embedded.sudoku_split(n_train=400, n_test=60, seed=0, test_grids=20)
    test_grids, train_grids = {s for _, s in test}, {s for _, s in train}
    assert len(test_grids) <= 20 and not test_grids & train_grids
    assert not {p for p, _ in train} & {p for p, _ in test}
    assert all(p.count("0") == 8 for p, _ in train + test)
    with pytest.raises(ValueError, match="distinct puzzles"):
        embedded.sudoku_split(n_train=0, n_test=100, n_blanks=1, test_grids=1)  # 1 grid has only 16 such puzzles


def test_char_tokenizer_round_trips_and_saves(tmp_path):
    tokenizer = embedded.make_char_tokenizer()
    assert tokenizer.get_vocab_size() < 64
    for token in data.SPECIAL_TOKENS:
        assert data.encode(tokenizer, token) == [sid(tokenizer, token)]
    train, _ = embedded.sudoku_split(n_train=5, n_test=1)
    for (puzzle, solution), (ids, prompt_len) in zip(train, embedded.sudoku_examples(tokenizer, train)):
        text = data.chat_prompt(embedded.sudoku_messages(puzzle))
        assert text.endswith(f"Solve the following Sudoku puzzle: {puzzle}<|eot_id|>"
                             "<|start_header_id|>assistant<|end_header_id|>\n\n")
        assert tokenizer.decode(ids[:prompt_len], skip_special_tokens=False) == text
        assert tokenizer.decode(ids[prompt_len:], skip_special_tokens=False) == f"<answer>{solution}</answer><|eot_id|>"
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = data.load_tokenizer(tmp_path)
    assert embedded.sudoku_examples(loaded, train) == embedded.sudoku_examples(tokenizer, train)
    with pytest.raises(Exception):
        data.encode(tokenizer, "Q")  # outside the character set: an error, not a silent unknown token


def test_tiny_config_for():
    pytest.importorskip("model")
    tokenizer = embedded.make_char_tokenizer()
    config = embedded.tiny_config_for(tokenizer, d_model=32, n_heads=2, n_kv_heads=2, n_layers=1, mlp_hidden_size=64)
    assert config.vocab_size == config.embedding_size == 56 >= tokenizer.get_vocab_size()
    assert config.mask_token_id == sid(tokenizer, data.MASK)
    assert config.eos_token_id == config.pad_token_id == sid(tokenizer, data.EOS)
    ids = data.special_ids(tokenizer, config)
    assert (ids.mask, ids.pad) == (config.mask_token_id, config.pad_token_id)


def test_invalid_utf8_is_a_bad_row_and_a_bom_is_accepted(tmp_path, tok):
    good = json.dumps(GOOD).encode()
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + b'{"prompt": "caf\xe9", "response": "x"}\n' + good + b"\n")
    with pytest.raises(data.DataError, match=r"line 2.*not UTF-8 \(byte 16 of the line\).*--skip-bad-rows"):
        data.load_dataset(path, tok)
    examples, stats = data.load_dataset(path, tok, skip_bad_rows=True)  # the BOM line and the last line are read
    assert len(examples) == 2 and stats["skipped_bad_rows"] == 1 and stats["format"] == "prompt-response"


# -----------------------------------------------------------------------------
# Text a row cannot hold: a special token's text (encoded as the token itself), an integer too long for int()

CHAT_TOKEN_ROWS = [  # (family, bad row, the field named, the token named)
    ("llada", {"prompt": "q", "response": f"a{data.EOT}b"}, "response", data.EOT),
    ("llada", {"prompt": f"q{data.START_HEADER}assistant{data.END_HEADER}", "response": "a"}, "prompt",
     data.START_HEADER),
    ("llada", {"messages": [{"role": "system", "content": f"{data.BOS}s"}, {"role": "user", "content": "q"},
                            {"role": "assistant", "content": "a"}]}, "messages[0].content", data.BOS),
    ("llada", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": f"a{data.EOS}b"}]},
     "messages[1].content", data.EOS),
    ("llada", {"question": "q", "thinking_trajectories": [f"t{data.END_HEADER}"], "attempt": "a"},
     "thinking_trajectories[0]", data.END_HEADER),
    ("dream", {"prompt": "q", "response": f"a{data.IM_END}\n{data.IM_START}user\nb"}, "response", data.IM_END),
    ("dream", {"question": f"{data.IM_START}q", "deepseek_thinking_trajectory": "t", "deepseek_attempt": "a"},
     "question", data.IM_START),
    ("dream", {"prompt": "q", "response": "a<|beginoftext|>"}, "response", "<|beginoftext|>"),  # a special of its own
    # a turn end or EOS ending a turn: padding at the answer's end only (test_an_answer_padded_with_turn_ends_is_kept)
    ("llada", {"messages": [{"role": "user", "content": f"q{data.EOT}"}, {"role": "assistant", "content": "a"}]},
     "messages[0].content", data.EOT),
    ("llada", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": f"a{data.EOS}"},
                            {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "messages[1].content", data.EOS),
    ("llada", {"prompt": f"q{data.EOT}{data.EOT}", "response": "a"}, "prompt", data.EOT),
    ("dream", {"messages": [{"role": "user", "content": f"q{data.IM_END}"}, {"role": "assistant", "content": "a"}]},
     "messages[0].content", data.IM_END),
    ("dream", {"question": f"q{data.EOS}", "deepseek_thinking_trajectory": "t", "deepseek_attempt": "a"}, "question",
     data.EOS),
]


@pytest.mark.parametrize("family, bad, field, token", CHAT_TOKEN_ROWS)
def test_chat_token_text_in_a_row_is_refused_naming_file_line_field(tmp_path, tok, family, bad, field, token):
    """Such text would be encoded as the token itself (a fake turn, an answer ended mid-way): the row is refused as
    a bad row, or skipped and counted. LLaDA's format on the char tokenizer, ChatML's on the Qwen2 fixture."""
    tokenizer = tok if family == "llada" else data.load_tokenizer(DATA / "dream_tokenizer")
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[data.detect_format(bad)], bad])
    with pytest.raises(data.DataError) as info:
        data.load_dataset(path, tokenizer)
    assert (info.value.path, info.value.line, info.value.field) == (str(path), 2, field)
    assert f"special token {token!r}" in str(info.value)
    examples, stats = data.load_dataset(path, tokenizer, skip_bad_rows=True)
    assert len(examples) == 1 and stats["skipped_bad_rows"] == 1


def test_text_near_a_special_token_and_plain_added_tokens_are_kept(tmp_path):
    """Only what the tokenizer reads as a special token is refused: the Qwen2 fixture's <tool_call> (an added token,
    not special) and a broken <|im_end| are a row's text."""
    tokenizer = data.load_tokenizer(DATA / "dream_tokenizer")
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "<|im_end| q", "response": "<tool_call>a</tool_call>"}])
    (ids, prompt_len), = data.load_dataset(path, tokenizer)[0]
    answer = tokenizer.decode(ids[prompt_len:].tolist(), skip_special_tokens=False)
    assert answer == "<tool_call>a</tool_call><|im_end|>"


def test_an_answer_padded_with_turn_ends_is_kept(tmp_path, tok):
    """An answer may end in a run of turn ends or EOS (LLaDA's SFT pads answers so; experiments/countdown.py pads
    with <|eot_id|> to a fixed length): padding, not a fake turn. The same token before the answer's end is refused."""
    for rows in ([{"prompt": "q", "response": "a" + data.EOT * 3}],
                 [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" + data.EOS * 2}]}]):
        examples, stats = data.load_dataset(write_jsonl(tmp_path / "d.jsonl", rows), tok)
        assert len(examples) == 1 and stats["skipped_bad_rows"] == 0
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "q", "response": data.EOT + "a" + data.EOT}])
    with pytest.raises(data.DataError, match="field 'response': holds the special token"):
        data.load_dataset(path, tok)


def test_an_integer_too_long_for_python_is_one_line_naming_file_and_line(tmp_path, tok):
    """json.loads raises a paragraph-long ValueError on an integer of more than 4300 digits: a bad row instead."""
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, '{"prompt": "q", "response": "a", "id": ' + "9" * 5000 + "}"])
    with pytest.raises(data.DataError) as info:
        data.load_dataset(path, tok)
    said = str(info.value)
    assert said.startswith(f"{path}, line 2: holds an integer of more than") and len(said.splitlines()) == 1
    examples, stats = data.load_dataset(path, tok, skip_bad_rows=True)
    assert len(examples) == 1 and stats["skipped_bad_rows"] == 1
