"""model.py against the official LLaDA code's golden vectors, checkpoint round trips, GQA, and LoRA."""

import json
import shutil

import pytest
import torch
from conftest import GOLDEN, assert_float32_close, model_depth, tiny_config, tiny_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from adapters import load_adapter, save_adapter
from model import LLaDA, LLaDAConfig, LoRALinear, add_lora, lora_disabled, merge_lora, stored_dtype

pytestmark = pytest.mark.numerics  # float32 against goldens and other code paths (conftest.py)


@pytest.fixture(scope="module")
def golden():
    model = LLaDA.from_pretrained(GOLDEN / "tiny_llada_mha")
    return model, load_file(GOLDEN / "golden_forward.safetensors")


# -----------------------------------------------------------------------------
# Golden vectors from the official modeling_llada.py


@torch.no_grad()
def test_golden_logits_and_hidden_states(golden):
    model, g = golden
    captured = []  # input of every block, then the output of ln_f
    hooks = [b.register_forward_pre_hook(lambda m, args: captured.append(args[0]))
             for b in model.model.transformer.blocks]
    hooks.append(model.model.transformer.ln_f.register_forward_hook(lambda m, args, out: captured.append(out)))
    logits = model(g["mha.input_ids"])
    for h in hooks:
        h.remove()
    depth = model_depth(model.config)  # the official code's float32 sums and ours: conftest.float32_atol's bound
    assert_float32_close(logits, g["mha.logits"], depth)
    hidden = torch.stack(captured)  # (n_layers + 1, B, L, D)
    assert_float32_close(hidden, g["mha.hidden_states"], depth)
    torch.testing.assert_close(model(g["mha.input_ids"], return_hidden=True), captured[-1])


@torch.no_grad()
def test_golden_padding_mask(golden):
    model, g = golden
    ids, mask = g["mha.padded_input_ids"], g["mha.padded_attention_mask"]
    depth = model_depth(model.config)
    assert_float32_close(model(ids, mask), g["mha.padded_logits"], depth)
    assert_float32_close(model(ids), g["mha.padded_logits_without_mask"], depth)
    # the pad keys are hidden from every query: whatever tokens sit under the mask, the real positions' logits are
    # unchanged (positions count from 0 in every row, so a left-padded row is compared at the same positions)
    other = ids.clone()
    other[mask == 0] = 3
    real = mask.bool()
    assert_float32_close(model(other, mask)[real], model(ids, mask)[real], depth)


@torch.no_grad()
def test_right_padded_row_equals_unpadded():
    # with right padding the real tokens keep positions 0..n-1, so the padded row equals the unpadded row exactly
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    row = torch.randint(0, 40, (1, 9), generator=g)
    padded = torch.cat([row, torch.full((1, 5), 46)], dim=1)
    mask = torch.cat([torch.ones(1, 9), torch.zeros(1, 5)], dim=1).long()
    torch.testing.assert_close(model(padded, mask)[:, :9], model(row), atol=1e-5, rtol=0)


# -----------------------------------------------------------------------------
# Checkpoint I/O


def test_round_trip_and_sharded(tmp_path):
    model = tiny_model(seed=3)
    ids = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(0))
    model.save_pretrained(tmp_path / "one")
    assert (tmp_path / "one" / "model.safetensors").exists()
    model.save_pretrained(tmp_path / "many", max_shard_bytes=20_000)  # forces several shards + an index
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    for folder in ("one", "many"):
        loaded = LLaDA.from_pretrained(tmp_path / folder)
        for (k, a), (k2, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
            assert k == k2 and torch.equal(a, b)
        with torch.no_grad():
            assert torch.equal(model(ids), loaded(ids))
    saved = LLaDAConfig.from_json(tmp_path / "one" / "config.json")
    assert saved.extra.pop("torch_dtype") == "float32"  # what the files hold
    assert saved == model.config
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert LLaDAConfig.from_json(tmp_path / "bf16" / "config.json").extra["torch_dtype"] == "bfloat16"
    assert stored_dtype(tmp_path / "bf16") == torch.bfloat16 and stored_dtype(tmp_path / "one") == torch.float32
    assert not list(tmp_path.glob("*.tmp-*"))  # no temporary folder left behind


def test_config_round_trip_keeps_unknown_fields_and_refuses_unsupported(tmp_path):
    src = GOLDEN / "tiny_llada_mha" / "config.json"
    cfg = LLaDAConfig.from_json(src)
    cfg.to_json(tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads(src.read_text())
    for field, value in [("weight_tying", True), ("include_bias", True), ("block_type", "sequential"),
                         ("alibi", True), ("scale_logits", True)]:
        raw = json.loads(src.read_text())
        raw[field] = value
        (tmp_path / "bad.json").write_text(json.dumps(raw))
        with pytest.raises(ValueError, match=field):
            LLaDAConfig.from_json(tmp_path / "bad.json")


def test_bad_checkpoints_name_the_key(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "ok")
    state = load_file(tmp_path / "ok" / "model.safetensors")
    key = "model.transformer.blocks.1.up_proj.weight"
    cases = {
        "missing": {k: v for k, v in state.items() if k != key},
        "unexpected": {**state, "model.transformer.blocks.9.q_proj.weight": state[key].clone()},
        "shape": {**state, key: state[key][:-1].contiguous()},
    }
    for name, tensors in cases.items():
        folder = tmp_path / name
        shutil.copytree(tmp_path / "ok", folder)
        save_file(tensors, str(folder / "model.safetensors"))
        with pytest.raises(ValueError, match=name) as err:
            LLaDA.from_pretrained(folder)
        assert "blocks.9" in str(err.value) if name == "unexpected" else key in str(err.value)


def test_from_pretrained_dtype():
    model = LLaDA.from_pretrained(GOLDEN / "tiny_llada_mha", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert not any(p.is_meta for p in model.parameters())


# -----------------------------------------------------------------------------
# Grouped-query attention equals multi-head attention with k/v heads repeated


@torch.no_grad()
def test_grouped_query_attention_matches_repeated_heads():
    gqa = tiny_model(seed=5, n_heads=4, n_kv_heads=2)
    mha = LLaDA(tiny_config(n_heads=4, n_kv_heads=4))
    state = gqa.state_dict()
    hd = gqa.config.head_dim
    for k, v in state.items():
        if k.endswith(("k_proj.weight", "v_proj.weight")):
            # kv head j serves query heads 2j and 2j+1: repeat each kv head's rows
            state[k] = v.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(state)
    ids = torch.randint(0, 40, (2, 13), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[0, :3] = 0
    torch.testing.assert_close(gqa(ids, mask), mha(ids, mask), atol=1e-5, rtol=0)


def test_activation_checkpointing_same_gradients():
    model = tiny_model(seed=7)
    ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(3))
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.set_activation_checkpointing(ckpt)
        model(ids).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


# -----------------------------------------------------------------------------
# LoRA


def test_lora_starts_at_base_and_trains_only_adapters():
    model = tiny_model(seed=1)
    ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(4))
    base = model(ids).detach()
    add_lora(model, r=4, alpha=8, dropout=0.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(ids), base)  # B = 0
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert len(trainable) == 2 * 3 * model.config.n_layers
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if n in trainable)


def trained_lora_model(dropout=0.0):
    model = tiny_model(seed=2)
    add_lora(model, r=4, alpha=8, dropout=dropout, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(5))
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        opt.step()
    return model, ids


def test_lora_merge_and_disable():
    model, ids = trained_lora_model()
    base = LLaDA(model.config)
    base.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" not in k})
    with torch.no_grad():
        lora_out = model(ids)
        assert not torch.allclose(lora_out, base(ids), atol=1e-4)  # the adapters changed something
        with lora_disabled(model):
            assert torch.equal(model(ids), base(ids))
        torch.testing.assert_close(merge_lora(model)(ids), lora_out, atol=1e-5, rtol=1e-5)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())


def test_lora_dropout_only_in_train_mode():
    model, ids = trained_lora_model(dropout=0.5)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids), model(ids))
    model.train()
    with torch.no_grad():
        assert not torch.equal(model(ids), model(ids))


def test_adapter_peft_format_round_trip(tmp_path):
    model, ids = trained_lora_model()
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path="GSAI-ML/LLaDA-8B-Instruct")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["r"] == 4
    assert cfg["lora_alpha"] == 8 and cfg["bias"] == "none" and cfg["target_modules"] == ["q_proj", "k_proj", "v_proj"]
    assert cfg["fan_in_fan_out"] is False and cfg["use_rslora"] is False and cfg["use_dora"] is False
    assert cfg["inference_mode"] is True and cfg["base_model_name_or_path"] == "GSAI-ML/LLaDA-8B-Instruct"
    D = model.config.d_model
    want = {}
    for i in range(model.config.n_layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            out = model.config.n_heads * model.config.head_dim if name == "q_proj" else \
                model.config.n_kv_heads * model.config.head_dim
            want[f"base_model.model.model.transformer.blocks.{i}.{name}.lora_A.weight"] = (4, D)
            want[f"base_model.model.model.transformer.blocks.{i}.{name}.lora_B.weight"] = (out, 4)
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), framework="pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == want
    fresh = tiny_model(seed=2)
    load_adapter(fresh, tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(fresh(ids), model(ids))


def test_lora_closed_form_with_hand_set_adapters():
    """y = W x + (B A x) * alpha / r, with A and B set by hand, against float64 arithmetic."""
    g = torch.Generator().manual_seed(3)
    base = torch.nn.Linear(6, 4, bias=False)
    with torch.no_grad():
        base.weight.copy_(torch.randn(4, 6, generator=g))
    layer = LoRALinear(base, r=2, alpha=3.0, dropout=0.0)
    A, B = torch.randn(2, 6, generator=g), torch.randn(4, 2, generator=g)
    with torch.no_grad():
        layer.lora_A.copy_(A)
        layer.lora_B.copy_(B)
    x = torch.randn(5, 6, generator=g)
    W = base.weight.detach().double()
    expected = x.double() @ W.T + (x.double() @ A.double().T @ B.double().T) * (3.0 / 2)
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
    merged = merge_lora(add_lora(tiny_model(), r=2, alpha=3.0, dropout=0.0, targets=("v_proj",)))
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())


def test_adapter_written_by_hand_in_peft_format_gives_the_closed_form(tmp_path):
    """An adapter folder written by hand as PEFT writes it (keys with the adapter name "default", lora_alpha 16,
    r 4): loading it changes exactly the targeted projection by (B A) * 16 / 4."""
    model = tiny_model(1)
    D = model.config.d_model
    g = torch.Generator().manual_seed(4)
    A, B = torch.randn(4, D, generator=g), torch.randn(D, 4, generator=g)
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["q_proj"], "bias": "none", "fan_in_fan_out": False}))
    tensors = {}
    for i in range(model.config.n_layers):
        prefix = f"base_model.model.model.transformer.blocks.{i}.q_proj"
        tensors[f"{prefix}.lora_A.default.weight"] = A * (i + 1)
        tensors[f"{prefix}.lora_B.default.weight"] = B.clone()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    W = [blk.q_proj.weight.detach().clone() for blk in model.model.transformer.blocks]
    merged = merge_lora(load_adapter(model, folder))
    for i, blk in enumerate(merged.model.transformer.blocks):
        expected = W[i].double() + (B.double() @ (A * (i + 1)).double()) * 16 / 4
        torch.testing.assert_close(blk.q_proj.weight.double(), expected, rtol=1e-6, atol=1e-5)


# -----------------------------------------------------------------------------
# PEFT adapters in every legal configuration: loaded exactly as PEFT would apply them, or refused by name


def write_peft_adapter(folder, config, factors):
    """An adapter folder as PEFT writes it: adapter_config.json (LoRA defaults + `config`) and, for each module name,
    its lora_A / lora_B under PEFT's keys (with the adapter name "default")."""
    folder.mkdir(parents=True)
    full = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, **config}
    (folder / "adapter_config.json").write_text(json.dumps(full))
    tensors = {}
    for name, (A, B) in factors.items():
        tensors[f"base_model.model.{name}.lora_A.default.weight"] = A.contiguous()
        tensors[f"base_model.model.{name}.lora_B.default.weight"] = B.contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def factors_for(model, names, ranks, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in names:
        layer = model.get_submodule(name)
        r = ranks(name)
        out[name] = (torch.randn(r, layer.in_features, generator=g), torch.randn(layer.out_features, r, generator=g))
    return out


BLOCKS = "model.transformer.blocks"
PEFT_CASES = {  # config -> (the modules PEFT adapts, the rank of each, the scale of each)
    "alpha_pattern": ({"target_modules": ["q_proj", "v_proj"], "alpha_pattern": {"v_proj": 32}},
                      [f"{BLOCKS}.{i}.{n}" for i in range(2) for n in ("q_proj", "v_proj")],
                      lambda n: 4, lambda n: (32 if n.endswith("v_proj") else 8) / 4),
    "rank_pattern": ({"target_modules": ["q_proj"], "rank_pattern": {"blocks.1.q_proj": 2}},
                     [f"{BLOCKS}.0.q_proj", f"{BLOCKS}.1.q_proj"],
                     lambda n: 2 if ".1." in n else 4, lambda n: 8 / (2 if ".1." in n else 4)),
    "layers_to_transform": ({"target_modules": ["k_proj", "up_proj"], "layers_to_transform": [1],
                             "layers_pattern": "blocks"},
                            [f"{BLOCKS}.1.k_proj", f"{BLOCKS}.1.up_proj"], lambda n: 4, lambda n: 2.0),
    "regex": ({"target_modules": r".*\.blocks\.0\.(q_proj|attn_out)"},
              [f"{BLOCKS}.0.q_proj", f"{BLOCKS}.0.attn_out"], lambda n: 4, lambda n: 2.0),
    "rslora": ({"target_modules": ["v_proj"], "use_rslora": True},
               [f"{BLOCKS}.{i}.v_proj" for i in range(2)], lambda n: 4, lambda n: 8 / 4 ** 0.5),
    "ff_out is also the head": ({"target_modules": ["ff_out"]},
                                [f"{BLOCKS}.0.ff_out", f"{BLOCKS}.1.ff_out", "model.transformer.ff_out"],
                                lambda n: 4, lambda n: 2.0),
}


@pytest.mark.parametrize("case", list(PEFT_CASES))
def test_peft_adapter_configurations_load_exactly(tmp_path, case):
    config, names, rank, scale = PEFT_CASES[case]
    model = tiny_model(2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    factors = factors_for(model, names, rank)
    folder = write_peft_adapter(tmp_path / "adapter", config, factors)
    merged = merge_lora(load_adapter(model, folder)).state_dict()
    for key, value in merged.items():
        name = key.removesuffix(".weight")
        if name in factors:  # W + B A * scale, by hand
            A, B = factors[name]
            expected = before[key].double() + (B.double() @ A.double()) * scale(name)
            torch.testing.assert_close(value.double(), expected, rtol=1e-6, atol=1e-5)
        else:
            assert torch.equal(value, before[key]), key  # PEFT adapts nothing else
    # and our own save writes it back so that it loads to the same model
    again = load_adapter(tiny_model(2), write_peft_adapter(tmp_path / "again", config, factors))
    save_adapter(again, tmp_path / "saved")
    reloaded = merge_lora(load_adapter(tiny_model(2), tmp_path / "saved")).state_dict()
    for key in merged:
        torch.testing.assert_close(reloaded[key], merged[key], rtol=0, atol=0)


@pytest.mark.parametrize("setting,value", [("use_dora", True), ("modules_to_save", ["wte"]), ("bias", "all"),
                                           ("fan_in_fan_out", True), ("layer_replication", [[0, 1]]),
                                           ("peft_type", "IA3")])
def test_peft_settings_we_do_not_implement_are_refused_by_name(tmp_path, setting, value):
    model = tiny_model(2)
    folder = write_peft_adapter(tmp_path / "a", {"target_modules": ["q_proj"], setting: value},
                                factors_for(model, [f"{BLOCKS}.0.q_proj", f"{BLOCKS}.1.q_proj"], lambda n: 4))
    with pytest.raises(ValueError, match=setting):
        load_adapter(model, folder)


def test_peft_adapter_missing_a_module_names_it(tmp_path):
    model = tiny_model(2)
    folder = write_peft_adapter(tmp_path / "a", {"target_modules": ["ff_out"]},
                                factors_for(model, [f"{BLOCKS}.0.ff_out", f"{BLOCKS}.1.ff_out"], lambda n: 4))
    with pytest.raises(ValueError, match=r"missing \['base_model.model.model.transformer.ff_out.lora_A.weight'"):
        load_adapter(model, folder)  # "ff_out" reaches the head too, as in PEFT: its factors must be there


def test_a_regex_target_must_match_the_whole_module_name(tmp_path):
    """PEFT: a string target_modules is re.fullmatch-ed against the full name, so "q_proj" alone matches nothing."""
    model = tiny_model(2)
    folder = write_peft_adapter(tmp_path / "a", {"target_modules": "q_proj"}, {})
    with pytest.raises(ValueError, match="match no linear layer"):
        load_adapter(model, folder)


def test_saved_folders_are_readable_by_others_as_the_umask_allows(tmp_path):
    """Checkpoints on a shared cluster: not owner-only (mkdtemp's 0700, safetensors' 0600), but as the umask says."""
    import os
    old = os.umask(0o022)
    try:
        tiny_model().save_pretrained(tmp_path / "m")
    finally:
        os.umask(old)
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o755
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in (tmp_path / "m").iterdir())
