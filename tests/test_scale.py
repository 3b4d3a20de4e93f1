"""bench/scale.py, the real-width dry run of the LLaDA-8B path (and Dream-v0-7B's): its tokenizer carries LLaDA's
special tokens at their real ids (Dream's at Dream's), its Dream folder is one in Dream's names, and its smoke mode
(tiny widths, the same four steps: gift.py LoRA GIFT, gift.py full fine-tuning with FSDP2 over 2 processes, eval.py,
sample.py, on synthetic sharded bf16 folders) runs every step to success and prints the table. The Dream smoke run
(`python bench/scale.py --smoke --family dream`, ~20 s more) is not repeated here: it runs the same entry points."""

import importlib.util
import json
import re
from types import SimpleNamespace

from conftest import REPO

from data import (DREAM_MASK, DREAM_SPECIAL_TOKENS, EOS, IM_END, IM_START, MASK, SPECIAL_TOKENS, encode,
                  load_tokenizer, special_ids)
from model import LLaDA, LLaDAConfig

STEPS = ("a. gift.py LoRA GIFT", "b. gift.py full FSDP2 x2", "c. eval.py gsm8k --limit 2", "d. sample.py bf16")


def scale_module():
    spec = importlib.util.spec_from_file_location("bench_scale", REPO / "bench" / "scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tokenizer_has_llada_special_ids(tmp_path):
    """At LLaDA's vocabulary the special tokens load with the ids of LLaDA-8B-Instruct's tokenizer.json, each read
    in text as one token, and text stays below them; a reduced vocabulary shifts them down by the same amount."""
    scale = scale_module()
    for vocab, shift in ((126464, 0), (32768, 126464 - 32768)):
        scale.make_tokenizer(vocab).save(str(tmp_path / "tokenizer.json"))
        tokenizer = load_tokenizer(tmp_path)
        assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab
        want = {"<|startoftext|>": 126080, "<|endoftext|>": 126081, "<|mdm_mask|>": 126336,
                "<|start_header_id|>": 126346, "<|end_header_id|>": 126347, "<|eot_id|>": 126348}
        assert {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS} == {t: i - shift for t, i in want.items()}
        config = LLaDAConfig(d_model=8, n_heads=2, n_kv_heads=2, n_layers=1, vocab_size=vocab, embedding_size=vocab,
                             mask_token_id=want[MASK] - shift, eos_token_id=want[EOS] - shift,
                             pad_token_id=want[EOS] - shift)
        ids = special_ids(tokenizer, config)  # raises unless each special token is read in text as one token
        assert (ids.bos, ids.eot) == (126080 - shift, 126348 - shift)
        text = "Add 12 7.\n12+7=19 ~{}"
        assert encode(tokenizer, "<|eot_id|>" + text) == [126348 - shift] + [scale.TEXT_CHARS.index(c) for c in text]
        assert tokenizer.decode(encode(tokenizer, text)) == text


def test_scale_smoke(capsys, one_thread):
    """All four steps of the dry run succeed at tiny widths, and the table lists each with exit status 0. Its main
    runs in this process (the steps it times are subprocesses of their own)."""
    status = scale_module().main(["--smoke", "--threads", "1"])
    stdout = capsys.readouterr().out
    assert status == 0, stdout[-5000:]
    table = stdout[stdout.index("\nstep "):].splitlines()
    for step in STEPS:
        rows = [line for line in table if line.startswith(step)]
        assert len(rows) == 1, f"no table row for {step!r} in:\n" + "\n".join(table)
        name, wall_s, peak_gib, per_process, status = re.split(r"\s{2,}", rows[0].strip())  # columns: 2+ spaces
        assert status == "0" and float(wall_s) > 0 and float(peak_gib) > 0, rows[0]
        assert (per_process.count("+") == 2) == step.startswith("b."), rows[0]  # torchrun: launcher + 2 workers
    assert "all steps succeeded" in stdout


def test_tokenizer_has_dream_special_ids(tmp_path):
    """Dream's tokenizer: <|endoftext|>, <|im_start|>, <|im_end|>, <|mask|> at Dream-v0-7B's ids (Qwen2.5's and
    Dream's mask), read as the ChatML format's tokens by data.special_ids; shifted down with a reduced vocabulary."""
    scale = scale_module()
    want = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|mask|>": 151666}
    for vocab, shift in ((152064, 0), (8192, 152064 - 8192)):
        scale.make_tokenizer(vocab, "dream").save(str(tmp_path / "tokenizer.json"))
        tokenizer = load_tokenizer(tmp_path)
        assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab
        assert {t: tokenizer.token_to_id(t) for t in DREAM_SPECIAL_TOKENS} == {t: i - shift for t, i in want.items()}
        config = LLaDAConfig(d_model=8, n_heads=2, n_kv_heads=1, n_layers=1, vocab_size=vocab, embedding_size=vocab,
                             mask_token_id=want[DREAM_MASK] - shift, eos_token_id=want[EOS] - shift,
                             pad_token_id=want[EOS] - shift, model_type="Dream", include_qkv_bias=True)
        ids = special_ids(tokenizer, config)
        assert (ids.start_header, ids.eot, ids.mask) == (151644 - shift, 151645 - shift, 151666 - shift)
        text = "Add 12 7.\n12+7=19 ~{}"
        text_ids = [scale.TEXT_CHARS.index(c) for c in text]  # below the special ids
        assert encode(tokenizer, IM_START + text + IM_END) == [151644 - shift, *text_ids, 151645 - shift]


def test_dream_folder_is_in_dreams_names(tmp_path):
    """write_model for the dream family: config.json in Dream's names (GQA, biases), Qwen's key names in sharded bf16
    safetensors, and the folder loads back as a Dream model (model.from_pretrained)."""
    scale = scale_module()
    widths = ("d_model", "n_heads", "n_kv_heads", "mlp", "shards")
    a = SimpleNamespace(family="dream", **{k: scale.SMOKE["dream"][k] for k in widths})
    n_params, n_shards = scale.write_model(tmp_path, a, 2, 1024, seed=0)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "Dream" and (raw["hidden_size"], raw["num_attention_heads"],
                                             raw["num_key_value_heads"], raw["vocab_size"]) == (64, 4, 2, 1024)
    keys = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.self_attn.k_proj.bias" in keys and "lm_head.weight" in keys and n_shards >= 2
    model = LLaDA.from_pretrained(tmp_path)
    assert model.predicts_shifted and sum(p.numel() for p in model.parameters()) == n_params
