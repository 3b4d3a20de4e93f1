"""data.load_tokenizer on a folder with Dream-v0's slow Qwen2 tokenizer files and no tokenizer.json (vocab.json,
merges.txt, tokenizer_config.json): the same ids, decodings and added tokens as Hugging Face's Qwen2Tokenizer and
Qwen2TokenizerFast, stored in tests/data/dream_tokenizer/expected.json by its make_fixture.py (transformers 4.46.2,
which this test does not need); ChatML and the special ids on it; tokenizer.json first; one-line errors."""

import json
import shutil
import unicodedata

import pytest
import torch
from conftest import DATA
from tokenizers import Regex, pre_tokenizers

import data
import dream
import embedded
from model import LLaDA, LLaDAConfig

FOLDER = DATA / "dream_tokenizer"
FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")
EXPECTED = json.loads((FOLDER / "expected.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tok():
    return data.load_tokenizer(FOLDER)


def slow_folder(tmp_path, files=FILES):
    """A copy of the fixture's slow tokenizer files, to edit."""
    for name in files:
        shutil.copy(FOLDER / name, tmp_path / name)
    return tmp_path


def added_tokens(tokenizer):
    return [dict(id=i, content=t.content, special=t.special, normalized=t.normalized, lstrip=t.lstrip,
                 rstrip=t.rstrip, single_word=t.single_word)
            for i, t in sorted(tokenizer.get_added_tokens_decoder().items())]


def mismatches(tokenizer):
    """The fixture's strings that `tokenizer` encodes or decodes otherwise than Hugging Face's Qwen2 tokenizers."""
    bad = []
    for row in EXPECTED["strings"]:
        ids = data.encode(tokenizer, row["text"])
        if ids != row["ids"] or tokenizer.decode(ids, skip_special_tokens=False) != row["decoded"]:
            bad.append((row["text"], ids, row["ids"]))
    return bad


def test_encodings_equal_hugging_face(tok):
    """Spaces, newlines, digits one by one, contractions, non-ASCII, emoji, NFD input, special tokens in text."""
    assert not (FOLDER / "tokenizer.json").exists()
    assert len(EXPECTED["strings"]) >= 60
    assert mismatches(tok) == []
    for row in EXPECTED["strings"]:  # decode(encode(text)) is the text, NFC-normalized (as the tokenizer reads it)
        assert tok.decode(data.encode(tok, row["text"]), skip_special_tokens=False) == \
            unicodedata.normalize("NFC", row["text"])
    ids = data.encode(tok, "2024 12345")
    assert [tok.id_to_token(i) for i in ids] == ["2", "0", "2", "4", "Ġ", "1", "2", "3", "4", "5"]


def test_the_fixture_catches_a_wrong_pre_tokenization(tok):
    """The stored strings tell Qwen2's tokenizer from near misses: GPT-2's regex (digits grouped, a space joined to
    the next digit), a prefix space, no NFC normalization, digits grouped in Qwen2's own regex."""
    def variant(pre_tokenizer=None, normalizer=True):
        t = data.load_tokenizer(FOLDER)
        t.pre_tokenizer = pre_tokenizer or t.pre_tokenizer
        if not normalizer:
            t.normalizer = None
        return t

    def split(regex, prefix=False):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=False)])

    assert mismatches(variant(split(dream.QWEN2_SPLIT))) == []
    for wrong in (variant(pre_tokenizers.ByteLevel(add_prefix_space=False)), variant(normalizer=False),
                  variant(split(dream.QWEN2_SPLIT, prefix=True)),
                  variant(split(dream.QWEN2_SPLIT.replace(r"\p{N}|", r"\p{N}+|"))),
                  variant(split(dream.QWEN2_SPLIT.replace(r"\s*[\r\n]+|", r"[\r\n]+|")))):
        assert mismatches(wrong)


def test_added_tokens_equal_hugging_face(tok, tmp_path):
    """ids after the vocabulary, `special` and the other flags as transformers sets them, from tokenizer_config.json's
    added_tokens_decoder, or from the older added_tokens.json (special when a field such as eos_token names it)."""
    assert added_tokens(tok) == EXPECTED["added_tokens"]
    assert {t["content"]: t["special"] for t in EXPECTED["added_tokens"]}["<tool_call>"] is False
    config = json.loads((FOLDER / "tokenizer_config.json").read_text(encoding="utf-8"))
    folder = slow_folder(tmp_path, FILES[:2])
    (folder / "added_tokens.json").write_text(
        json.dumps({t["content"]: int(i) for i, t in config.pop("added_tokens_decoder").items()}))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    legacy = data.load_tokenizer(folder)
    assert added_tokens(legacy) == EXPECTED["legacy_added_tokens"]
    assert mismatches(legacy) == []


def test_tokenizer_json_first(tok, tmp_path):
    """A folder with tokenizer.json is read from it, even beside vocab.json; ours saved as tokenizer.json reads back
    the same."""
    folder = slow_folder(tmp_path)
    embedded.make_char_tokenizer(family="dream").save(str(folder / "tokenizer.json"))
    assert data.load_tokenizer(folder).get_vocab_size() == embedded.make_char_tokenizer(family="dream").get_vocab_size()
    tok.save(str(folder / "tokenizer.json"))
    assert mismatches(data.load_tokenizer(folder)) == []


def test_chatml_special_ids_and_a_dream_model(tok):
    """Dream's ChatML on it: the chat format, special_ids from a Dream config, a prompt that ends in the assistant's
    header, any text encodable (byte-level, no unknown token), and a tiny Dream reading the prompt."""
    assert data.chat_format(tok) == "chatml"
    sid = {t: tok.token_to_id(t) for t in data.DREAM_SPECIAL_TOKENS}
    config = embedded.tiny_config_for(tok, d_model=32, n_heads=4, n_kv_heads=2, n_layers=1, mlp_hidden_size=64)
    assert (config.model_type, config.mask_token_id, config.eos_token_id) == ("Dream", sid[data.DREAM_MASK],
                                                                              sid[data.EOS])
    config = LLaDAConfig(model_type="Dream", include_qkv_bias=True, vocab_size=config.vocab_size,
                         embedding_size=config.embedding_size, mask_token_id=sid[data.DREAM_MASK],
                         eos_token_id=sid[data.EOS], pad_token_id=sid[data.EOS], d_model=32, n_heads=4, n_kv_heads=2,
                         n_layers=1, mlp_hidden_size=64)
    ids = data.special_ids(tok, config)
    assert (ids.eos, ids.pad, ids.mask, ids.eot, ids.start_header) == (
        sid[data.EOS], sid[data.EOS], sid[data.DREAM_MASK], sid[data.IM_END], sid[data.IM_START])
    prompt = data.encode(tok, data.chat_prompt([dict(role="user", content="日本語 😀 it's 42")], "chatml"))
    assert prompt[0] == sid[data.IM_START] and prompt.count(sid[data.IM_END]) == 2
    assert prompt[-3:] == data.encode(tok, "<|im_start|>assistant\n")[-3:]
    assert tok.decode(prompt, skip_special_tokens=False) == data.chat_prompt(
        [dict(role="user", content="日本語 😀 it's 42")], "chatml")
    assert data.unencodable_characters(tok, "Ünïcödé 👨\u200d👩\u200d👧 \x00\t") == {}
    example_ids, prompt_len = data.encode_examples(tok, [([dict(role="user", content="2+2?")], "4")])[0]
    assert example_ids[prompt_len:] == data.encode(tok, "4") + [sid[data.IM_END]]
    model = LLaDA(config).init_weights(torch.Generator().manual_seed(0))
    assert model(torch.tensor([prompt])).shape == (1, len(prompt), config.embedding_size)


def test_the_bos_is_the_one_tokenizer_config_names(tmp_path):
    """dream.named_token(folder, "bos_token"), what add_bos_token puts first, is the folder's own BOS (a string, or an
    AddedToken object, as transformers reads it), a token of its tokenizer: the fixture's <|beginoftext|>, another
    Dream-family folder's own; none named (Qwen2's null, or no tokenizer_config.json): the default."""
    folder = slow_folder(tmp_path)
    assert dream.named_token(folder, "bos_token") == "<|beginoftext|>"
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    for bos in ("<|bos|>", {"content": "<|bos|>", "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": True}):
        (folder / "tokenizer_config.json").write_text(json.dumps(config | {"bos_token": bos}))
        assert dream.named_token(folder, "bos_token", "<|beginoftext|>") == "<|bos|>"
        assert data.load_tokenizer(folder).token_to_id("<|bos|>") is not None
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"bos_token": None}))
    assert dream.named_token(folder, "bos_token", "x") == "x"
    (folder / "tokenizer_config.json").unlink()
    assert dream.named_token(folder, "bos_token") is None


def test_errors_name_the_file(tmp_path):
    """One line naming the file (and the line) for each way the slow tokenizer's files can be broken."""
    def error(edit, kind=ValueError):
        folder = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        edit(slow_folder(folder))
        with pytest.raises(kind) as e:
            data.load_tokenizer(folder)
        assert "\n" not in str(e.value)
        return str(e.value).replace(str(folder), "{dir}")

    assert error(lambda f: (f / "merges.txt").unlink(), FileNotFoundError).startswith("{dir}/merges.txt not found")
    msg = error(lambda f: (f / "vocab.json").write_text('{"a": 0,\n "b": '))
    assert msg.startswith("{dir}/vocab.json: not valid JSON (line 2") and "copy vocab.json" in msg
    assert error(lambda f: (f / "vocab.json").write_text('["a", "b"]')).startswith("{dir}/vocab.json: not a BPE")
    assert error(lambda f: (f / "tokenizer_config.json").write_text("{")).startswith(
        "{dir}/tokenizer_config.json: not valid JSON (line 1")
    assert error(lambda f: (f / "merges.txt").write_text("#version: 0.2\nĠ Ġ\n\nĠ zz\n")).startswith(
        "{dir}/merges.txt, line 4: 'Ġ zz' is not a merge")

    def gap(f):  # <|mask|> one id past where it falls
        config = json.loads((f / "tokenizer_config.json").read_text(encoding="utf-8"))
        last = max(config["added_tokens_decoder"], key=int)
        config["added_tokens_decoder"][str(int(last) + 1)] = config["added_tokens_decoder"].pop(last)
        (f / "tokenizer_config.json").write_text(json.dumps(config))
    assert "{dir}/tokenizer_config.json: added token '<|mask|>' has id" in error(gap)
    (tmp_path / "none").mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer.json.*vocab.json and merges.txt"):
        data.load_tokenizer(tmp_path / "none")
