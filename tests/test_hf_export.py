"""The main job's exported model folder opens in Hugging Face's loaders as a real LLaDA folder does: config.json says
its family and modeling files as LLaDA-8B's (tests/golden/tiny_llada_mha has their exact fields), tokenizer_config.json
makes AutoTokenizer read tokenizer.json (without it, AutoTokenizer asks AutoConfig for a tokenizer class and fails), its
special tokens and chat template those of our tokenizer and data.chat_prompt. transformers is not a requirement: the
files' content is checked against a real folder's, and with transformers installed the loaders themselves."""

import json
from types import SimpleNamespace

import jinja2.sandbox
import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file

import data
import embedded
import longjob
from model import LLaDA

REAL = json.loads((REPO / "tests" / "golden" / "tiny_llada_mha" / "config.json").read_text())
# LLaDA-8B-Instruct's tokenizer_config.json (huggingface.co/GSAI-ML/LLaDA-8B-Instruct): the fields a loader reads
REAL_TOKENIZER = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                      pad_token="<|endoftext|>", add_bos_token=False, add_eos_token=False)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """The embedded run's inputs (64 training puzzles instead of 19,200) and a checkpoint's model/ export of them,
    written as write_checkpoint writes it: (the folder, the model)."""
    root = tmp_path_factory.mktemp("export")
    (root / "run").mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(embedded.EMBEDDED_PUZZLES, "n_train", 64)
        inputs = embedded.embedded_inputs(SimpleNamespace(out=str(root / "run"), seed=0, eval_puzzles=4), 0,
                                          torch.float32, torch.float32)
    model = inputs["model"]
    longjob.export_pretrained(model.config, dict(model.state_dict()), root / "model", torch.float32,
                              inputs["export"].files)
    return root / "model", model


def test_config_json_names_the_family_and_modeling_files_as_llada_8b(export):
    folder, model = export
    config = json.loads((folder / "config.json").read_text())
    for field in ("model_type", "architectures", "auto_map"):
        assert config[field] == REAL[field], field
    loaded = LLaDA.from_pretrained(folder).config  # our loader reads it as before, the files' dtype said
    assert loaded.to_dict() == model.config.to_dict() | {"torch_dtype": "float32"}
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in load_file(folder / "model.safetensors").items())


def test_tokenizer_config_json_is_a_real_llada_folders(export):
    """Its fields are LLaDA-8B-Instruct's; its added tokens are tokenizer.json's, id for id; BOS, EOS and pad are
    special tokens of the tokenizer, EOS = pad the ids config.json names; model_max_length the model's context."""
    folder, model = export
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert {k: config[k] for k in REAL_TOKENIZER} == REAL_TOKENIZER
    tokenizer = data.load_tokenizer(folder)
    added = {str(i): t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
    assert {i: t["content"] for i, t in config["added_tokens_decoder"].items()} == added
    assert all(t["special"] for t in config["added_tokens_decoder"].values())
    ids = {name: tokenizer.token_to_id(config[name]) for name in ("bos_token", "eos_token", "pad_token")}
    assert ids["eos_token"] == model.config.eos_token_id and ids["pad_token"] == model.config.pad_token_id
    assert ids["bos_token"] == tokenizer.token_to_id(data.BOS)
    assert config["model_max_length"] == model.config.max_sequence_length
    # the run's own file, which a rerun into the same --out may replace (embedded.REPLACED)
    assert embedded.REPLACED["tokenizer_config.json"](folder / "tokenizer_config.json")


def test_the_chat_template_is_data_chat_prompt(export):
    """Rendered as transformers renders it (a sandboxed Jinja environment trimming blocks), it writes what
    data.chat_prompt writes, the turns trimmed, the assistant header after the last."""
    folder, _ = export
    config = json.loads((folder / "tokenizer_config.json").read_text())
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(config["chat_template"])
    for messages in ([{"role": "user", "content": " Solve 1234 \n"}],
                     [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                      {"role": "assistant", "content": "a "}, {"role": "user", "content": "q2"}]):
        assert template.render(messages=messages, bos_token=config["bos_token"]) == data.chat_prompt(messages)


def test_transformers_opens_the_export(export):
    """With transformers installed: AutoTokenizer reads the folder (as it reads LLaDA-8B-Instruct's) and encodes as
    data.load_tokenizer does; AutoConfig finds the modeling files config.json names."""
    transformers = pytest.importorskip("transformers")
    folder, _ = export
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "user", "content": "Solve 1234"}]
    ours = data.encode(data.load_tokenizer(folder), data.chat_prompt(messages))
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True) in (
        ours, {"input_ids": ours, "attention_mask": [1] * len(ours)})
    assert tokenizer.eos_token_id == json.loads((folder / "config.json").read_text())["eos_token_id"]
