"""Make this folder: a tiny Qwen2-style slow tokenizer as Dream-v0's Hugging Face folders ship it (vocab.json,
merges.txt, tokenizer_config.json; no tokenizer.json), and expected.json, what Hugging Face's own Qwen2 tokenizers
make of it: for each test string, the ids of the slow `Qwen2Tokenizer` (Dream's tokenization_dream.py is a copy) and
of the fast `Qwen2TokenizerFast` built from it by transformers' Qwen2Converter (both must agree), and their decoding.
tests/test_dream_tokenizer.py checks data.load_tokenizer against it without transformers.

Run it in a scratch environment with transformers (not a run-time package of this project), e.g.

    python3 -m venv /tmp/tokvenv && /tmp/tokvenv/bin/pip install torch transformers==4.46.2 tokenizers
    /tmp/tokvenv/bin/python tests/data/dream_tokenizer/make_fixture.py

The vocabulary is trained (with the `tokenizers` library) only when vocab.json is absent; expected.json is always
rewritten.
"""

import json
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
N_MERGES = 200  # per training: vocab.json holds the 256 byte-level characters, then one token per merge

# transformers' tokenization_qwen2.py PRETOKENIZE_REGEX
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")

# the training text: English with contractions, code, numbers, newlines, and some non-ASCII, so that merges of
# spaces, newlines, multi-byte characters and contractions exist (digits are never merged: the regex splits them)
CORPUS = """\
The quick brown fox jumps over the lazy dog. It's the dog's day; they're sure we've seen it, and I'm sure we'll
see it again. He'd said so. Don't you think they'd know? You're right: it isn't what we thought.
Solve the following Sudoku puzzle: 2043430000303020
<answer>2143431212343421</answer>
Respond in the following format:
<reasoning>
Your reasoning here
</reasoning>
<answer>
...
</answer>
def solve(puzzle):
    for row in range(4):
        if puzzle[row] == 0:
            return None
    return puzzle

    indented line with    several     spaces
Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.
How many clips did Natalia sell altogether in April and May? 48 + 24 = 72.
Café crème, naïve façade, über straße, Ünïcödé résumé.
日本語のテキストです。中文测试文本。日本語 日本
Привет, мир! Привет мир.
Emoji: 😀 🎉 👍 😀😀
Using numbers 3, 5, 7, 11 create an equation that equals 24.
You are a helpful assistant.
A line with trailing spaces  
  
and one more 
 
the end.
"""

# Dream-v0's added tokens (its tokenizer_config.json, ids 151643..151666 after Qwen2.5's 151643 BPE tokens),
# shortened: ChatML's, two of Qwen2.5's non-special tool tokens, Dream's <|beginoftext|> and <|mask|>
ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<tool_call>", False),
         ("</tool_call>", False), ("<|beginoftext|>", True), ("<|mask|>", True)]

TEXTS = [
    # spaces before words, several spaces, newlines (with the spaces before them), tabs
    "", "Hello world", " Hello world", "Hello  world", "   leading spaces", "trailing spaces   ",
    "the the  the   the", "a\nb", "a\n\nb", "a \n b", "word  \nnext", "x \ny", "line one\r\nline two\r\n",
    "\n\n\n", "  \n  \n", "tabs\tand\t\ttabs", " \t \n",
    # digits, one by one
    "12345", "3.14159", "x=1000000", "2024-01-01", "The answer is 42.", "48 + 24 = 72", "Ⅻ ٣٤ ½",
    # contractions
    "it's", "they're", "I've", "we'll", "he'd", "I'm", "don't", "IT'S THEY'RE", "the dog's day", "''s' 're",
    # non-ASCII, NFD input, emoji
    "café", "naïve façade", "Ünïcödé résumé", "cafe\u0301 (NFD)", "ﬁ ligature", "\u00a0nbsp\u00a0",
    "zero\u200bwidth", "日本語のテキスト", "中文测试文本", "Привет мир", "مرحبا بالعالم", "emoji 😀🎉👍🏽",
    "family 👨\u200d👩\u200d👧",
    # added tokens inside text, and near misses of them
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\n",
    "a<|mask|><|mask|>b", "<|mask|> <|mask|>", "<|endoftext|>", "text<|endoftext|>more", " <|im_end|> ",
    "<tool_call>{\"name\": \"f\"}</tool_call>", "<|beginoftext|>Once", "<|im_start", "<|mask|", "<mask>",
    # code, answers, LaTeX
    "def f(x):\n    return x**2\n", "    indented\n        twice", "<answer>2143431212343421</answer><|im_end|>",
    "$\\frac{1}{2} + \\sqrt{3}$", "Solve the following Sudoku puzzle: 2043430000303020",
]


def qwen2_pre_tokenizer():
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def train(pre_tokenizer):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + N_MERGES, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator([CORPUS], trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    return model["vocab"], [tuple(m.split()) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def train_vocab():
    """vocab.json and merges.txt of a byte-level BPE trained on CORPUS with Qwen2's pre-tokenization, then the merges
    that GPT-2's pre-tokenization (ByteLevel's own regex) learns on top: pieces such as " 48" or "48" that Qwen2's
    pre-tokenization never forms (it splits digits one by one and keeps a space apart from a digit), so that a
    tokenizer with the wrong pre-tokenization encodes some test strings differently."""
    vocab, merges = train(qwen2_pre_tokenizer())
    _, gpt2_merges = train(pre_tokenizers.ByteLevel(add_prefix_space=False))
    for a, b in gpt2_merges:  # in order: each merge's parts are in the vocabulary by then
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    (HERE / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n", encoding="utf-8")
    (HERE / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    n = len(vocab)
    flags = dict(lstrip=False, normalized=False, rstrip=False, single_word=False)
    config = dict(add_bos_token=False, add_prefix_space=False,
                  added_tokens_decoder={str(n + i): dict(content=t, **flags, special=s)
                                        for i, (t, s) in enumerate(ADDED)},
                  additional_special_tokens=["<|im_start|>", "<|im_end|>"], bos_token="<|beginoftext|>",
                  clean_up_tokenization_spaces=False, eos_token="<|endoftext|>", errors="replace",
                  mask_token="<|mask|>", model_max_length=2048, pad_token="<|endoftext|>", split_special_tokens=False,
                  tokenizer_class="Qwen2Tokenizer", unk_token=None)
    (HERE / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def added_tokens(fast):
    return [dict(id=i, content=t.content, special=t.special, normalized=t.normalized, lstrip=t.lstrip,
                 rstrip=t.rstrip, single_word=t.single_word)
            for i, t in sorted(fast.backend_tokenizer.get_added_tokens_decoder().items())]


def expectations(folder):
    """[{text, ids, decoded}] from the slow and the fast Qwen2 tokenizer of `folder`, which must agree."""
    from transformers import Qwen2Tokenizer, Qwen2TokenizerFast

    slow, fast = Qwen2Tokenizer.from_pretrained(folder), Qwen2TokenizerFast.from_pretrained(folder)
    rows = []
    for text in TEXTS:
        ids = slow.encode(text, add_special_tokens=False)
        decoded = slow.decode(ids)
        fast_ids = fast.encode(text, add_special_tokens=False)
        if fast_ids != ids or fast.decode(fast_ids) != decoded:
            sys.exit(f"slow and fast Qwen2 tokenizers differ on {text!r}: {ids} != {fast_ids}")
        rows.append(dict(text=text, ids=ids, decoded=decoded))
    return rows, added_tokens(fast)


def main():
    import tempfile

    import transformers

    if not (HERE / "vocab.json").is_file():
        train_vocab()
    rows, added = expectations(HERE)
    # the legacy layout: added_tokens.json, and a tokenizer_config.json without added_tokens_decoder
    config = json.loads((HERE / "tokenizer_config.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("vocab.json", "merges.txt"):
            (Path(tmp) / name).write_bytes((HERE / name).read_bytes())
        (Path(tmp) / "added_tokens.json").write_text(
            json.dumps({t["content"]: int(i) for i, t in config.pop("added_tokens_decoder").items()}))
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(config))
        legacy_rows, legacy_added = expectations(tmp)
    if legacy_rows != rows:
        sys.exit("the legacy layout (added_tokens.json) encodes differently")
    expected = dict(transformers=transformers.__version__, strings=rows, added_tokens=added,
                    legacy_added_tokens=legacy_added)
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(rows)} strings: slow == fast (and the legacy layout's); {HERE / 'expected.json'}")


if __name__ == "__main__":
    main()
