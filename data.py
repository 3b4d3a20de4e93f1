"""Data for GIFT fine-tuning of LLaDA: tokenizer, chat format, JSONL readers. Batching and sharding are its section
"Batches"; the built-in 4x4 Sudoku task (the embedded default's data) is embedded.py's.

A training example is `(ids, prompt_len)`: the token ids of prompt + answer + <|eot_id|>, and the number of prompt
tokens. Positions >= prompt_len are the answer; batches are right-padded with <|endoftext|>, and the pads count as
answer (they are noised and trained on, as in LLaDA's SFT, so the model learns where to stop).

    python data.py --data train.jsonl --model /ckpt/LLaDA-8B-Instruct   # check a dataset: format, counts, example
"""

import argparse
import array
import collections
import functools
import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, models

from dream import qwen2_tokenizer
from model import open_regular, read_json_file

# -----------------------------------------------------------------------------
# Constants: the chat formats' special token strings (their ids always come from tokenizer.json / config.json)

# LLaDA-8B-Instruct's (Llama 3's headers)
BOS = "<|startoftext|>"
EOS = "<|endoftext|>"  # also LLaDA's pad token
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
MASK = "<|mdm_mask|>"
SPECIAL_TOKENS = (BOS, EOS, START_HEADER, END_HEADER, EOT, MASK)
# Dream-v0's (Qwen2.5's ChatML): EOS = pad is the same "<|endoftext|>"; each turn is <|im_start|>role\n...<|im_end|>\n
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
DREAM_MASK = "<|mask|>"
DREAM_SPECIAL_TOKENS = (EOS, IM_START, IM_END, DREAM_MASK)
CHATML_SYSTEM = "You are a helpful assistant."  # Qwen2.5's template adds this system turn when the messages have none


@dataclass(frozen=True)
class ChatFormat:
    """What differs between the chat formats, looked up rather than branched on (the template is chat_prompt's)."""
    specials: tuple  # the special tokens, in the order embedded.make_char_tokenizer adds them
    text_tokens: dict  # SpecialIds field -> the token chat_prompt writes into text (checked by check_chat_tokens)
    mask: str  # the diffusion mask


CHAT_FORMATS = {  # keyed by chat_format(tokenizer)
    "llada": ChatFormat(SPECIAL_TOKENS, dict(bos=BOS, eot=EOT, start_header=START_HEADER, end_header=END_HEADER), MASK),
    "chatml": ChatFormat(DREAM_SPECIAL_TOKENS, dict(start_header=IM_START, eot=IM_END), DREAM_MASK),
}
ROLES = ("system", "user", "assistant")
FORMATS = ("messages", "prompt-response", "s1k", "s1k-1.1")
ENCODE_CHUNK = 2048  # rows tokenized per encode_batch call: parallel in Rust, bounded memory for big files
MAX_BAD_ROWS_KEPT = 10  # error messages of skipped rows kept in the stats for the log
# a line longer than this (or than 64 x the characters that fit max_len tokens) is dropped unread: rows carry fields no
# format reads (s1K's other trajectories), and a line with no end (a file without line breaks) is never held whole
MAX_LINE_BYTES = 64 << 20
MAX_FILE_BYTES = 256 << 20  # a data file read whole (eval.py's test and shot files: a few MB)
BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
        (b"\xfe\xff", "UTF-16"))  # byte order marks, UTF-32's first (its LE mark starts as UTF-16's)
CR_BREAK = re.compile(rb"\r[ \t]*[^\s]")  # a line break of CR alone (classic Mac files read as one line)
# an answer's padding of turn ends or EOS, as LLaDA's SFT pads (experiments/countdown.py's fixed-length answers)
END_PADDING = re.compile(f"(?:{re.escape(EOT)}|{re.escape(IM_END)}|{re.escape(EOS)})+$")
# d1 / wd1's instruction before each s1K question (github.com/dllm-reasoning/d1, SFT/sft_trainer.py; a test checks it)
SFT_SYSTEM_PROMPT = ("\nRespond in the following format:\n<reasoning>\nYour reasoning here\n</reasoning>\n"
                     "<answer>\n...\n</answer>\n")
# d1's Sudoku question without its long instruction (and the "\n" chat_prompt strips): eval.py's, and embedded.py's
SUDOKU_TASK_PROMPT = "Solve the following Sudoku puzzle: {puzzle}"

# -----------------------------------------------------------------------------
# Tokenizer and special ids


def load_tokenizer(model_dir):
    """A model folder's tokenizer.json, or without one (Dream-v0's) its slow Qwen2 files, built as transformers does."""
    folder = Path(model_dir)
    path = folder / "tokenizer.json"
    if path.exists():  # anything but a regular file there is refused (open_regular), not read as no tokenizer.json
        try:
            with open_regular(path) as f:
                tokenizer = Tokenizer.from_str(f.read().decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception; say whether the JSON or its content is wrong
            read_json_file(path)  # not a regular file, not UTF-8, not JSON: said here
            raise ValueError(f"{path}: valid JSON, but not a tokenizer the `tokenizers` library reads ({e}); it "
                             "must be a Hugging Face tokenizer.json (not tokenizer_config.json or a sentencepiece "
                             "model)") from None
    elif (folder / "vocab.json").exists():
        tokenizer = qwen2_tokenizer(folder)
    else:
        raise FileNotFoundError(f"{path} not found: the model folder must hold the Hugging Face tokenizer.json (or, "
                                "as Dream-v0's, a Qwen2 tokenizer's vocab.json and merges.txt)")
    tokenizer.no_truncation()  # too-long examples are dropped and counted by load_dataset, never cut
    tokenizer.no_padding()  # padding happens in collate
    return tokenizer


def encode(tokenizer, text):
    """Text -> ids, exactly the tokens of `text`: special tokens are matched in it, nothing (no BOS) is added."""
    return tokenizer.encode(text, add_special_tokens=False).ids


def _encoding(tokenizer, text):
    """tokenizer.encode(text) as encode() does, or None where it raises (a character with no token)."""
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    except Exception:
        return None


def _token_id(tokenizer, token):
    if (token_id := tokenizer.token_to_id(token)) is None:
        raise ValueError(f"the tokenizer has no {token!r} token, which LLaDA's chat format needs "
                         "(is this LLaDA's tokenizer.json? embedded.make_char_tokenizer() builds a tiny one with it)")
    return token_id


@dataclass
class SpecialIds:
    eos: int  # ends generation (LLaDA and Dream: <|endoftext|>)
    pad: int  # = eos in both families
    mask: int  # the diffusion mask (<|mdm_mask|>, Dream's <|mask|>)
    eot: int  # ends each chat turn (<|eot_id|>, ChatML's <|im_end|>)
    bos: int = None  # <|startoftext|> (LLaDA's format only)
    start_header: int = None  # <|start_header_id|>, or ChatML's <|im_start|>
    end_header: int = None  # <|end_header_id|> (LLaDA's format only)


def chat_format(tokenizer):
    """Which chat format a tokenizer is for: "chatml" (Dream-v0's) when it has <|im_start|> or <|im_end|> (a missing one
    of the two is then named as ChatML's), else "llada"."""
    return "chatml" if {tokenizer.token_to_id(IM_START), tokenizer.token_to_id(IM_END)} != {None} else "llada"


def check_chat_tokens(tokenizer, where, hint=""):
    """{token: id} of the chat format's tokens, each read in text as one token, else a ValueError naming `where`."""
    fmt = chat_format(tokenizer)
    ids = {token: tokenizer.token_to_id(token) for token in CHAT_FORMATS[fmt].text_tokens.values()}
    if missing := [token for token, token_id in ids.items() if token_id is None]:
        what = ("of ChatML's format (Dream's), whose other tokens it has" if fmt == "chatml" else
                f"it is neither LLaDA's nor Dream's (ChatML, {IM_START})")
        raise ValueError(f"{where}: its tokenizer has no chat token {', '.join(missing)}: {what}, so there is no chat "
                         f"format to wrap the prompt in{hint}")
    if split := [token for token in ids if (e := _encoding(tokenizer, token)) is None or e.ids != [ids[token]]]:
        raise ValueError(f"{where}: its tokenizer does not read {', '.join(split)} in text as one token (a plain "
                         "vocabulary entry, spelled out in pieces); it must be listed under 'added_tokens' in "
                         f"tokenizer.json{hint}")
    return ids


def special_ids(tokenizer, config, where="the tokenizer"):
    """mask / eos / pad from config.json, the chat format's tokens from the tokenizer (check_chat_tokens, naming
    `where`); a full model config (one with embedding_size, e.g. LLaDAConfig) also passes check_mask_token."""
    for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, name, None)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"config.json field {name!r} is {value!r}; it must be a token id")
    if getattr(config, "embedding_size", None) is not None:
        check_mask_token(tokenizer, config)
    ids = check_chat_tokens(tokenizer, where)
    return SpecialIds(eos=config.eos_token_id, pad=config.pad_token_id, mask=config.mask_token_id,
                      **{field: ids[t] for field, t in CHAT_FORMATS[chat_format(tokenizer)].text_tokens.items()})


def check_mask_token(tokenizer, config):
    """config.json's token ids against the model and the tokenizer: each a row of the embedding, mask_token_id the
    tokenizer's mask token, it and eos_token_id never an ordinary one (text would hold masks, or end a generation)."""
    E, size = config.embedding_size, tokenizer.get_vocab_size(with_added_tokens=True)
    if size > E:  # its last ids would index past the embedding (an IndexError, or a CUDA assert, mid-generation)
        raise ValueError(f"the tokenizer has {size} tokens (ids up to {size - 1}) but the model's embedding only "
                         f"{E} rows (config.json embedding_size = {E}): tokenizer.json and config.json come from "
                         "different models")
    for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
        if not 0 <= getattr(config, name) < E:
            raise ValueError(f"config.json field {name!r} = {getattr(config, name)} is outside the embedding "
                             f"(embedding_size = {E}: ids 0 .. {E - 1}); config.json belongs to another model?")
    mask_id, mask = config.mask_token_id, CHAT_FORMATS[chat_format(tokenizer)].mask
    if (tokenizer_mask_id := tokenizer.token_to_id(mask)) not in (None, mask_id):  # None: the tokenizer has none
        raise ValueError(f"config.json field 'mask_token_id' = {mask_id}, but the tokenizer's {mask!r} token is id "
                         f"{tokenizer_mask_id}: tokenizer.json and config.json come from different models (or set "
                         f"mask_token_id to {tokenizer_mask_id})")
    added = tokenizer.get_added_tokens_decoder()
    for name, which in (("mask_token_id", f"{MASK!r} in LLaDA's tokenizer.json, {DREAM_MASK!r} in Dream's"),
                        ("eos_token_id", f"{EOS!r} in LLaDA's and Dream's")):
        token_id = getattr(config, name)
        if (token := tokenizer.id_to_token(token_id)) is not None and not getattr(added.get(token_id), "special", 0):
            raise ValueError(f"config.json field {name!r} = {token_id} is the tokenizer's ordinary token {token!r}, "
                             f"which text produces; it must be a special token ({which})")


# -----------------------------------------------------------------------------
# Chat formats (LLaDA's Llama 3 headers, Dream's ChatML), and encoding that refuses the text a model would misread


def chat_prompt(messages, fmt="llada"):
    """The chat template written out (fmt: chat_format(tokenizer)): each {"role", "content"} turn, then the assistant
    header the answer or generation follows (LLaDA's official template adds it after an answer too; ours does not)."""
    if fmt == "chatml":
        system = [] if messages and messages[0]["role"] == "system" else [dict(role="system", content=CHATML_SYSTEM)]
        turns = "".join(f"{IM_START}{m['role']}\n{m['content'].strip()}{IM_END}\n" for m in system + list(messages))
        return turns + f"{IM_START}assistant\n"
    turns = "".join(f"{START_HEADER}{m['role']}{END_HEADER}\n\n{m['content'].strip()}{EOT}" for m in messages)
    return BOS + turns + f"{START_HEADER}assistant{END_HEADER}\n\n"


def _unknown_token(tokenizer):
    """(token, id) of the tokenizer's unknown token, or (None, None) when it has none (LLaDA's byte-level BPE)."""
    unk = getattr(tokenizer.model, "unk_token", None)  # BPE, WordPiece, WordLevel
    if isinstance(tokenizer.model, models.Unigram):  # Unigram keeps an id instead
        unk_id = json.loads(tokenizer.to_str())["model"].get("unk_id")
        return (None, None) if unk_id is None else (tokenizer.id_to_token(unk_id), unk_id)
    return unk, tokenizer.token_to_id(unk) if unk else None


def unencodable_characters(tokenizer, text, unk=None):
    """{character: first position} for each character of `text`, outside its special tokens, that has no token: alone,
    it fails to encode or is read as the unknown token (unk: _unknown_token's, found when not given)."""
    unk_token, unk_id = unk or _unknown_token(tokenizer)
    added = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values()), key=len, reverse=True)
    spans = [m.span() for m in re.finditer("|".join(map(re.escape, added)), text)] if added else []
    seen, bad = set(), {}
    for pos, ch in enumerate(text):
        if ch not in seen and not any(a <= pos < b for a, b in spans):
            seen.add(ch)
            encoding = _encoding(tokenizer, ch)
            if encoding is None or (unk_id is not None and unk_id in encoding.ids and ch != unk_token):
                bad[ch] = pos
    return bad


def mask_in_text(tokenizer, text, encoding=None):
    """Why `text` (or its encoding, when given) cannot be given to the model, or None: it holds the mask token."""
    mask = CHAT_FORMATS[chat_format(tokenizer)].mask
    encoding = tokenizer.encode(text, add_special_tokens=False) if encoding is None else encoding
    if tokenizer.token_to_id(mask) in encoding.ids:  # None (no mask token) is in no encoding
        return f"holds the mask token {mask!r} as text (the model reads it as a masked position); remove it"
    return None


def _unreadable(tokenizer, text, encoding, unk):
    """Why `text` (encoded as `encoding`, None where encode raised) cannot be given to the model, or None."""
    def around(start, end):
        return f"{text[start:end]!r} (U+{ord(text[start]):04X}) in ...{text[max(0, start - 20):end + 20]!r}..."

    unk_token, unk_id = unk
    if encoding is None:
        pos = next(iter(unencodable_characters(tokenizer, text, unk).values()), None)  # the first character
        return ("cannot be tokenized" if pos is None else
                f"has {around(pos, pos + 1)}, a character the tokenizer has no token for")
    if unk_id is not None and unk_id in encoding.ids:
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
            if token_id == unk_id and text[start:end] != unk_token:  # the literal unknown token in text is fine
                return f"has {around(start, end)}, which the tokenizer reads as its unknown token {unk_token!r}"
    return mask_in_text(tokenizer, text, encoding)


def encode_text(tokenizer, text, what="the prompt"):
    """encode(), or a one-line ValueError naming the mask token or every character the tokenizer has no token for."""
    if bad := unencodable_characters(tokenizer, text):
        names = ", ".join(f"{ch!r} (U+{ord(ch):04X})" for ch in bad)
        alphabet = [t for t, _ in sorted(tokenizer.get_vocab(with_added_tokens=False).items(), key=lambda kv: kv[1])]
        hint = f"; this model reads only {''.join(alphabet)!r}" if len(alphabet) <= 256 else ""
        raise ValueError(f"{what} has characters this model's tokenizer cannot encode: {names}{hint}")
    encoding = tokenizer.encode(text, add_special_tokens=False)  # as encode()
    if problem := mask_in_text(tokenizer, text, encoding):
        raise ValueError(f"{what} {problem}")
    return encoding.ids


def encode_examples(tokenizer, pairs, bad_rows=False):
    """[(messages, answer)] -> [(ids, prompt_len)], ids = prompt + answer (stripped, as the template trims every turn)
    + the turn's end, tokenized in one batch, the prompt apart (so its ids are exactly what generation is given). An
    _unreadable text raises a ValueError naming the example, or with bad_rows is a BadRow in its place."""
    fmt = chat_format(tokenizer)
    eot = _token_id(tokenizer, CHAT_FORMATS[fmt].text_tokens["eot"])  # ends the answer's turn
    texts = [chat_prompt(messages, fmt) for messages, _ in pairs] + [answer.strip() for _, answer in pairs]
    try:
        encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    except Exception:  # some text holds a character with no token: find which
        encodings = [_encoding(tokenizer, text) for text in texts]
    unk, n, results = _unknown_token(tokenizer), len(pairs), []
    for p, a, p_text, a_text in zip(encodings[:n], encodings[n:], texts[:n], texts[n:]):
        where, problem = "the prompt", _unreadable(tokenizer, p_text, p, unk)
        if problem is None:
            where, problem = "the answer", _unreadable(tokenizer, a_text, a, unk)
        if problem and not bad_rows:
            raise ValueError(f"example {len(results)}: {where} {problem}")
        results.append(BadRow(None, f"{where} {problem}") if problem else (p.ids + a.ids + [eot], len(p.ids)))
    return results


# -----------------------------------------------------------------------------
# JSONL readers: the file, its lines, each a JSON object, each row (prompt messages, answer text)


class DataError(ValueError):
    """A bad data row: names the file, the 1-based line number and the field."""

    def __init__(self, path, line, field, problem):
        self.path, self.line, self.field, self.problem = str(path), line, field, problem
        super().__init__(f"{path}, line {line}" + (f", field '{field}'" if field else "") + f": {problem}")


class BadRow(Exception):
    """A problem with one row (field None: the row as a whole); load_dataset adds the file and line."""

    def __init__(self, field, problem):
        self.field, self.problem = field, problem


def check_data_file(path, fmt="auto"):
    """The Path of a data file, checked before any row is read: a known format, a regular file (a FIFO or /dev/zero
    would block or never end, a pipe cannot be hashed after), UTF-8 (UTF-16 / UTF-32 read as invalid JSON)."""
    path = Path(path)
    if fmt != "auto" and fmt not in FORMATS:
        raise ValueError(f"unknown data format {fmt!r}; choose one of {FORMATS} or 'auto'")
    if not path.exists():
        raise FileNotFoundError(f"data file {path} not found (expected JSONL: one JSON object per line)")
    with open_regular(path) as f:
        head = f.read(1 << 16)
    # UTF-16 / UTF-32: a byte order mark, or zero bytes (UTF-8 JSON holds none) where they put them beside ASCII
    zeros = [head[k::4].count(0) / max(len(head[k::4]), 1) for k in range(4)]  # at each position modulo 4
    odd, even = (zeros[1] + zeros[3]) / 2, (zeros[0] + zeros[2]) / 2
    name = next((name for mark, name in BOMS if head.startswith(mark)), None)
    if name:
        what = f"starts with a {name} byte order mark"
    elif min(zeros[1:]) > 0.9 or min(zeros[:3]) > 0.9:
        what, name = ("looks like UTF-32 (three bytes of every four are 0)",
                      "UTF-32LE" if min(zeros[1:]) > 0.9 else "UTF-32BE")
    elif max(odd, even) > 0.3 and min(odd, even) < 0.05:
        what, name = ("looks like UTF-16 (every other byte is 0) without a byte order mark",
                      "UTF-16LE" if odd > even else "UTF-16BE")
    if name:
        raise ValueError(f"data file {path} is not UTF-8: it {what}; JSONL must be UTF-8 (convert it, e.g. "
                         f"iconv -f {name} -t UTF-8 {path.name} > {path.stem}.utf8.jsonl)")
    return path


def read_data_file(path, max_bytes=MAX_FILE_BYTES):
    """A whole data file's bytes (eval.py's, hashed as read) after check_data_file, refused beyond max_bytes."""
    path = check_data_file(path)
    with open_regular(path) as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ValueError(f"data file {path} is larger than {max_bytes >> 20} MiB, more than a test file holds; give "
                         "the benchmark's test split")
    return raw


def data_text(path, raw):
    """A data file's bytes as UTF-8 text (a BOM accepted, as in training), or a ValueError naming the file and line."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line, column = raw[:e.start].count(b"\n") + 1, e.start - raw.rfind(b"\n", 0, e.start)
        raise ValueError(f"{path}, line {line}: not UTF-8 (byte {column} of the line)") from None


def file_lines(f, limit):
    """(line number, bytes, whole) per line of the binary file f; one over `limit` bytes is cut, its rest skipped."""
    for line_no, raw in enumerate(iter(lambda: f.readline(-1 if limit is None else limit + 1), b""), start=1):
        whole = limit is None or len(raw) <= limit or raw.endswith(b"\n")
        yield line_no, raw, whole
        while not whole and raw and not raw.endswith(b"\n"):  # skip the rest of a cut line, to the next line break
            raw = f.readline(1 << 20)


def check_cr_only(path, line_no, raw):
    """A ValueError for the file when its first line has CR breaks inside and no LF (the file reads as one line)."""
    if line_no == 1 and not raw.endswith(b"\n") and CR_BREAK.search(raw):
        raise ValueError(f"data file {path}: its lines end in CR only (\\r, classic Mac line breaks), so it reads "
                         "as one line; JSONL lines end in LF or CRLF (convert it, e.g. tr '\\r' '\\n')") from None


def json_object(path, line_no, raw):
    """One JSONL line (bytes) as a JSON object, for training and benchmark files alike, or a BadRow saying why not."""
    def unique_keys(pairs):  # an object, refusing a key given twice (json.loads keeps the last silently)
        if twice := [key for key, n in collections.Counter(key for key, _ in pairs).items() if n > 1]:
            raise BadRow(None, f"the key {twice[0]!r} is given twice (which one is meant?)")
        return dict(pairs)

    try:
        line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise BadRow(None, f"not UTF-8 (byte {e.start + 1} of the line)") from None
    try:
        row = json.loads(line, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as e:
        check_cr_only(path, line_no, raw)
        raise BadRow(None, f"invalid JSON ({e.msg}, column {e.colno})"
                     + ("; the line holds CR (\\r) line breaks" if CR_BREAK.search(raw) else "")) from None
    except RecursionError:  # JSON nested deeper than the parser's recursion limit
        raise BadRow(None, "nested too deeply to read (a Python RecursionError); a row is an object of strings and "
                           "lists of turns") from None
    except ValueError:  # an integer of more digits than int() reads (Python's message is a paragraph, with no line)
        raise BadRow(None, f"holds an integer of more than {sys.get_int_max_str_digits()} digits, more than Python "
                           "reads; write it as a string") from None
    if not isinstance(row, dict):
        raise BadRow(None, f"expected a JSON object, got a {type(row).__name__}")
    return row


def detect_format(row):
    """The format of one JSONL row (json_object), from its field names."""
    for key, fmt in (("messages", "messages"), ("deepseek_thinking_trajectory", "s1k-1.1"),
                     ("thinking_trajectories", "s1k"), ("prompt", "prompt-response"), ("response", "prompt-response")):
        if key in row:
            return fmt
    raise BadRow(None, f"cannot tell the format from the fields {sorted(row)}: expected 'messages', 'prompt' + "
                        "'response', s1K's 'question' + 'thinking_trajectories' + 'attempt', or s1K-1.1's 'question' + "
                        f"'deepseek_thinking_trajectory' + 'deepseek_attempt' (or force a format: fmt in {FORMATS})")


def special_text(tokenizer):
    """A regex of the texts the tokenizer reads as special tokens (added tokens flagged special, the chat format's) but
    the mask (encode_examples refuses that one), None without any: parse_row refuses them in a row's text."""
    fmt = CHAT_FORMATS[chat_format(tokenizer)]
    added = tokenizer.get_added_tokens_decoder().values()
    tokens = {t.content for t in added if t.special or t.content in fmt.specials} - {fmt.mask}
    return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True)))) if tokens else None


def parse_row(row, fmt, specials=None):
    """A JSON object -> (prompt messages, answer), or a BadRow naming the field (also for a text matching specials)."""
    def get(obj, key, field=None):
        try:
            return obj[key]
        except KeyError:
            raise BadRow(field or key, "missing") from None

    def text(obj, key, field=None, allow_empty=False, answer=False):  # obj[key], a string
        value, field = get(obj, key, field), field or key
        if not isinstance(value, str):
            raise BadRow(field, f"must be a string, got {type(value).__name__}")
        if not allow_empty and not value.strip():
            raise BadRow(field, "is empty")
        found = specials and specials.search(END_PADDING.sub("", value) if answer else value)  # may end padded
        if found:  # encoded, it would be the token itself: a turn the row does not have, or an answer ended early
            raise BadRow(field, f"holds the special token {found.group()!r} as text, which the tokenizer reads as "
                                "that token itself (a fake chat turn or an early end); remove it")
        return value

    if fmt == "messages":  # train on the last turn, which must be the assistant's; all earlier turns are the prompt
        messages = get(row, "messages")
        if not isinstance(messages, list) or len(messages) < 2:
            raise BadRow("messages", "must be a list of at least 2 {role, content} turns, the last the assistant's")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise BadRow(f"messages[{i}]", f"must be an object with role and content, got {type(m).__name__}")
            if text(m, "role", f"messages[{i}].role") not in ROLES:
                raise BadRow(f"messages[{i}].role", f"{m['role']!r} is not one of {ROLES}")
            last = i == len(messages) - 1
            text(m, "content", f"messages[{i}].content", allow_empty=not last, answer=last)  # the answer: not empty
        if messages[-1]["role"] != "assistant":
            raise BadRow(f"messages[{len(messages) - 1}].role", "the last turn must be the assistant's answer")
        return [{"role": m["role"], "content": m["content"]} for m in messages[:-1]], messages[-1]["content"]
    if fmt == "prompt-response":
        return [{"role": "user", "content": text(row, "prompt")}], text(row, "response", answer=True)
    if fmt in ("s1k", "s1k-1.1"):  # d1 / wd1's SFT formatting of s1K (SFT/sft_trainer.py)
        question = text(row, "question")
        if fmt == "s1k":
            traces = get(row, "thinking_trajectories")
            if not isinstance(traces, list) or not traces:
                raise BadRow("thinking_trajectories", "must be a non-empty list of strings, got "
                             + ("[]" if isinstance(traces, list) else type(traces).__name__))
            trace, attempt = text(traces, 0, "thinking_trajectories[0]"), text(row, "attempt")
        else:
            trace, attempt = text(row, "deepseek_thinking_trajectory"), text(row, "deepseek_attempt")
        user = SFT_SYSTEM_PROMPT + "\n\n" + question
        return [{"role": "user", "content": user}], f"<reasoning>{trace}</reasoning>\n<answer>{attempt}</answer>"
    raise ValueError(f"unknown data format {fmt!r}; choose one of {FORMATS} or 'auto'")


def max_token_chars(tokenizer):
    """The most characters one token stands for: the longest vocabulary entry, x 4 when the tokenizer normalizes first
    (NFC composes at most 4 code points into one). A text longer than max_len x this cannot fit max_len tokens."""
    longest = max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return longest * (4 if tokenizer.normalizer is not None else 1)


def load_dataset(path, tokenizer, fmt="auto", max_len=4096, skip_bad_rows=False):
    """A JSONL file's examples (ids, prompt_len), ids an int32 tensor (a Python list costs 9x, too much for Tulu 3 on 8
    ranks), and stats: the format and the counts of rows, examples, tokens, bad rows skipped (skip_bad_rows; else a
    DataError names file, line and field) and examples longer than max_len, dropped (not truncated; None keeps all)."""
    path = check_data_file(path, fmt)
    # a longer text than max_chars is dropped untokenized (20 MB cost ~8 GB in the tokenizer), a longer line unread
    max_chars = None if max_len is None else max_len * max_token_chars(tokenizer)
    max_bytes = None if max_len is None else max(MAX_LINE_BYTES, 64 * max_chars)
    specials = special_text(tokenizer)
    stats = dict(path=str(path), format=None if fmt == "auto" else fmt, rows=0, examples=0, tokens=0,
                 skipped_bad_rows=0, dropped_too_long=0, bad_rows=[])
    examples, pending = [], []  # pending: (line number, (messages, answer)) not yet tokenized

    def bad_row(line_no, bad):  # raise, or skip and count
        if not skip_bad_rows:
            flush()  # an earlier row that cannot be tokenized is reported first
            raise DataError(path, line_no, bad.field, bad.problem + " (fix the row, or skip and count bad "
                            "rows with skip_bad_rows=True / --skip-bad-rows)") from None
        stats["skipped_bad_rows"] += 1
        if len(stats["bad_rows"]) < MAX_BAD_ROWS_KEPT:
            stats["bad_rows"].append(str(DataError(path, line_no, bad.field, bad.problem)))

    def flush():  # tokenize the pending rows; text the tokenizer cannot encode is a bad row; drop the too-long ones
        rows, pending[:] = pending[:], []  # emptied first, so the flush() of a bad_row() below finds nothing to do
        for (line_no, _), result in zip(rows, encode_examples(tokenizer, [pair for _, pair in rows], bad_rows=True)):
            if isinstance(result, BadRow):
                bad_row(line_no, result)
            elif max_len is not None and len(result[0]) > max_len:
                stats["dropped_too_long"] += 1
            else:
                examples.append((torch.tensor(result[0], dtype=torch.int32), result[1]))
                stats["tokens"] += len(result[0])

    with open_regular(path) as f:  # bytes: a line that is not UTF-8 is one bad row, not the end of the file
        for line_no, raw, whole in file_lines(f, max_bytes):
            if not raw.strip():
                continue
            stats["rows"] += 1
            if not whole:  # more than max_bytes: it cannot fit max_len tokens
                check_cr_only(path, line_no, raw)
                stats["dropped_too_long"] += 1
                continue
            try:
                row = json_object(path, line_no, raw)
                row_format = stats["format"] or detect_format(row)  # the first good row fixes the file's
                messages, answer = parse_row(row, row_format, specials)
            except BadRow as bad:
                bad_row(line_no, bad)
                continue
            stats["format"] = row_format
            if max_chars is not None and (sum(len(m["content"].strip()) for m in messages) + len(answer.strip())
                                          > max_chars):  # cannot fit max_len tokens: not worth tokenizing
                stats["dropped_too_long"] += 1
                continue
            pending.append((line_no, (messages, answer)))
            if len(pending) == ENCODE_CHUNK:
                flush()
    flush()
    stats["examples"] = len(examples)
    if not examples:
        raise ValueError(f"{path}: no usable example ({stats['rows']} rows, {stats['skipped_bad_rows']} skipped as "
                         f"bad, {stats['dropped_too_long']} longer than max_len={max_len} tokens)")
    return examples, stats


def data_fingerprint(examples):
    """sha256 of the tokenised examples in order (ids, prompt lengths): it follows the content, format, tokenizer and
    --max-len, not the file's path or date."""
    h = hashlib.sha256()
    for ids, prompt_len in examples:
        ids = torch.as_tensor(ids, dtype=torch.int64)  # a list or load_dataset's int32 tensor, read in C
        h.update(array.array("q", (len(ids), prompt_len)).tobytes())
        h.update(ids.numpy().tobytes())
    return h.hexdigest()[:16]


# -----------------------------------------------------------------------------
# Batches: each epoch's order and steps, each step split over ranks and micro-batches, each example's noise


SEED_MIX = 1_000_003  # a prime: seed * SEED_MIX + n seeds draw stream n (an epoch, an item) under a user's seed


def mixed_seed(seed, n):
    """The generator seed of draw stream `n` (an epoch's order, an eval item's noise) under a user's `seed`."""
    return seed * SEED_MIX + n


def collate(examples, pad_id, pad_to=None):
    """[(ids, prompt_len)] -> input_ids (B, L) long, answer_mask (B, L) bool (the positions >= prompt_len), right-padded
    with pad_id to the longest example, or to pad_to (d1 / wd1 pad every example to 4096, which changes what GIFT's
    beta_ref averages over)."""
    if not examples:
        raise ValueError("collate got no examples (an empty micro-batch needs a zero-weight dummy row instead)")
    longest = max(len(ids) for ids, _ in examples)
    L = longest if pad_to is None else pad_to
    if longest > L:
        raise ValueError(f"an example has {longest} tokens, more than pad_to={pad_to}")
    input_ids = torch.full((len(examples), L), pad_id, dtype=torch.long)  # (B, L)
    for i, (ids, _) in enumerate(examples):
        input_ids[i, :len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    prompt_lengths = torch.tensor([prompt_len for _, prompt_len in examples], dtype=torch.long)  # (B,)
    return input_ids, torch.arange(L)[None] >= prompt_lengths[:, None]


def epoch_order(n, epoch, seed):
    """A fresh permutation of range(n) for each epoch, the same on every rank (every rank holds the dataset)."""
    generator = torch.Generator().manual_seed(mixed_seed(seed, epoch))
    return torch.randperm(n, generator=generator).tolist()


def step_batches(order, global_batch):
    """The epoch's optimizer steps: consecutive chunks of global_batch indices; the last may be short."""
    return [order[i:i + global_batch] for i in range(0, len(order), global_batch)]


def split_even(items, k):
    """k consecutive parts whose sizes differ by at most one, the larger first (like numpy.array_split)."""
    size, extra = divmod(len(items), k)
    bounds = [i * size + min(i, extra) for i in range(k + 1)]
    return [items[bounds[i]:bounds[i + 1]] for i in range(k)]


def rank_micro_batches(step_indices, rank, world_size, micro_batch, accum):
    """This rank's share of one optimizer step, as exactly `accum` micro-batches (lists of example indices): the step
    is split into `accum` consecutive global micro-batches, global micro-batch j into `world_size` consecutive parts,
    part r going to rank r, so that the union over ranks is the single-process micro-batch j. The short last step of
    an epoch is spread evenly: a micro-batch may be EMPTY (step_micro_batches makes it a zero-weight dummy row, which
    keeps the DDP / FSDP2 collectives of every rank in step)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    if len(step_indices) > world_size * micro_batch * accum:
        raise ValueError(f"a step of {len(step_indices)} examples does not fit world_size {world_size} x "
                         f"micro_batch {micro_batch} x accum {accum}")
    return [split_even(chunk, world_size)[rank] for chunk in split_even(list(step_indices), accum)]


@functools.lru_cache(maxsize=1)
def epoch_batches(n_examples, epoch, seed, global_batch):
    """Epoch `epoch`'s optimizer steps (epoch_order cut by step_batches), cached while the epoch runs."""
    return step_batches(epoch_order(n_examples, epoch, seed), global_batch)


def example_generator(seed, epoch, index, device):
    """Example `index`'s noise in `epoch` (its t and its mask), from its own seed: the same for any batch layout."""
    return torch.Generator(device=device).manual_seed(mixed_seed(seed, epoch) * 10_000_019 + index)


@dataclass
class Split:
    """How a global batch is split: over `world` ranks (this one `rank`), `accum` micro-batches of `micro_batch`."""
    rank: int
    world: int
    micro_batch: int
    accum: int


def step_micro_batches(examples, step_indices, epoch, split, pad_id, device, seed, pad_to=0):
    """This rank's `split.accum` micro-batches of one optimizer step on `device`, each a dict of gift.MicroBatch's
    fields: input_ids and answer_mask (B, L), generators (example_generator's, one per row), real, indices. Micro-batch
    j is padded to its longest example over ALL ranks (pads are trained on: N ranks must pad as one process does), or
    to pad_to > 0. An empty micro-batch becomes a zero-weight dummy row (real=False)."""
    everyone = [rank_micro_batches(step_indices, r, split.world, split.micro_batch, split.accum)
                for r in range(split.world)]
    batches = []
    for j, indices in enumerate(everyone[split.rank]):
        rows = indices or [step_indices[0]]
        L = pad_to or max(len(examples[i][0]) for i in rows + [i for part in everyone for i in part[j]])
        input_ids, answer_mask = collate([examples[i] for i in rows], pad_id, pad_to=L)
        batches.append(dict(input_ids=input_ids.to(device), answer_mask=answer_mask.to(device),
                            generators=[example_generator(seed, epoch, i, device) for i in rows], real=bool(indices),
                            indices=rows))
    return batches


# -----------------------------------------------------------------------------
# The command line: check a dataset


def show_example(tokenizer, example):
    """Print a training example (ids, prompt_len) as the model sees it: its prompt, then its answer."""
    ids, prompt_len = [int(i) for i in example[0]], example[1]
    print(f"first example: {len(ids)} tokens, {prompt_len} in the prompt")
    print("--- prompt ---\n" + tokenizer.decode(ids[:prompt_len], skip_special_tokens=False))
    print("--- answer ---\n" + tokenizer.decode(ids[prompt_len:], skip_special_tokens=False))


def main():
    parser = argparse.ArgumentParser(description="Check a JSONL dataset: its format, counts and first example.")
    parser.add_argument("--data", required=True, help="JSONL file")
    parser.add_argument("--model", required=True, help="model folder holding tokenizer.json")
    parser.add_argument("--data-format", default="auto", choices=("auto",) + FORMATS, help="row format")
    parser.add_argument("--max-len", type=int, default=4096, help="longer examples are dropped and counted")
    parser.add_argument("--skip-bad-rows", action="store_true", help="skip and count bad rows instead of failing")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    examples, stats = load_dataset(args.data, tokenizer, args.data_format, args.max_len, args.skip_bad_rows)
    print(json.dumps(stats, indent=1))
    show_example(tokenizer, examples[0])


if __name__ == "__main__":
    main()
