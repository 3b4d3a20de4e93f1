"""model.py as Dream-v0 (config.json model_type "Dream"): the official Dream code's golden vectors (tests/golden/dream,
two tiny checkpoints: sharded / untied / GQA / q-k-v biases, and tied), the Hugging Face and PEFT formats in Dream's
names, LoRA targets by either family's names, the FSDP2 row-wise load, refusals by field name, and the shift."""

import json
import shutil
import socket

import pytest
import torch
from cached_sample import KVCache
from conftest import GOLDEN, assert_float32_close, model_depth, tiny_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import model as M
from adapters import add_peft_lora, peft_target_names, load_adapter, save_adapter
from model import (LLaDA, LLaDAConfig, add_lora, load_weight_rows, lora_target_names, merge_lora, merged_state_dict,
                   stored_dtype)

DREAM = GOLDEN / "dream"
FOLDERS = dict(gqa=DREAM / "tiny_dream_gqa", tied=DREAM / "tiny_dream_tied")  # as the official save_pretrained wrote them


@pytest.fixture(scope="module")
def golden():
    return load_file(DREAM / "golden.safetensors")


def dream(name):
    return LLaDA.from_pretrained(FOLDERS[name]).eval()


def folder_tensors(folder):
    """{key: tensor} of every safetensors file of a Hugging Face folder."""
    return {k: v for f in M.weight_files(folder) for k, v in load_file(f).items()}


def randomize_lora(model, seed):
    """Non-zero B factors, so that an adapter changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in M.lora_layers(model):
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.1)
    return model


# -----------------------------------------------------------------------------
# Golden vectors from the official modeling_dream.py (tests/golden/README.md, "Golden vectors from the official
# Dream code"): logits as the official model returns them, unshifted


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["gqa", "tied"])
@torch.no_grad()
def test_golden_logits_and_hidden_states(golden, name):
    model = dream(name)
    captured = []  # input of every block, then the output of the final norm: the official output_hidden_states
    hooks = [b.register_forward_pre_hook(lambda m, args: captured.append(args[0]))
             for b in model.model.transformer.blocks]
    hooks.append(model.model.transformer.ln_f.register_forward_hook(lambda m, args, out: captured.append(out)))
    logits = model(golden[f"{name}.plain.input_ids"])
    for h in hooks:
        h.remove()
    depth = model_depth(model.config)  # the official code's float32 sums and ours: conftest.float32_atol's bound
    assert_float32_close(logits, golden[f"{name}.plain.logits"], depth)
    assert_float32_close(torch.stack(captured), golden[f"{name}.plain.hidden_states"], depth)


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["gqa", "tied"])
@torch.no_grad()
def test_golden_padding_means_the_official_query_and_key_mask(golden, name):
    """A 2-D attention_mask is the (B, 1, L, L) query-AND-key mask the official generation code builds from it, with
    positions 0 .. L-1; position_ids are its tok_idx. Pad rows are compared too (the official ones are finite)."""
    model, g = dream(name), {k.removeprefix(f"{name}.padded."): v for k, v in golden.items()
                             if k.startswith(f"{name}.padded.")}
    mask, depth = g["attention_mask"], model_depth(model.config)
    assert torch.equal(g["mask4d"].bool(), (mask.bool()[:, None, None, :] & mask.bool()[:, None, :, None]))
    assert_float32_close(model(g["input_ids"], mask), g["logits_mask4d"], depth)
    assert_float32_close(model(g["input_ids"], mask, position_ids=g["tok_idx"]), g["logits_mask4d_tokidx"], depth)
    assert_float32_close(model(g["input_ids"]), g["logits_nomask"], depth)


@pytest.mark.numerics
@torch.no_grad()
def test_golden_right_padded_training_batch(golden):
    """dllm's Dream SFT forward: right-padded rows, the 2-D mask (0 on pads), no position ids: its raw logits."""
    model = dream("gqa")
    logits = model(golden["gqa.sft.noised_input_ids"], golden["gqa.sft.attention_mask"])
    depth = model_depth(model.config)
    assert_float32_close(logits, golden["gqa.sft.raw_logits"], depth)
    shifted = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)  # what predicts_shifted tells the caller to do
    assert_float32_close(shifted, golden["gqa.sft.logits_shifted"], depth)


@pytest.mark.numerics
@torch.no_grad()
def test_cached_span_with_position_ids_equals_the_full_forward(golden):
    """sample.py's cache path with Dream's mask and per-row positions: a span run against the cache made from the
    same sequence gives the full forward's logits there."""
    model, ids = dream("gqa"), golden["gqa.padded.input_ids"]
    mask, pos = golden["gqa.padded.attention_mask"], golden["gqa.padded.tok_idx"]
    cache, rows = KVCache(), []
    full = model(ids, mask, position_ids=pos, cache=cache)
    cache.start, cache.probe = 3, (3, 5, rows)
    span = model(ids[:, 3:9], mask, position_ids=pos, cache=cache)
    assert_float32_close(span, full[:, 3:9], model_depth(model.config))  # another summation order: float32_atol
    assert rows[0].shape == (3, 2, 12) and torch.equal(rows[0][0, 0], torch.zeros(12))  # a pad query sees no key


def test_the_shift_attribute():
    assert dream("gqa").predicts_shifted and dream("gqa").config.predicts_shifted
    llada = LLaDA.from_pretrained(GOLDEN / "tiny_llada_mha")
    assert not llada.predicts_shifted and type(llada) is LLaDA
    with torch.no_grad():  # the module-level loader is LLaDA.from_pretrained for LLaDA folders
        ids = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(0))
        assert torch.equal(llada(ids), LLaDA.from_pretrained(GOLDEN / "tiny_llada_mha")(ids))


# -----------------------------------------------------------------------------
# Config and checkpoint in Dream's names


def test_config_reads_dreams_field_names():
    cfg = dream("gqa").config
    assert (cfg.model_type, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.n_layers, cfg.mlp_hidden_size) == \
        ("Dream", 64, 4, 2, 2, 128)
    assert (cfg.vocab_size, cfg.embedding_size, cfg.rope_theta, cfg.rms_norm_eps) == (100, 100, 1e6, 1e-6)
    assert (cfg.mask_token_id, cfg.pad_token_id, cfg.eos_token_id, cfg.max_sequence_length) == (93, 90, 90, 1024)
    assert cfg.include_qkv_bias and not cfg.weight_tying and dream("tied").config.weight_tying
    block = dream("gqa").model.transformer.blocks[0]
    assert all(getattr(block, n).bias is not None for n in ("q_proj", "k_proj", "v_proj"))
    assert block.attn_out.bias is None and block.ff_out.bias is None
    assert cfg.extra["bos_token_id"] == 90 and cfg.extra["architectures"] == ["DreamModel"]


def test_a_field_left_out_takes_dreams_default_not_lladas(tmp_path):
    raw = json.loads((FOLDERS["gqa"] / "config.json").read_text())
    for key in ("rope_theta", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings"):
        del raw[key]
    cfg = LLaDAConfig.from_dict(raw)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_sequence_length, cfg.weight_tying) == (10000.0, 1e-6, 32768,
                                                                                              False)


@pytest.mark.parametrize("field, value", [("use_sliding_window", True), ("rope_scaling", {"type": "linear", "factor": 2}),
                                          ("hidden_act", "gelu"), ("attention_dropout", 0.1), ("model_type", "qwen2"),
                                          ("hidden_size", "64"), ("num_key_value_heads", 3)])
def test_unsupported_dream_configs_are_refused_by_name(tmp_path, field, value):
    raw = json.loads((FOLDERS["gqa"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, field: value}))
    with pytest.raises(ValueError, match=f"config.json: .*'?{field}'?") as err:
        LLaDAConfig.from_json(tmp_path / "config.json")
    assert len(str(err.value).splitlines()) == 1 and str(tmp_path) in str(err.value)


@pytest.mark.parametrize("name", ["gqa", "tied"])
def test_hugging_face_round_trip_in_dreams_format(tmp_path, name):
    """load -> save -> load: the same tensors under the official keys (a tied head stored once, as the embedding),
    config.json field for field as the official one, sharded with model.safetensors.index.json."""
    model = dream(name)
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "many", max_shard_bytes=30_000)
    original = folder_tensors(FOLDERS[name])
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original) and len(set(index["weight_map"].values())) > 2
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    assert ("lm_head.weight" in original) == (name == "gqa")
    ids = torch.randint(0, 70, (2, 9), generator=torch.Generator().manual_seed(0))
    for folder in ("one", "many"):
        saved = folder_tensors(tmp_path / folder)
        assert saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in saved)
        assert (json.loads((tmp_path / folder / "config.json").read_text())
                == json.loads((FOLDERS[name] / "config.json").read_text()))
        loaded = LLaDA.from_pretrained(tmp_path / folder)
        assert loaded.state_dict().keys() == model.state_dict().keys()
        with torch.no_grad():
            assert torch.equal(loaded(ids), model(ids))
    bf16 = LLaDA.from_pretrained(FOLDERS[name], dtype=torch.bfloat16)
    bf16.save_pretrained(tmp_path / "bf16")
    assert stored_dtype(tmp_path / "bf16") == torch.bfloat16
    saved = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert saved["torch_dtype"] == "bfloat16" and saved["model_type"] == "Dream" and "d_model" not in saved


def test_bad_checkpoint_keys_are_named_as_in_the_file(tmp_path):
    shutil.copytree(FOLDERS["tied"], tmp_path / "m")
    state = load_file(tmp_path / "m" / "model.safetensors")
    key = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in state.items() if k != key}, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match=f"missing keys: \\['{key}'\\]"):
        LLaDA.from_pretrained(tmp_path / "m")
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()},
              str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected keys: \\['lm_head.weight'\\]"):  # tied: the head is not stored
        LLaDA.from_pretrained(tmp_path / "m")


def test_a_tied_head_is_one_parameter_through_moves_and_loads():
    model = dream("tied")
    wte = model.model.transformer.wte
    assert model.head.weight is wte.weight and len(list(model.parameters())) == len(model.state_dict()) - 1
    model.to(torch.bfloat16)
    assert model.head.weight is wte.weight and model.head.weight.dtype == torch.bfloat16
    with torch.device("meta"):
        empty = LLaDA(model.config)
    empty.to_empty(device="cpu")
    assert empty.head.weight is empty.model.transformer.wte.weight
    ids = torch.randint(0, 70, (2, 9), generator=torch.Generator().manual_seed(1))
    model = dream("tied")
    model(ids).pow(2).mean().backward()  # both uses of the matrix reach its one gradient
    head_only = dream("tied")
    head_only.head.weight = torch.nn.Parameter(head_only.head.weight.detach().clone())
    head_only(ids).pow(2).mean().backward()
    torch.testing.assert_close(model.head.weight.grad, head_only.head.weight.grad
                               + head_only.model.transformer.wte.weight.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.numerics
def test_the_pad_row_of_the_embedding_gets_no_input_gradient_as_in_the_official_code():
    model, pad = dream("gqa"), 90
    ids = torch.tensor([[pad, pad, 5, 6, 93, 7], [3, 4, 93, 8, pad, pad]])
    model(ids).sum().backward()
    grad = model.model.transformer.wte.weight.grad
    assert torch.equal(grad[pad], torch.zeros(64)) and grad[5].abs().sum() > 0


# -----------------------------------------------------------------------------
# FSDP2's row-wise load (gift.py's full fine-tuning): each rank reads its rows of the checkpoint's tensors


@pytest.mark.parametrize("name", ["gqa", "tied"])
def test_load_weight_rows_one_rank_on_a_meta_model(name):
    with torch.device("meta"):
        model = LLaDA(LLaDAConfig.from_json(FOLDERS[name] / "config.json"))
    model.to_empty(device="cpu")
    load_weight_rows(model, FOLDERS[name], rank=0, world=1)
    want = dream(name).state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    assert (model.head.weight is model.model.transformer.wte.weight) == (name == "tied")


def _fsdp_rows_worker(rank, world, port):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ids = torch.randint(0, 70, (2, 9), generator=torch.Generator().manual_seed(0))
        for folder in FOLDERS.values():
            reference = LLaDA.from_pretrained(folder)
            with torch.device("meta"):
                model = LLaDA(LLaDAConfig.from_json(folder / "config.json"))
            for block in model.model.transformer.blocks:  # as gift.py shards: one group per block, then the root
                fully_shard(block)
            fully_shard(model)
            model.to_empty(device="cpu")
            load_weight_rows(model, folder, rank, world)
            want = dict(reference.named_parameters())
            for k, p in model.named_parameters():  # this rank's rows, FSDP2's torch.chunk of dim 0
                assert torch.equal(p.to_local(), torch.chunk(want[k], world)[rank]), k
            with torch.no_grad():
                assert torch.equal(model(ids), reference(ids))
            model(ids).pow(2).mean().backward()  # a tied matrix gets both its gradients, reduced over the ranks
            reference(ids).pow(2).mean().backward()
            for k, p in model.named_parameters():
                torch.testing.assert_close(p.grad.to_local(), torch.chunk(want[k].grad, world)[rank], atol=1e-6,
                                           rtol=1e-5)
    finally:
        dist.destroy_process_group()


def test_load_weight_rows_two_ranks_under_fsdp2():
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fsdp_rows_worker, args=(2, port), nprocs=2)


# -----------------------------------------------------------------------------
# LoRA and PEFT adapters in Dream's names


def test_lora_targets_by_either_familys_names():
    model = dream("gqa")
    blocks = [f"model.transformer.blocks.{i}" for i in range(2)]
    assert lora_target_names(model, ["q_proj", "k_proj", "v_proj"]) == [f"{b}.{n}" for b in blocks
                                                                       for n in ("q_proj", "k_proj", "v_proj")]
    assert lora_target_names(model, ["o_proj"]) == lora_target_names(model, ["attn_out"]) == \
        [f"{b}.attn_out" for b in blocks]
    assert lora_target_names(model, ["gate_proj"]) == [f"{b}.ff_proj" for b in blocks]
    assert lora_target_names(model, ["down_proj"]) == [f"{b}.ff_out" for b in blocks]  # not the head
    assert lora_target_names(model, ["lm_head"]) == ["model.transformer.ff_out"]
    assert peft_target_names(model, r"model\.layers\.\d+\.self_attn\.v_proj") == [f"{b}.v_proj" for b in blocks]
    assert peft_target_names(model, ["q_proj"], layers_to_transform=[1], layers_pattern="layers") == \
        ["model.transformer.blocks.1.q_proj"]


@pytest.mark.numerics
def test_lora_on_biased_projections_starts_at_the_base_and_merges_with_its_bias(tmp_path):
    model, ids = dream("gqa"), torch.randint(0, 90, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = model(ids)
        add_lora(model, r=4, alpha=8, dropout=0.0, targets=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj",
                                                            "lm_head"])
        assert torch.equal(model(ids), base)
        unmerged = randomize_lora(model, 3)(ids)
    assert not torch.allclose(unmerged, base, atol=1e-3)
    # the merged export of a training run: merged_state_dict into a fresh module, saved in Dream's format
    with torch.device("meta"):
        export = LLaDA(model.config)
    export.load_state_dict(merged_state_dict(model), assign=True)
    export.save_pretrained(tmp_path / "merged")
    assert folder_tensors(tmp_path / "merged").keys() == folder_tensors(FOLDERS["gqa"]).keys()
    with torch.no_grad():
        torch.testing.assert_close(LLaDA.from_pretrained(tmp_path / "merged")(ids), unmerged, atol=5e-5, rtol=0)
        torch.testing.assert_close(merge_lora(model)(ids), unmerged, atol=5e-5, rtol=0)
    assert model.model.transformer.blocks[0].q_proj.bias is not None


def test_a_tied_head_takes_no_adapter():
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        add_lora(dream("tied"), r=2, alpha=4, targets=["q_proj", "lm_head"])


@pytest.mark.parametrize("targets, written", [
    (["q_proj", "k_proj", "v_proj"], ["q_proj", "k_proj", "v_proj"]),  # the paper's: the same names for both
    (["o_proj", "gate_proj"], ["o_proj", "gate_proj"]),  # Dream's own names: kept
    (["attn_out"], ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]),  # ours: Dream's full names
])
def test_adapter_round_trip_in_dreams_names(tmp_path, targets, written):
    model, ids = dream("gqa"), torch.randint(0, 90, (2, 10), generator=torch.Generator().manual_seed(4))
    randomize_lora(add_peft_lora(model, r=4, alpha=8, dropout=0.0, targets=targets,
                                 rank_pattern={"model.layers.1.self_attn.o_proj": 2}), 5)
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path="Dream-org/Dream-v0-Instruct-7B")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["target_modules"] == written
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    names = [model.config.checkpoint_name(n) for n, _ in M.lora_layers(model)]
    assert keys == {f"base_model.model.{n}.lora_{ab}.weight" for n in names for ab in "AB"}
    assert all(n.startswith("model.layers.") for n in names)
    if "o_proj" in str(written):
        assert cfg["rank_pattern"] == {"model.layers.1.self_attn.o_proj": 2}
    fresh = load_adapter(dream("gqa"), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(fresh(ids), model(ids))


@pytest.mark.numerics
def test_an_adapter_written_by_hand_with_dreams_names_gives_the_closed_form(tmp_path):
    """As PEFT on the official model writes it: Dream's module names, the adapter name "default" in the keys, a
    rank_pattern keyed by a Dream name. The merged weights are W + B A * alpha / r, r from the pattern."""
    model = dream("gqa")
    g = torch.Generator().manual_seed(6)
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "bias": "none",
        "target_modules": ["o_proj", "down_proj"], "rank_pattern": {"model.layers.1.mlp.down_proj": 2}}))
    ours = dict(o_proj="attn_out", down_proj="ff_out")
    tensors, want = {}, {}
    for i in range(2):
        for theirs, n_in, n_out in (("self_attn.o_proj", 64, 64), ("mlp.down_proj", 128, 64)):
            r = 2 if (i, theirs) == (1, "mlp.down_proj") else 4
            A, B = torch.randn(r, n_in, generator=g), torch.randn(n_out, r, generator=g)
            tensors[f"base_model.model.model.layers.{i}.{theirs}.lora_A.default.weight"] = A
            tensors[f"base_model.model.model.layers.{i}.{theirs}.lora_B.default.weight"] = B
            key = f"model.transformer.blocks.{i}.{ours[theirs.split('.')[1]]}.weight"
            want[key] = model.state_dict()[key].double() + (B.double() @ A.double()) * 8 / r
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    merged = merge_lora(load_adapter(model, folder)).state_dict()
    for key, w in want.items():
        torch.testing.assert_close(merged[key].double(), w, atol=1e-5, rtol=1e-6)


def test_lladas_adapters_keep_lladas_names(tmp_path):
    """The LLaDA side of the name map is the identity: its PEFT keys are its module names."""
    model = add_lora(tiny_model(seed=1), r=2, alpha=4, dropout=0.0, targets=["attn_out"])
    save_adapter(model, tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["attn_out"]
    with safe_open(str(tmp_path / "a" / "adapter_model.safetensors"), framework="pt") as f:
        assert "base_model.model.model.transformer.blocks.0.attn_out.lora_A.weight" in set(f.keys())
