"""Inputs are checked before the work starts: each bad config.json, safetensors file, tokenizer.json, special id or
data row fails at once, and its message names the file, line or field.

One table, one test per row: (name, setup, exception type, fragments). setup(tmp) writes a tiny model folder with
one thing broken and makes the call that must refuse it; every fragment (with {tmp} the test's folder) must be in
the message."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models

import data
import embedded
from model import LLaDA, LLaDAConfig, load_weight_rows

KEY = "model.transformer.blocks.0.up_proj.weight"  # the tensor the weight cases break
SIZES = dict(d_model=8, n_heads=2, n_kv_heads=2, n_layers=1, mlp_hidden_size=16)  # a 1-layer model


def tiny_folder(tmp, **config_changes):
    """A complete model folder (config.json, model.safetensors, tokenizer.json) of a 1-layer char-level LLaDA."""
    tokenizer = embedded.make_char_tokenizer()
    config = embedded.tiny_config_for(tokenizer, **SIZES)
    model = LLaDA(dataclasses.replace(config, **config_changes)).init_weights(torch.Generator().manual_seed(0))
    model.save_pretrained(tmp / "model")
    tokenizer.save(str(tmp / "model" / "tokenizer.json"))
    return tmp / "model"


def edit_config(tmp, **fields):
    """A folder whose config.json has `fields` set as written (any JSON value); returns config.json's path."""
    folder = tiny_folder(tmp)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, **fields}, indent=2))
    return folder / "config.json"


def write_config_text(tmp, text):
    path = tiny_folder(tmp) / "config.json"
    path.write_text(text)
    return path


def edit_weights(tmp, change):
    """A folder whose model.safetensors has KEY changed by change(tensor) in place; returns the folder."""
    folder = tiny_folder(tmp)
    tensors = load_file(folder / "model.safetensors")
    change(tensors[KEY])
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def cut_file(path, keep):
    """Keep the first `keep` (a fraction) of the file's bytes, as an interrupted download does."""
    content = path.read_bytes()
    path.write_bytes(content[:int(len(content) * keep)])


def sharded_folder(tmp):
    folder = tmp / "sharded"
    LLaDA(embedded.tiny_config_for(embedded.make_char_tokenizer(), **SIZES)
          ).init_weights().save_pretrained(folder, max_shard_bytes=2000)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) >= 2
    return folder, shards


def load_rows(folder):
    """load_weight_rows as one rank of one (the FSDP2 path), into a model built from the folder's config."""
    model = LLaDA(LLaDAConfig.from_json(folder / "config.json"))
    load_weight_rows(model, folder, rank=0, world=1)


def mask_case(tmp, tokenizer, **config_changes):
    """special_ids for a tokenizer and the tiny config with config_changes (e.g. a wrong mask_token_id)."""
    config = embedded.tiny_config_for(embedded.make_char_tokenizer(), **SIZES)
    data.special_ids(tokenizer, dataclasses.replace(config, **config_changes))


def tokenizer_without_mask():
    """A char tokenizer with every LLaDA special token but <|mdm_mask|>."""
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(embedded.CHAR_VOCAB)}))
    tokenizer.pre_tokenizer = embedded.make_char_tokenizer().pre_tokenizer
    tokenizer.add_special_tokens([t for t in data.SPECIAL_TOKENS if t != data.MASK])
    return tokenizer


def tokenizer_with_unk():
    """A char tokenizer that reads a character outside its vocabulary as its unknown token [UNK] (no error)."""
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(embedded.CHAR_VOCAB + "?")}, unk_token="?"))
    tokenizer.pre_tokenizer = embedded.make_char_tokenizer().pre_tokenizer
    tokenizer.add_special_tokens(list(data.SPECIAL_TOKENS))
    return tokenizer


def jsonl(tmp, *lines):
    """A JSONL file of prompt/response rows (a tuple) or raw lines (a str)."""
    path = tmp / "data.jsonl"
    path.write_text("".join((line if isinstance(line, str) else
                             json.dumps({"prompt": line[0], "response": line[1]})) + "\n" for line in lines))
    return path


GOOD = ("say hi", "hi")
A = embedded.CHAR_VOCAB.index("a")  # an ordinary token of the char tokenizers

CASES = [
    # config.json: not JSON, not an object, a field of the wrong type
    ("config_not_json", lambda t: LLaDAConfig.from_json(write_config_text(t, '{\n  "d_model": 8,\n  "n_heads" 2\n}')),
     ValueError, ["{tmp}/model/config.json", "not valid JSON", "line 3, column 13"]),
    ("config_not_object", lambda t: LLaDAConfig.from_json(write_config_text(t, "[8, 2]")),
     ValueError, ["{tmp}/model/config.json", "JSON object"]),
    ("config_int_as_string", lambda t: LLaDAConfig.from_json(edit_config(t, d_model="4096")),
     ValueError, ["{tmp}/model/config.json", "'d_model'", '"4096"', "integer"]),
    ("config_int_as_float", lambda t: LLaDAConfig.from_json(edit_config(t, d_model=4096.5)),
     ValueError, ["{tmp}/model/config.json", "'d_model'", "4096.5", "integer"]),
    ("config_int_null", lambda t: LLaDAConfig.from_json(edit_config(t, n_layers=None)),
     ValueError, ["{tmp}/model/config.json", "'n_layers'", "null"]),
    ("config_bool_as_int", lambda t: LLaDAConfig.from_json(edit_config(t, rope=1)),
     ValueError, ["{tmp}/model/config.json", "'rope'", "true or false"]),
    ("config_zero_heads", lambda t: LLaDAConfig.from_json(edit_config(t, n_heads=0)),
     ValueError, ["{tmp}/model/config.json", "'n_heads'", "positive"]),
    ("config_bad_in_from_pretrained", lambda t: LLaDA.from_pretrained(edit_config(t, rope_theta="1e4").parent),
     ValueError, ["{tmp}/model/config.json", "'rope_theta'", "number"]),
    # safetensors: empty, truncated, foreign; a broken index
    ("weights_empty", lambda t: LLaDA.from_pretrained(
        cut_file(tiny_folder(t) / "model.safetensors", 0) or t / "model"),
     ValueError, ["{tmp}/model/model.safetensors", "0 bytes", "fetch it again"]),
    ("weights_truncated", lambda t: LLaDA.from_pretrained(
        cut_file(tiny_folder(t) / "model.safetensors", 0.5) or t / "model"),
     ValueError, ["{tmp}/model/model.safetensors", "not a readable safetensors file"]),
    ("weights_not_safetensors", lambda t: LLaDA.from_pretrained(
        (tiny_folder(t) / "model.safetensors").write_text("<html>404</html>") and t / "model"),
     ValueError, ["{tmp}/model/model.safetensors", "not a readable safetensors file"]),
    ("shard_truncated_load_weight_rows", lambda t: load_rows(
        cut_file(sharded_folder(t)[1][1], 0.9) or t / "sharded"),
     ValueError, ["{tmp}/sharded/model-00002-of-", "not a readable safetensors file"]),
    ("index_not_json", lambda t: LLaDA.from_pretrained(
        (sharded_folder(t)[0] / "model.safetensors.index.json").write_text('{"weight_map": ') and t / "sharded"),
     ValueError, ["{tmp}/sharded/model.safetensors.index.json", "weight_map"]),
    # weights holding NaN / inf, found as they are loaded
    ("weights_nan_from_pretrained", lambda t: LLaDA.from_pretrained(
        edit_weights(t, lambda w: w[3, 1].fill_(float("nan")))),
     ValueError, ["{tmp}/model/model.safetensors", KEY, "1 NaN or infinite"]),
    ("weights_inf_load_weight_rows", lambda t: load_rows(edit_weights(t, lambda w: w[-1].fill_(float("-inf")))),
     ValueError, ["{tmp}/model/model.safetensors", KEY, "NaN or infinite"]),
    ("weights_overflow_on_cast", lambda t: LLaDA.from_pretrained(
        edit_weights(t, lambda w: w[0, 0].fill_(1e6)), dtype=torch.float16),  # float16 tops out at 65504
     ValueError, ["{tmp}/model/model.safetensors", KEY, "torch.float16", "overflow"]),
    # tokenizer.json
    ("tokenizer_not_json", lambda t: data.load_tokenizer(
        (tiny_folder(t) / "tokenizer.json").write_text('{"version": "1.0",\n "model": {') and t / "model"),
     ValueError, ["{tmp}/model/tokenizer.json", "not valid JSON", "line 2"]),
    ("tokenizer_not_a_tokenizer", lambda t: data.load_tokenizer(
        (tiny_folder(t) / "tokenizer.json").write_text('{"model_max_length": 4096}') and t / "model"),
     ValueError, ["{tmp}/model/tokenizer.json", "not a tokenizer"]),
    # mask_token_id against the tokenizer and the embedding
    ("mask_id_not_the_mask_token", lambda t: mask_case(t, embedded.make_char_tokenizer(), mask_token_id=44),
     ValueError, ["config.json field 'mask_token_id' = 44", "'<|mdm_mask|>' token is id 48"]),
    ("mask_id_ordinary_token", lambda t: mask_case(t, tokenizer_without_mask(), mask_token_id=A),
     ValueError, [f"config.json field 'mask_token_id' = {A}", "ordinary token 'a'"]),
    ("mask_id_outside_embedding", lambda t: mask_case(t, tokenizer_without_mask(), mask_token_id=56),
     ValueError, ["config.json field 'mask_token_id' = 56", "embedding_size = 56"]),
    # data rows the tokenizer cannot encode: named bad rows
    ("data_char_without_token", lambda t: data.load_dataset(
        jsonl(t, GOOD, ("say hi", "café")), embedded.make_char_tokenizer()),
     data.DataError, ["{tmp}/data.jsonl, line 2", "the answer has 'é'", "no token", "--skip-bad-rows"]),
    ("data_unknown_token", lambda t: data.load_dataset(jsonl(t, ("say Hi", "hi"), GOOD), tokenizer_with_unk()),
     data.DataError, ["{tmp}/data.jsonl, line 1", "the prompt has 'H'", "unknown token '?'"]),
    ("data_unencodable_before_invalid_json", lambda t: data.load_dataset(
        jsonl(t, GOOD, ("say hi", "HI"), "{not json"), embedded.make_char_tokenizer()),
     data.DataError, ["{tmp}/data.jsonl, line 2", "the answer has 'H'"]),
    ("example_char_without_token", lambda t: data.encode_examples(
        embedded.make_char_tokenizer(), [([{"role": "user", "content": "Q?"}], "a")]),
     ValueError, ["example 0", "the prompt has 'Q'"]),
]


@pytest.mark.parametrize("setup, error, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_with_its_name(tmp_path, setup, error, fragments):
    with pytest.raises(error) as info:
        setup(tmp_path)
    message = str(info.value)
    for fragment in fragments:
        assert fragment.format(tmp=tmp_path) in message, message


def test_unencodable_rows_are_skipped_and_counted(tmp_path):
    path = jsonl(tmp_path, GOOD, ("say hi", "café"), ("say Hi", "hi"), GOOD)
    examples, stats = data.load_dataset(path, embedded.make_char_tokenizer(), skip_bad_rows=True)
    assert len(examples) == 2 and stats["rows"] == 4 and stats["skipped_bad_rows"] == 2
    assert stats["bad_rows"][0].startswith(f"{path}, line 2: the answer has 'é'")
    assert stats["bad_rows"][1].startswith(f"{path}, line 3: the prompt has 'H'")


def test_good_inputs_pass_every_check(tmp_path):
    """The checks refuse only what is wrong: a clean folder and data set load, with the literal unknown token."""
    folder = tiny_folder(tmp_path)
    model = LLaDA.from_pretrained(folder)
    tokenizer = data.load_tokenizer(folder)
    ids = data.special_ids(tokenizer, model.config)
    assert ids.mask == tokenizer.token_to_id(data.MASK) == model.config.mask_token_id
    load_weight_rows(LLaDA(model.config), folder, rank=0, world=1)
    examples, stats = data.load_dataset(jsonl(tmp_path, GOOD, ("say ?", "?")), tokenizer_with_unk())
    assert len(examples) == 2 and stats["skipped_bad_rows"] == 0
