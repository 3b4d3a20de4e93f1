"""The LLaDA-8B path on the CPU: bf16 training through the same code as on a GPU (autocast, a bf16 LoRA
base with float32 adapters, FSDP2's bf16 MixedPrecisionPolicy over gloo), float32 softmax from bf16 hidden states,
exports in the base's dtype (config.json's torch_dtype telling the truth), the merged LoRA export, and FSDP2
loading from the meta device."""

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, final_weights, latest, metrics, train_args
from safetensors import safe_open

import gift
from gift import chunked_cross_entropy, main
import model as M
from adapters import load_adapter
from model import LLaDA, LLaDAConfig, merge_lora
from on_model import model_entropy_and_nll

pytestmark = pytest.mark.bf16


CPU_BF16 = torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def bf16_base(base, tmp_path_factory):
    """The tiny base model stored in bfloat16, as LLaDA-8B is."""
    root = tmp_path_factory.mktemp("bf16")
    LLaDA.from_pretrained(base / "model").to(torch.bfloat16).save_pretrained(root / "model")
    shutil.copy2(base / "model" / "tokenizer.json", root / "model")
    shutil.copy2(base / "data.jsonl", root)
    return root


def stored(folder):
    """{name: dtype} of every tensor in the folder's safetensors, and config.json's torch_dtype."""
    dtypes = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            dtypes.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    return set(dtypes.values()), json.loads((folder / "config.json").read_text()).get("torch_dtype")


# -----------------------------------------------------------------------------
# Dtypes inside a step


def test_softmax_is_float32_from_bf16_hidden_states(base):
    """Under bf16 autocast the head's logits are bf16; the entropy pass and the loss must take their softmax in
    float32 (equal to a float64 softmax of the same bf16 logits to ~1e-6), not in bf16 (off by ~1e-2)."""
    model = LLaDA.from_pretrained(base / "model")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (2, 24), generator=g)
    answer = torch.arange(24)[None].expand(2, -1) >= 8
    with torch.no_grad(), CPU_BF16:
        x = ids.masked_fill(answer, model.config.mask_token_id)
        logits = model.head(model(x, return_hidden=True)[answer])  # (N, V)
        H, nll = model_entropy_and_nll(model, ids, answer)
        ce = chunked_cross_entropy(model.head, model(x, return_hidden=True)[answer], ids[answer], chunk_size=5)
    assert logits.dtype == torch.bfloat16 and H.dtype == torch.float32
    logp64 = F.log_softmax(logits.double(), -1)
    H64, nll64 = -(logp64.exp() * logp64).sum(-1), -logp64.gather(-1, ids[answer][:, None])[:, 0]
    torch.testing.assert_close(H[answer].double(), H64, rtol=0, atol=2e-5)
    torch.testing.assert_close(nll[answer].double(), nll64, rtol=0, atol=2e-5)
    torch.testing.assert_close(ce.double(), nll64, rtol=0, atol=2e-5)
    logp16 = F.log_softmax(logits, -1)  # what a bf16 softmax would give
    assert (-(logp16.exp() * logp16).sum(-1).double() - H64).abs().max() > 1e-3
    # a bf16 model without autocast (the casts are ours, not autocast's)
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        h = model(x, return_hidden=True)[answer]
        logp64 = F.log_softmax(model.head(h).double(), -1)
        ce = chunked_cross_entropy(model.head, h, ids[answer], chunk_size=5)
        H, _ = model_entropy_and_nll(model, ids, answer)
    torch.testing.assert_close(ce.double(), -logp64.gather(-1, ids[answer][:, None])[:, 0], rtol=0, atol=2e-5)
    torch.testing.assert_close(H[answer].double(), -(logp64.exp() * logp64).sum(-1), rtol=0, atol=2e-5)


def test_bf16_lora_keeps_adapters_and_adamw_states_float32(base):
    model = gift.wrap_model(LLaDA.from_pretrained(base / "model"), torch.device("cpu"), torch.bfloat16, world=1,
                            lora=dict(r=4, alpha=8, dropout=0.1, targets=("q_proj", "v_proj")))
    trained = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    optimizer = torch.optim.AdamW(trained, lr=1e-3)
    ids = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = gift.MicroBatch(ids, torch.arange(16)[None].expand(2, -1) >= 6, torch.Generator().manual_seed(2))
    for _ in range(2):
        result = gift.train_step(model, optimizer, [batch], "gift", autocast=CPU_BF16)
        assert result["stepped"]
    states = [t for p in trained for t in optimizer.state[p].values() if t.dim() > 0]
    assert len(states) == 2 * len(trained) and all(t.dtype == torch.float32 for t in states)
    assert all(p.dtype == torch.float32 for p in trained) and all(p.dtype == torch.bfloat16 for p in frozen)


# -----------------------------------------------------------------------------
# bf16 runs end to end, one and two processes


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_bf16_run_learns(bf16_base, tmp_path, mode):
    out = tmp_path / "run"
    main(train_args(bf16_base, out, "--dtype", "bfloat16", "--epochs", "4", "--loss", "gift",
                    *(["--lora"] if mode == "lora" else [])))
    losses = [r["loss"] for r in metrics(out)]
    assert len(losses) == 12 and all(loss is not None for loss in losses)
    assert sum(losses[-4:]) / 4 < 0.6 * losses[0]  # 23 -> ~8 (LoRA) or ~6 (full)
    # and it really computed in bf16: its first loss is the float32 run's to bf16 rounding, not to float32's
    main(train_args(bf16_base, tmp_path / "f32", "--dtype", "float32", "--max-steps", "1", "--loss", "gift",
                    *(["--lora"] if mode == "lora" else [])))
    assert 1e-5 < abs(losses[0] / metrics(tmp_path / "f32")[0]["loss"] - 1) < 1e-2


def torchrun(nproc, argv):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(REPO / "gift.py"), *argv]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_bf16_two_processes_equal_one_within_bf16_rounding(bf16_base, tmp_path, mode):
    """LoRA: both runs compute the same bf16 ops (a bf16 base under autocast), only the rows are batched
    differently, so they agree to a few bf16 roundings (2^-8 = 0.4% each). Full fine-tuning: FSDP2 computes with
    bf16 COPIES of the parameters (MixedPrecisionPolicy) where one process autocasts float32 parameters, so norms and
    embeddings round differently too: the first step's loss and gradient norm agree to 1% (a missing world-size
    factor would halve the norm), later losses to 5%, and the weights to 2 lr per step (AdamW's update is nearly
    sign(g) * lr: a gradient component near 0 may flip sign under bf16 noise) and on average far closer."""
    lr, steps = 3e-3, 3
    extra = ["--dtype", "bfloat16", "--loss", "gift", "--max-steps", str(steps)] + (["--lora"] if mode == "lora"
                                                                                     else [])
    one, two = tmp_path / "one", tmp_path / "two"
    torchrun(1, train_args(bf16_base, one, *extra, batch_size=2))
    torchrun(2, train_args(bf16_base, two, *extra, batch_size=1))
    a, b = metrics(one), metrics(two)
    assert a[0]["loss"] == pytest.approx(b[0]["loss"], rel=1e-2)
    assert a[0]["grad_norm"] == pytest.approx(b[0]["grad_norm"], rel=1e-2)
    for ra, rb in zip(a[1:], b[1:]):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=5e-2)
    wa, wb = final_weights(one, mode == "lora"), final_weights(two, mode == "lora")
    for k in wa:
        diff = (wa[k].float() - wb[k].float()).abs()
        assert diff.max() <= 2 * lr * steps + 1e-2 * wa[k].float().abs().max(), k
        assert diff.mean() <= 0.2 * lr * steps, k


# -----------------------------------------------------------------------------
# Exports


def test_full_export_keeps_the_base_dtype_unless_asked(bf16_base, base, tmp_path):
    main(train_args(bf16_base, tmp_path / "bf16", "--max-steps", "1"))
    assert stored(latest(tmp_path / "bf16") / "model") == ({"BF16"}, "bfloat16")  # bf16 in, bf16 out
    main(train_args(bf16_base, tmp_path / "f32", "--max-steps", "1", "--save-dtype", "float32"))
    assert stored(latest(tmp_path / "f32") / "model") == ({"F32"}, "float32")
    main(train_args(base, tmp_path / "base32", "--max-steps", "1"))
    assert stored(latest(tmp_path / "base32") / "model") == ({"F32"}, "float32")
    # the bf16 export is the float32 training weights rounded, nothing else
    full = LLaDA.from_pretrained(latest(tmp_path / "f32") / "model")
    half = LLaDA.from_pretrained(latest(tmp_path / "bf16") / "model")
    for (k, a), (_, b) in zip(full.state_dict().items(), half.state_dict().items()):
        assert torch.equal(a.to(torch.bfloat16), b), k


def test_lora_merged_export_loads_directly_and_equals_the_merged_adapter(bf16_base, tmp_path):
    out = tmp_path / "lora"
    main(train_args(bf16_base, out, "--lora", "--max-steps", "2", "--save-merged", "--lora-targets",
                    "q_proj,v_proj,ff_out"))
    merged_dir = latest(out) / "merged"
    assert stored(merged_dir) == ({"BF16"}, "bfloat16")
    assert (merged_dir / "tokenizer.json").exists()
    merged = LLaDA.from_pretrained(merged_dir)  # what eval.py and sample.py call
    expected = merge_lora(load_adapter(LLaDA.from_pretrained(bf16_base / "model"), latest(out) / "adapter"))
    changed = 0
    for (k, a), (_, b) in zip(expected.state_dict().items(), merged.state_dict().items()):
        assert torch.equal(a, b), k
        changed += not torch.equal(a, LLaDA.from_pretrained(bf16_base / "model").state_dict()[k])
    assert changed >= 2 * 3  # q, v and ff_out of both blocks moved
    with pytest.raises(SystemExit):
        gift.parse_options(train_args(bf16_base, out, "--save-merged"))  # full fine-tuning: model/ is the export


# -----------------------------------------------------------------------------
# FSDP2 from the meta device


def test_fsdp2_meta_loading_equals_loading_the_whole_model():
    """bench/fsdp_load.py --smoke: 2 processes load a model sharded by FSDP2 both ways (every rank the whole float32
    model, then shard; or the meta device, shard, then each rank reads its rows) and compare every local shard."""
    result = subprocess.run([sys.executable, str(REPO / "bench" / "fsdp_load.py"), "--smoke"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "local shards identical on every rank: yes" in result.stdout


def test_meta_loading_refuses_a_checkpoint_that_does_not_match(base, tmp_path):
    config = LLaDAConfig.from_json(base / "model" / "config.json")
    with torch.device("meta"):
        model = LLaDA(dataclasses.replace(config, n_layers=3))
    model.to_empty(device="cpu")
    from model import load_weight_rows
    with pytest.raises(ValueError, match="missing keys.*blocks.2"):
        load_weight_rows(model, base / "model", rank=0, world=1)


def test_rope_tables_reach_fsdp2_blocks_in_float32_under_activation_checkpointing():
    """Why LLaDA.forward hands RoPE to the blocks as one complex tensor: FSDP2's bf16 MixedPrecisionPolicy (torch 2.13)
    casts every floating-point input of a sharded block to bf16, so float32 cos / sin tables would be rounded, as the
    official float32 RoPE (rope_full_precision) is not; a complex tensor is passed through as it is. One process, a
    process group of one (gloo), one FSDP2 group per block, activation checkpointing on, a gradient-enabled forward."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        probe = torch.nn.Linear(4, 4)
        fully_shard(probe, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        seen = []
        probe.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
        probe(torch.zeros(2, 4))
        assert seen == [torch.bfloat16]  # a float32 input is cast: the reason for the complex tables

        config = LLaDAConfig(d_model=16, n_heads=2, n_kv_heads=2, n_layers=2, mlp_hidden_size=32, vocab_size=40,
                             embedding_size=40, mask_token_id=39, eos_token_id=38, pad_token_id=38,
                             max_sequence_length=32)
        model = LLaDA(config).init_weights(torch.Generator().manual_seed(0))
        model.set_activation_checkpointing(True)
        gift.fsdp_shard(model, torch.device("cpu"), torch.bfloat16, one_group_max=0)  # one group per block
        ropes = []
        model.model.transformer.blocks[0].register_forward_pre_hook(lambda m, args: ropes.append(args[1]))
        model(torch.randint(0, 38, (2, 12), generator=torch.Generator().manual_seed(1))).float().sum().backward()
        assert ropes and all(r.dtype == torch.complex64 for r in ropes)
        cos, sin = M.rope_cos_sin(12, config.head_dim, config.rope_theta, "cpu")
        assert torch.equal(ropes[0].real, cos) and torch.equal(ropes[0].imag, sin)  # the float32 tables, unrounded
    finally:
        dist.destroy_process_group()
