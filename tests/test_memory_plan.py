"""bench/memory_plan.py: its parameter counts are the model's (LLaDA-8B, Dream-v0-7B, a tied head), its activation
formula is what autograd saves (LLaDA, and Dream-like: GQA, q/k/v biases, RoPE in bf16), its terms add up to the
printed totals, and its smoke mode (tables + a tiny measured check) runs. The measured check at real shapes is
`python bench/memory_plan.py --check` (figures in bench/README.md, sections 4 and 6)."""

import contextlib
import io
import sys

import pytest
import torch
from conftest import REPO, tiny_config

sys.path.insert(0, str(REPO / "bench"))
import memory_plan  # noqa: E402

from gift import wrap_model  # noqa: E402
from model import LLaDA, add_lora  # noqa: E402

GiB = memory_plan.GiB


@pytest.fixture(scope="module")
def smoke_output():
    """What `python bench/memory_plan.py --smoke` prints, its main run in this process: the tables need no fresh
    one, and the check's steps run in fresh worker processes of their own (started together in smoke mode)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        memory_plan.main(["--smoke", "--threads", "1"])
    return out.getvalue()


DREAM = dict(model_type="Dream", include_qkv_bias=True, rope_theta=1e6, rms_norm_eps=1e-6)  # Dream-v0's fields


def small_config(n_kv_heads=4, V=96, family="llada"):
    return tiny_config(V, n_kv_heads=n_kv_heads, n_layers=3, mlp_hidden_size=80, **(DREAM if family == "dream" else {}))


def test_parameter_count_of_llada_8b_is_the_models():
    config = memory_plan.llada_8b()
    with torch.device("meta"):
        model = LLaDA(config)
    counts = memory_plan.param_counts(config)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert 8.0e9 < counts["total"] < 8.05e9  # LLaDA-8B: 8,015,581,184
    blocks = model.model.transformer.blocks
    assert counts["block"] == sum(p.numel() for p in blocks[0].parameters())


def test_parameter_count_of_dream_7b_is_the_models():
    """Dream-v0-7B at its real shapes (GQA, q/k/v biases, untied head), on the meta device; and a tied head counted
    once."""
    config = memory_plan.dream_7b()
    with torch.device("meta"):
        model = LLaDA(config)
    counts = memory_plan.param_counts(config)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["total"] == 7_615_616_512  # Dream-v0-7B (Qwen2.5-7B's shapes): 7.62B
    assert counts["block"] == sum(p.numel() for p in model.model.transformer.blocks[0].parameters())
    tied = small_config(2, family="dream")
    tied.weight_tying = True
    model = LLaDA(tied)
    counts = memory_plan.param_counts(tied)
    assert counts["head"] == 0 and counts["total"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_lora_count_is_what_add_lora_creates(n_kv_heads):
    model = add_lora(LLaDA(small_config(n_kv_heads)), r=8, alpha=16, targets=memory_plan.LORA_TARGETS)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert memory_plan.lora_count(model.config, 8) == trainable


def saved_by_autograd(model, input_ids, autocast):
    """Bytes of the tensors autograd keeps after model(input_ids, return_hidden=True), each storage once, the
    parameters not counted (they exist anyway)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = model(input_ids, return_hidden=True)
    del h
    return sum(storages.values())


# (LoRA, activation dtype, parameters as FSDP2 computes them): "bf16 params" is full fine-tuning with bf16
# parameters, what every block computes with under FSDP2's MixedPrecisionPolicy (param_dtype bf16)
CASES = [(True, "float32"), (True, "bfloat16"), (False, "float32"), (False, "bf16 params")]


@pytest.mark.parametrize("family,n_kv_heads", [("llada", 4), ("dream", 2)])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("lora,dtype", CASES)
def test_activation_formula_is_what_autograd_saves(lora, dtype, checkpointing, family, n_kv_heads):
    """Dream-like: k and v of 2 heads beside 4 query heads (GQA), q/k/v biases, RoPE in the activations' dtype."""
    cfg = small_config(n_kv_heads, family=family)
    B, L = 2, 24
    model = LLaDA(cfg).init_weights(torch.Generator().manual_seed(0))
    bf16 = dtype != "float32"
    if dtype == "bf16 params":
        model.to(torch.bfloat16).set_activation_checkpointing(checkpointing)
    else:
        lora_opts = dict(r=4, alpha=8, dropout=0.05, targets=memory_plan.LORA_TARGETS) if lora else None
        model = wrap_model(model, torch.device("cpu"), torch.bfloat16 if bf16 else torch.float32, 1, lora_opts,
                           checkpointing)
    model.train()
    input_ids = torch.randint(0, cfg.vocab_size - 2, (B, L), generator=torch.Generator().manual_seed(1))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    measured = saved_by_autograd(model, input_ids, autocast)

    s = memory_plan.Setup("test", cfg, batch=B, seq=L, lora_r=4 if lora else 0, a=2 if bf16 else 4,
                          sharding="fsdp2" if dtype == "bf16 params" else "none", checkpointing=checkpointing,
                          device="cpu", n_masked=0)
    predicted = memory_plan.saved_activations(s, cfg.n_layers)[1] + memory_plan.after_blocks(s)[1]
    if checkpointing or cfg.family.rope_in_float32 or not bf16:  # else Dream's bf16 copies per block, in the formula
        predicted += 2 * L * cfg.head_dim * 4  # RoPE's cos and sin (float32), made once per forward
    if not lora:
        predicted += 8 * B * L  # the embedding's token ids (int64), kept for wte's gradient
    assert measured == predicted


def test_terms_add_up_and_the_peak_is_the_largest_moment():
    for s in [*memory_plan.recipes().values(), *memory_plan.dream_recipes().values()]:
        p = memory_plan.plan(s)
        persistent = sum(t[2] for t in p["persistent"])
        assert p["totals"][p["peak"]] == max(p["totals"].values())
        assert p["tensors"] == persistent + p["totals"][p["peak"]]
        assert p["total"] == pytest.approx(p["tensors"] * (1 + memory_plan.FRAGMENTATION)
                                           + memory_plan.CUDA_FIXED_GIB * GiB)


def test_smoke_prints_tables_that_add_up(smoke_output):
    blocks = smoke_output.split("\n\n")
    assert blocks[0].startswith("LLaDA-8B: ") and blocks[5].startswith("Dream-v0-7B: ")  # each family's header
    tables, check = blocks[1:5] + blocks[6:-1], blocks[-1]
    assert len(tables) == len(memory_plan.recipes()) + len(memory_plan.dream_recipes()) == 6
    for table in tables:
        lines = table.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("  term "))
        end = next(i for i, line in enumerate(lines) if line.startswith("  total per GPU"))
        rows = [line for line in lines[start:end] if line.startswith("    ")]  # one row per term
        assert len(rows) >= 5
        total = float(lines[end].split()[-1])
        assert sum(float(line.split()[-1]) for line in rows) == pytest.approx(total, abs=0.005 * len(rows))
        verdict = next(line for line in lines if line.startswith("  verdict: "))
        assert ("fits" in verdict) == (total <= memory_plan.H100_GIB) and "margin" in verdict
    assert check.startswith("check: ")
    for name in memory_plan.SMOKE_CHECKS:
        assert f"\n  {name} " in check
