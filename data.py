"""Data for GIFT fine-tuning of LLaDA: tokenizer, chat format, JSONL readers. Batching and sharding are its section
"Batches"; the built-in 4x4 Sudoku task (the embedded default's data) is embedded.py's.

A training example is `(ids, prompt_len)`: the token ids of prompt + answer + <|eot_id|>, and the number of prompt
tokens. Positions >= prompt_len are the answer; batches are right-padded with <|endoftext|>, and the pads count as
answer (they are noised and trained on, as in LLaDA's SFT, so the model learns where to stop).

    python data.py --data train.jsonl --model /ckpt/LLaDA-8B-Instruct   # check a dataset: format, counts, example
"""

import argparse
import array
import functools
import hashlib
import json
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, models

from dream import qwen2_tokenizer
from model import read_json_file

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
CR_BREAK = re.compile(rb"\r[ \t]*[^\s]")  # a line break of CR alone (classic Mac files read as one line)

# d1 / wd1's instruction before each s1K question (github.com/dllm-reasoning/d1, SFT/sft_trainer.py; a test checks it)
SFT_SYSTEM_PROMPT = ("\nRespond in the following format:\n<reasoning>\nYour reasoning here\n</reasoning>\n"
                     "<answer>\n...\n</answer>\n")

# d1's Sudoku question without its long instruction (d1 adds a trailing "\n" that the chat format strips anyway):
# eval.py's SUDOKU_QUESTION; also the embedded task's prompt (embedded.py), short enough for a tiny model on a CPU
SUDOKU_TASK_PROMPT = "Solve the following Sudoku puzzle: {puzzle}"

# -----------------------------------------------------------------------------
# Tokenizer and special ids


def load_tokenizer(model_dir):
    """The `tokenizers` tokenizer of a model folder: its tokenizer.json, or in a folder without one (Dream-v0's), the
    slow Qwen2 tokenizer's vocab.json, merges.txt and tokenizer_config.json, built as transformers builds them."""
    folder = Path(model_dir)
    path = folder / "tokenizer.json"
    if path.is_file():
        tokenizer = _tokenizer_json(path)
    elif (folder / "vocab.json").is_file():
        tokenizer = qwen2_tokenizer(folder)
    else:
        raise FileNotFoundError(f"{path} not found: the model folder must hold the Hugging Face tokenizer.json (or, "
                                "as Dream-v0's, a Qwen2 tokenizer's vocab.json and merges.txt)")
    tokenizer.no_truncation()  # too-long examples are dropped and counted by load_dataset, never cut
    tokenizer.no_padding()  # padding happens in collate
    return tokenizer


def _tokenizer_json(path):
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception; say whether the JSON or its content is wrong
        read_json_file(path)
        raise ValueError(f"{path}: valid JSON, but not a tokenizer the `tokenizers` library reads ({e}); it must be "
                         "a Hugging Face tokenizer.json (not tokenizer_config.json or a sentencepiece model)") from None


def encode(tokenizer, text):
    """Text -> ids, exactly the tokens of `text`: special tokens are matched in it, nothing (no BOS) is added."""
    return tokenizer.encode(text, add_special_tokens=False).ids


def _token_id(tokenizer, token):
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
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
    """Which chat format a tokenizer is for: "chatml" (Dream-v0, Qwen2.5: it has <|im_start|> or <|im_end|>; a
    missing one of the two is then named as ChatML's) or "llada"."""
    return "chatml" if {tokenizer.token_to_id(IM_START), tokenizer.token_to_id(IM_END)} != {None} else "llada"


def _encoding(tokenizer, text):
    """tokenizer.encode(text) as encode() does, or None where it raises (a character with no token: the tokenizer's
    "Missing [UNK] token")."""
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    except Exception:
        return None


def check_chat_tokens(tokenizer, where, hint=""):
    """The chat format's tokens each read in text as one token, or a one-line ValueError naming `where` (the
    tokenizer's folder or file). chat_prompt writes them as text: a missing token, or one that is only a plain
    vocabulary entry (not under 'added_tokens', so the BPE spells it out in pieces), turns the template into ordinary
    characters the model never saw as one. The one check of gift.py, sample.py and eval.py. Returns {token: id}."""
    fmt = chat_format(tokenizer)
    ids = {token: tokenizer.token_to_id(token) for token in CHAT_FORMATS[fmt].text_tokens.values()}
    missing = [token for token, token_id in ids.items() if token_id is None]
    if missing:
        what = ("of ChatML's format (Dream's), whose other tokens it has" if fmt == "chatml" else
                f"it is neither LLaDA's nor Dream's (ChatML, {IM_START})")
        raise ValueError(f"{where}: its tokenizer has no chat token {', '.join(missing)}: {what}, so there is no chat "
                         f"format to wrap the prompt in{hint}")
    encodings = {token: _encoding(tokenizer, token) for token in ids}
    split = [token for token, e in encodings.items() if e is None or e.ids != [ids[token]]]
    if split:
        raise ValueError(f"{where}: its tokenizer does not read {', '.join(split)} in text as one token (a plain "
                         "vocabulary entry, spelled out in pieces); it must be listed under 'added_tokens' in "
                         f"tokenizer.json{hint}")
    return ids


def special_ids(tokenizer, config, where="the tokenizer"):
    """mask / eos / pad from the model config (config.json), the chat-format tokens from the tokenizer (checked:
    check_chat_tokens, naming `where`, the tokenizer's folder). A full model config (one with embedding_size, e.g.
    LLaDAConfig) is also checked against the tokenizer (check_mask_token)."""
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
    """config.json's token ids against the model and the tokenizer: each a row of the embedding, and mask_token_id
    the id of the tokenizer's <|mdm_mask|> (when it has one) and never an ordinary text token, which the model could
    not tell apart from a masked position."""
    E = config.embedding_size
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > E:  # its last ids would index past the embedding (an IndexError, or a CUDA assert, mid-generation)
        raise ValueError(f"the tokenizer has {size} tokens (ids up to {size - 1}) but the model's embedding only "
                         f"{E} rows (config.json embedding_size = {E}): tokenizer.json and config.json come from "
                         "different models")
    for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
        if not 0 <= getattr(config, name) < E:
            raise ValueError(f"config.json field {name!r} = {getattr(config, name)} is outside the embedding "
                             f"(embedding_size = {E}: ids 0 .. {E - 1}); config.json belongs to another model?")
    mask_id, (mask, tokenizer_mask_id) = config.mask_token_id, mask_token(tokenizer)
    if tokenizer_mask_id is not None and tokenizer_mask_id != mask_id:
        raise ValueError(f"config.json field 'mask_token_id' = {mask_id}, but the tokenizer's {mask!r} token is id "
                         f"{tokenizer_mask_id}: tokenizer.json and config.json come from different models (or set "
                         f"mask_token_id to {tokenizer_mask_id})")
    token, added = tokenizer.id_to_token(mask_id), tokenizer.get_added_tokens_decoder()
    if token is not None and not (mask_id in added and added[mask_id].special):
        raise ValueError(f"config.json field 'mask_token_id' = {mask_id} is the tokenizer's ordinary token {token!r}, "
                         f"which text produces; the mask must be a special token ({MASK!r} in LLaDA's tokenizer.json, "
                         f"{DREAM_MASK!r} in Dream's)")


# -----------------------------------------------------------------------------
# Chat formats: LLaDA-8B-Instruct's (Llama 3's headers) and Dream-v0's (Qwen2.5's ChatML); the tokenizer says which


def chat_prompt(messages, fmt="llada"):
    """The chat template, written out: each turn, then the header of the assistant turn that the answer (or
    generation) follows. `messages` is a list of {"role", "content"}; fmt is chat_format(tokenizer).
    "llada", LLaDA-8B-Instruct's: BOS once, each turn with its header. The official Jinja template appends
    '<|start_header_id|>assistant<|end_header_id|>\\n\\n' after EVERY conversation, even one ending with the
    answer (so do d1's and wd1's SFT sequences); ours ends a training sequence with the answer's <|eot_id|> and pads.
    "chatml", Dream-v0's (Qwen2.5's tokenizer_config.json template): a system turn CHATML_SYSTEM first when the
    messages have none, then '<|im_start|>assistant\\n'."""
    if fmt == "chatml":
        system = [] if messages and messages[0]["role"] == "system" else [dict(role="system", content=CHATML_SYSTEM)]
        turns = "".join(f"{IM_START}{m['role']}\n{m['content'].strip()}{IM_END}\n" for m in system + list(messages))
        return turns + f"{IM_START}assistant\n"
    text = BOS
    for m in messages:
        text += f"{START_HEADER}{m['role']}{END_HEADER}\n\n{m['content'].strip()}{EOT}"
    return text + f"{START_HEADER}assistant{END_HEADER}\n\n"


def encode_prompt(tokenizer, messages):
    """The ids a model is given to answer `messages` (for generation), in the tokenizer's chat format."""
    return encode(tokenizer, chat_prompt(messages, chat_format(tokenizer)))


def _unknown_token(tokenizer):
    """(token, id) of the tokenizer's unknown token, or (None, None) when it has none (LLaDA's byte-level BPE)."""
    unk = getattr(tokenizer.model, "unk_token", None)  # BPE, WordPiece, WordLevel
    if isinstance(tokenizer.model, models.Unigram):  # Unigram keeps an id instead
        unk_id = json.loads(tokenizer.to_str())["model"].get("unk_id")
        return (None, None) if unk_id is None else (tokenizer.id_to_token(unk_id), unk_id)
    return unk, tokenizer.token_to_id(unk) if unk else None


def _around(text, start, end):
    return f"{text[start:end]!r} (U+{ord(text[start]):04X}) in ...{text[max(0, start - 20):end + 20]!r}..."


def _unencodable(tokenizer, text, unk):
    """{character: its first position} for each character of `text` outside its special tokens (such as <|eot_id|>)
    that the tokenizer has no faithful token for: encoding it alone raises (a vocabulary without an unknown token,
    as the embedded task's character-level one) or gives the unknown token. In order of appearance."""
    unk_token, unk_id = unk
    added = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values()), key=len, reverse=True)
    spans = [m.span() for m in re.finditer("|".join(map(re.escape, added)), text)] if added else []
    readable, bad = {}, {}
    for pos, ch in enumerate(text):
        if ch in readable or any(a <= pos < b for a, b in spans):
            continue
        encoding = _encoding(tokenizer, ch)
        readable[ch] = encoding is not None and not (unk_id is not None and unk_id in encoding.ids and ch != unk_token)
        if not readable[ch]:
            bad[ch] = pos
    return bad


def _unreadable(tokenizer, text, encoding, unk):
    """Why `text` has no faithful encoding (None when it has): a character with no token, found in `encoding`
    read as the unknown token, or, when encoding is None (encode raised), as the first character that fails alone."""
    unk_token, unk_id = unk
    if encoding is None:
        bad = _unencodable(tokenizer, text, unk)
        if not bad:
            return "cannot be tokenized"
        pos = next(iter(bad.values()))
        return f"has {_around(text, pos, pos + 1)}, a character the tokenizer has no token for"
    if unk_id is not None and unk_id in encoding.ids:
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
            if token_id == unk_id and text[start:end] != unk_token:  # the literal unknown token in text is fine
                return f"has {_around(text, start, end)}, which the tokenizer reads as its unknown token {unk_token!r}"
    return None


def unencodable_characters(tokenizer, text):
    """The distinct characters of `text` (outside its special tokens, in order of appearance) that the tokenizer has
    no faithful token for. [] for LLaDA's byte-level BPE, which encodes any text."""
    return list(_unencodable(tokenizer, text, _unknown_token(tokenizer)))


def mask_token(tokenizer):
    """(text, id) of the tokenizer's diffusion mask token (<|mdm_mask|>, Dream's <|mask|>); id None without one."""
    text = CHAT_FORMATS[chat_format(tokenizer)].mask
    return text, tokenizer.token_to_id(text)


def _holds_mask(encoding, mask):
    """Why an encoded text cannot be a prompt or an answer, or None: it holds the mask token (its literal text), which
    the model would read as a position to fill in, and training would teach as a clean token."""
    if encoding is not None and mask[1] is not None and mask[1] in encoding.ids:
        return f"holds the mask token {mask[0]!r} as text (the model reads it as a masked position); remove it"
    return None


def mask_in_text(tokenizer, text):
    """_holds_mask for a text: why it cannot be given to the model, or None."""
    return _holds_mask(tokenizer.encode(text, add_special_tokens=False), mask_token(tokenizer))


def encode_text(tokenizer, text, what="the prompt"):
    """encode(), refusing text the tokenizer cannot encode faithfully with a one-line ValueError that names the
    characters (and, for a small vocabulary such as the embedded task's, the alphabet the model can read), and text
    holding the mask token."""
    bad = unencodable_characters(tokenizer, text)
    if not bad:
        encoding = tokenizer.encode(text, add_special_tokens=False)  # as encode()
        problem = _holds_mask(encoding, mask_token(tokenizer))
        if problem:
            raise ValueError(f"{what} {problem}")
        return encoding.ids
    names = ", ".join(f"{ch!r} (U+{ord(ch):04X})" for ch in bad)
    alphabet = [t for t, _ in sorted(tokenizer.get_vocab(with_added_tokens=False).items(), key=lambda kv: kv[1])]
    hint = f"; this model reads only {''.join(alphabet)!r}" if len(alphabet) <= 256 else ""
    raise ValueError(f"{what} has characters this model's tokenizer cannot encode: {names}{hint}")


def encode_pairs(tokenizer, pairs):
    """[(messages, answer)] -> per pair (ids, prompt_len), or a BadRow when the tokenizer cannot encode its text (a
    character outside its vocabulary: it raises, or gives its unknown token). See encode_examples."""
    fmt = chat_format(tokenizer)
    eot = _token_id(tokenizer, CHAT_FORMATS[fmt].text_tokens["eot"])  # ends the answer's turn
    texts = [chat_prompt(messages, fmt) for messages, _ in pairs] + [answer.strip() for _, answer in pairs]
    try:
        encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    except Exception:  # some text holds a character with no token: find which
        encodings = [_encoding(tokenizer, text) for text in texts]
    unk, mask = _unknown_token(tokenizer), mask_token(tokenizer)
    n, results = len(pairs), []
    for p, a, p_text, a_text in zip(encodings[:n], encodings[n:], texts[:n], texts[n:]):
        where, problem = "the prompt", _unreadable(tokenizer, p_text, p, unk) or _holds_mask(p, mask)
        if problem is None:
            where, problem = "the answer", _unreadable(tokenizer, a_text, a, unk) or _holds_mask(a, mask)
        results.append(BadRow(None, f"{where} {problem}") if problem else (p.ids + a.ids + [eot], len(p.ids)))
    return results


def encode_examples(tokenizer, pairs):
    """[(messages, answer)] -> [(ids, prompt_len)], ids = prompt + answer + <|eot_id|>, tokenized in one batch.
    Prompt and answer are tokenized separately, so the prompt ids are exactly what generation is given
    (encode_prompt) and prompt_len is exact. The answer is stripped, as the official template trims every turn.
    Text the tokenizer cannot encode raises ValueError naming the example and the character."""
    results = encode_pairs(tokenizer, pairs)
    for i, result in enumerate(results):
        if isinstance(result, BadRow):
            raise ValueError(f"example {i}: {result.problem}")
    return results


def encode_example(tokenizer, messages, answer):
    """One training sequence: (prompt + answer + <|eot_id|> ids, prompt length)."""
    return encode_examples(tokenizer, [(messages, answer)])[0]


# -----------------------------------------------------------------------------
# JSONL readers. Each row becomes (prompt messages, answer text).


class DataError(ValueError):
    """A bad data row: names the file, the 1-based line number and the field."""

    def __init__(self, path, line, field, problem):
        self.path, self.line, self.field, self.problem = str(path), line, field, problem
        where = f"{path}, line {line}" + (f", field '{field}'" if field else "")
        super().__init__(f"{where}: {problem}")


class BadRow(Exception):
    """A problem with one row (field None: the row as a whole); load_dataset adds the file and line."""

    def __init__(self, field, problem):
        self.field, self.problem = field, problem


def _get(obj, key, field=None):
    if key not in obj:
        raise BadRow(field or key, "missing")
    return obj[key]


# an answer's padding of turn ends or EOS, as LLaDA's SFT pads (experiments/countdown.py's fixed-length answers)
END_PADDING = re.compile(f"(?:{re.escape(EOT)}|{re.escape(IM_END)}|{re.escape(EOS)})+$")


def _text(value, field, allow_empty=False, specials=None, answer=False):
    if not isinstance(value, str):
        raise BadRow(field, f"must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise BadRow(field, "is empty")
    found = specials and specials.search(END_PADDING.sub("", value) if answer else value)  # an answer may end padded
    if found:  # encoded, it would be the token itself: a turn the row does not have, or an answer ended early
        raise BadRow(field, f"holds the special token {found.group()!r} as text, which the tokenizer reads as that "
                            "token itself (a fake chat turn or an early end); remove it")
    return value


def special_text(tokenizer):
    """A regex of the texts the tokenizer reads as special tokens (its added tokens flagged special, the chat format's)
    but the mask (encode_pairs refuses that one); None when there are none. parse_row refuses them in a row's text."""
    fmt = CHAT_FORMATS[chat_format(tokenizer)]
    added = tokenizer.get_added_tokens_decoder().values()
    tokens = {t.content for t in added if t.special or t.content in fmt.specials} - {fmt.mask}
    return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True)))) if tokens else None


def _s1k_pair(question, trace, attempt):
    # d1 / wd1's SFT formatting of s1K (SFT/sft_trainer.py)
    user = SFT_SYSTEM_PROMPT + "\n\n" + question
    return [{"role": "user", "content": user}], f"<reasoning>{trace}</reasoning>\n<answer>{attempt}</answer>"


def detect_format(row):
    """The format of one JSONL row (json_object), from its field names."""
    if "messages" in row:
        return "messages"  # Tulu 3, open-r1 Mixture-of-Thoughts, ...
    if "deepseek_thinking_trajectory" in row:
        return "s1k-1.1"
    if "thinking_trajectories" in row:
        return "s1k"
    if "prompt" in row or "response" in row:
        return "prompt-response"
    raise BadRow(None, f"cannot tell the format from the fields {sorted(row)}: expected 'messages', "
                        "'prompt' + 'response', s1K's 'question' + 'thinking_trajectories' + 'attempt', or s1K-1.1's "
                        "'question' + 'deepseek_thinking_trajectory' + 'deepseek_attempt' (or force a format: "
                        f"fmt in {FORMATS})")


def parse_row(row, fmt, specials=None):
    """One JSON object (json_object) -> (prompt messages, answer). Raises BadRow naming the field, also for a text
    holding a match of `specials` (special_text)."""
    text = functools.partial(_text, specials=specials)
    if fmt == "messages":  # train on the last turn, which must be the assistant's; all earlier turns are the prompt
        messages = _get(row, "messages")
        if not isinstance(messages, list) or len(messages) < 2:
            raise BadRow("messages", "must be a list of at least 2 {role, content} turns, the last the assistant's")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise BadRow(f"messages[{i}]", f"must be an object with role and content, got {type(m).__name__}")
            role = text(_get(m, "role", f"messages[{i}].role"), f"messages[{i}].role")
            if role not in ROLES:
                raise BadRow(f"messages[{i}].role", f"{role!r} is not one of {ROLES}")
            content = f"messages[{i}].content"
            last = i == len(messages) - 1
            text(_get(m, "content", content), content, allow_empty=not last, answer=last)  # the answer: not empty
        if messages[-1]["role"] != "assistant":
            raise BadRow(f"messages[{len(messages) - 1}].role", "the last turn must be the assistant's answer")
        return [{"role": m["role"], "content": m["content"]} for m in messages[:-1]], messages[-1]["content"]
    if fmt == "prompt-response":
        prompt = text(_get(row, "prompt"), "prompt")
        return [{"role": "user", "content": prompt}], text(_get(row, "response"), "response", answer=True)
    if fmt == "s1k":
        question = text(_get(row, "question"), "question")
        traces = _get(row, "thinking_trajectories")
        if not isinstance(traces, list) or not traces:
            raise BadRow("thinking_trajectories", f"must be a non-empty list of strings, got {traces!r:.40}")
        trace = text(traces[0], "thinking_trajectories[0]")
        return _s1k_pair(question, trace, text(_get(row, "attempt"), "attempt"))
    if fmt == "s1k-1.1":
        question = text(_get(row, "question"), "question")
        trace = text(_get(row, "deepseek_thinking_trajectory"), "deepseek_thinking_trajectory")
        return _s1k_pair(question, trace, text(_get(row, "deepseek_attempt"), "deepseek_attempt"))
    raise ValueError(f"unknown data format {fmt!r}; choose one of {FORMATS} or 'auto'")


def max_token_chars(tokenizer):
    """The most characters one token can stand for: its vocabulary's longest entry (added tokens included), x 4 when
    the tokenizer normalizes first (NFC composes at most 4 code points into one). A longer text than max_len x this
    cannot fit max_len tokens: load_dataset drops it untokenized (20 MB of text cost ~8 GB in the tokenizer)."""
    longest = max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return longest * (4 if tokenizer.normalizer is not None else 1)


def file_lines(f, limit):
    """(line number, bytes, whole) for each line of the binary file f: a line longer than `limit` bytes (None: no
    limit) is cut there (whole False) and the rest of it skipped, never held in memory."""
    for line_no, raw in enumerate(iter(lambda: f.readline(-1 if limit is None else limit + 1), b""), start=1):
        whole = limit is None or len(raw) <= limit or raw.endswith(b"\n")
        rest = raw
        while not rest.endswith(b"\n") and rest and not whole:  # skip to the next line break
            rest = f.readline(1 << 20)
        yield line_no, raw, whole


def _file_kind(path):
    """What a path that is not a regular file is, in words."""
    mode = path.stat().st_mode
    return next((kind for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                                         (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                                         (stat.S_ISSOCK, "a socket")) if test(mode)), "something else")


def _wrong_encoding(head):
    """(what, encoding) when a data file's first bytes say it is UTF-16 or UTF-32, not UTF-8 (else None): a byte order
    mark, or zero bytes where those put them beside ASCII characters (UTF-8 JSON never holds a zero byte)."""
    for bom, name in ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
                      (b"\xfe\xff", "UTF-16")):
        if head.startswith(bom):
            return f"starts with a {name} byte order mark", name
    if b"\x00" not in head:
        return None
    zeros = [head[k::4].count(0) / max(len(head[k::4]), 1) for k in range(4)]  # at each position modulo 4
    if min(zeros[1:]) > 0.9 or min(zeros[:3]) > 0.9:
        return ("looks like UTF-32 (three bytes of every four are 0)",
                "UTF-32LE" if min(zeros[1:]) > 0.9 else "UTF-32BE")
    odd, even = (zeros[1] + zeros[3]) / 2, (zeros[0] + zeros[2]) / 2
    if max(odd, even) > 0.3 and min(odd, even) < 0.05:
        return ("looks like UTF-16 (every other byte is 0) without a byte order mark",
                "UTF-16LE" if odd > even else "UTF-16BE")
    return None


def check_data_file(path, fmt="auto"):
    """The checks of every data file gift.py, eval.py (--data, --shot-data) and data.py read, before any row is: the
    format's name, a regular file (a FIFO or /dev/zero would block or never end, and a pipe read once cannot be
    hashed after), UTF-8 (not UTF-16 / UTF-32, which read as invalid JSON). Returns the Path."""
    path = Path(path)
    if fmt != "auto" and fmt not in FORMATS:
        raise ValueError(f"unknown data format {fmt!r}; choose one of {FORMATS} or 'auto'")
    if not path.exists():
        raise FileNotFoundError(f"data file {path} not found (expected JSONL: one JSON object per line)")
    if not path.is_file():
        raise ValueError(f"data file {path} is not a regular file but {_file_kind(path)}; expected a JSONL file on "
                         "disk")
    with open(path, "rb") as f:
        wrong = _wrong_encoding(f.read(1 << 16))
    if wrong:
        raise ValueError(f"data file {path} is not UTF-8: it {wrong[0]}; JSONL must be UTF-8 (convert it, e.g. "
                         f"iconv -f {wrong[1]} -t UTF-8 {path.name} > {path.stem}.utf8.jsonl)")
    return path


def read_data_file(path, max_bytes=MAX_FILE_BYTES):
    """A whole data file's bytes (eval.py's test and shot files), after check_data_file, refused in one line beyond
    max_bytes rather than held in memory. What is hashed is what was read."""
    path = check_data_file(path)
    with open(path, "rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ValueError(f"data file {path} is larger than {max_bytes >> 20} MiB, more than a test file holds; give "
                         "the benchmark's test split")
    return raw


def data_text(path, raw):
    """A data file's bytes as text: UTF-8, a byte order mark accepted (as training reads it); a ValueError naming the
    file and line otherwise."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line, column = raw[:e.start].count(b"\n") + 1, e.start - raw.rfind(b"\n", 0, e.start)
        raise ValueError(f"{path}, line {line}: not UTF-8 (byte {column} of the line)") from None


def _unique_keys(pairs):
    """json.loads' object_pairs_hook: an object, refusing a key given twice (json.loads keeps the last silently)."""
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise BadRow(None, f"the key {key!r} is given twice (which one is meant?)")
        seen.add(key)
    return dict(pairs)


NESTED_TOO_DEEP = ("nested too deeply to read (a Python RecursionError); a row is an object of strings and "
                   "lists of turns")


def check_cr_only(path, line_no, raw):
    """A first line with CR breaks inside and no LF: the whole file reads as one line. ValueError for the file."""
    if line_no == 1 and not raw.endswith(b"\n") and CR_BREAK.search(raw):
        raise ValueError(f"data file {path}: its lines end in CR only (\\r, classic Mac line breaks), so it reads "
                         "as one line; JSONL lines end in LF or CRLF (convert it, e.g. tr '\\r' '\\n')") from None


def json_object(path, line_no, raw):
    """One JSONL line (bytes) as a JSON object, the one line reader of training and benchmark files: BadRow when it
    is not UTF-8 (a BOM accepted on line 1), not JSON (a file of CR-only line breaks refused whole), nested too deep,
    gives a key twice, or is not an object."""
    try:
        line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise BadRow(None, f"not UTF-8 (byte {e.start + 1} of the line)") from None
    try:
        row = json.loads(line, object_pairs_hook=_unique_keys)  # a key given twice: BadRow
    except json.JSONDecodeError as e:
        check_cr_only(path, line_no, raw)
        raise BadRow(None, f"invalid JSON ({e.msg}, column {e.colno})"
                     + ("; the line holds CR (\\r) line breaks" if CR_BREAK.search(raw) else "")) from None
    except RecursionError:  # JSON nested deeper than the parser's recursion limit
        raise BadRow(None, NESTED_TOO_DEEP) from None
    except ValueError:  # an integer of more digits than int() reads (Python's message is a paragraph, with no line)
        raise BadRow(None, f"holds an integer of more than {sys.get_int_max_str_digits()} digits, more than Python "
                           "reads; write it as a string") from None
    if not isinstance(row, dict):
        raise BadRow(None, f"expected a JSON object, got a {type(row).__name__}")
    return row


def read_row(path, line_no, raw, fmt, specials=None):
    """One JSONL line (bytes) -> (messages, answer, its format): fmt, or when None the row's (the first good row fixes
    the file's). BadRow when the line is no JSON object (json_object) or not a row of the format."""
    row = json_object(path, line_no, raw)
    try:
        fmt = fmt or detect_format(row)
        return (*parse_row(row, fmt, specials), fmt)
    except RecursionError:  # nested too deep for parse_row's walk or its repr (json_object's parse says it too)
        raise BadRow(None, NESTED_TOO_DEEP) from None


def load_dataset(path, tokenizer, fmt="auto", max_len=4096, skip_bad_rows=False):
    """A JSONL file's training examples and stats. examples: (ids, prompt_len), ids a 1-D int32 tensor (4 bytes a
    token; a Python list costs ~36, too much for Tulu 3 on 8 ranks). stats: the format (fmt, or with "auto" the first
    good row's) and the counts of rows, examples, tokens, skipped bad rows and examples longer than max_len, dropped
    (never truncated; max_len=None keeps all). A bad row raises DataError (file, line, field) unless skip_bad_rows,
    which skips and counts it. Blank lines are ignored."""
    path = check_data_file(path, fmt)
    # a row's text longer than max_chars cannot fit max_len tokens (max_token_chars): dropped untokenized
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
        rows = list(pending)
        pending.clear()  # first, so the flush() of a bad_row() below finds nothing left to do
        for (line_no, _), result in zip(rows, encode_pairs(tokenizer, [pair for _, pair in rows])):
            if isinstance(result, BadRow):
                bad_row(line_no, result)
                continue
            ids, prompt_len = result
            if max_len is not None and len(ids) > max_len:
                stats["dropped_too_long"] += 1
                continue
            examples.append((torch.tensor(ids, dtype=torch.int32), prompt_len))
            stats["tokens"] += len(ids)

    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is one bad row, not the end of the file
        for line_no, raw, whole in file_lines(f, max_bytes):
            if not raw.strip():
                continue
            stats["rows"] += 1
            if not whole:  # more than max_bytes: it cannot fit max_len tokens
                check_cr_only(path, line_no, raw)
                stats["dropped_too_long"] += 1
                continue
            try:
                messages, answer, stats["format"] = read_row(path, line_no, raw, stats["format"], specials)
            except BadRow as bad:
                bad_row(line_no, bad)
                continue
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
    """sha256 of the tokenised examples in order (token ids and prompt lengths): it changes with the file's content,
    its format, the tokenizer and --max-len, not with the file's path or date."""
    h = hashlib.sha256()
    for ids, prompt_len in examples:
        ids = torch.as_tensor(ids, dtype=torch.int64)  # a list or load_dataset's int32 tensor, read in C
        h.update(array.array("q", (len(ids), prompt_len)).tobytes())
        h.update(ids.numpy().tobytes())
    return h.hexdigest()[:16]


# -----------------------------------------------------------------------------
# Batches: each epoch's order and steps, each step split over ranks and micro-batches, each example's noise


def mixed_seed(seed, n):
    """longjob.mixed_seed, copied so that data.py imports no machinery (a test pins the two equal): the generator seed
    of draw stream `n` (an epoch's order and noise) under a user's `seed`."""
    return seed * 1_000_003 + n


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
    parser = argparse.ArgumentParser(description="Check a JSONL dataset (python embedded.py shows the embedded Sudoku "
                                                 "task's example).")
    parser.add_argument("--data", required=True, help="JSONL file")
    parser.add_argument("--model", help="model folder holding tokenizer.json (needed with --data)")
    parser.add_argument("--data-format", default="auto", choices=("auto",) + FORMATS, help="row format")
    parser.add_argument("--max-len", type=int, default=4096, help="longer examples are dropped and counted")
    parser.add_argument("--skip-bad-rows", action="store_true", help="skip and count bad rows instead of failing")
    args = parser.parse_args()
    if not args.model:
        parser.error("--data needs --model (the folder with tokenizer.json)")
    tokenizer = load_tokenizer(args.model)
    examples, stats = load_dataset(args.data, tokenizer, args.data_format, args.max_len, args.skip_bad_rows)
    print(json.dumps(stats, indent=1))
    show_example(tokenizer, examples[0])


if __name__ == "__main__":
    main()
