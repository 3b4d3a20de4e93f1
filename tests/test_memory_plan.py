"""bench/memory_plan.py: its parameter counts are the model's, its terms add up, and its CPU check runs."""

import sys

import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import memory_plan  # noqa: E402

from model import LLaDA, LLaDAConfig, add_lora  # noqa: E402


def test_parameter_counts_are_the_models():
    s = memory_plan.LLADA_8B
    config = LLaDAConfig(d_model=s["d_model"], n_heads=s["n_heads"], n_kv_heads=s["n_heads"], n_layers=s["n_layers"],
                         mlp_hidden_size=s["mlp"], vocab_size=s["vocab"], embedding_size=s["vocab"],
                         mask_token_id=126336, eos_token_id=126081, pad_token_id=126081)
    with torch.device("meta"):
        model = LLaDA(config)
    assert memory_plan.params(**s)["total"] == sum(p.numel() for p in model.parameters())  # 8.02B
    small = dict(d_model=32, n_layers=2, n_heads=4, mlp=64, vocab=48)
    small_config = LLaDAConfig(d_model=32, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=64, vocab_size=48,
                               embedding_size=48, mask_token_id=47, eos_token_id=46, pad_token_id=46)
    model = add_lora(LLaDA(small_config), r=8)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    terms = dict(memory_plan.lora_plan(small, 16, r=8))
    assert terms["adapters (float32)"] == 4 * adapters


def test_the_tables_add_up_and_the_smoke_check_runs(capsys):
    totals = memory_plan.main(["--smoke"])
    out = capsys.readouterr().out
    assert f"{totals['full'] / memory_plan.GiB:7.2f} GiB -> fits" in out
    assert "does NOT fit" in out  # full fine-tuning without checkpointing
    s = memory_plan.LLADA_8B
    assert totals["lora"] == sum(b for _, b in memory_plan.lora_plan(s, 4096, 128))
    # the check's prediction is the formula's (the measured side of a tiny shape is mostly allocator noise: the
    # real check is --check, whose figures are in bench/README.md)
    shape = memory_plan.SMOKE_CHECK[0]
    predicted = memory_plan.cpu_step_prediction(shape, shape["seq"])
    assert f"predicted {predicted / 2**20:.0f} MiB, measured " in out
    assert float(out.split("measured / predicted ")[1].split()[0]) > 0
