"""bench/gpu.py --smoke: the GPU command's code on the CPU at tiny shapes, so that it cannot rot between GPU runs.
Every section is in the JSON with finite figures, and in the markdown. Its main runs in this process (it needs no
fresh one: the device tests, the memory measurement and FSDP2 run in subprocesses of their own, as on a GPU)."""

import importlib.util
import json
import math

import pytest
from conftest import REPO


def numbers(x):
    """Every int and float inside a JSON value."""
    if isinstance(x, dict):
        return [n for v in x.values() for n in numbers(v)]
    if isinstance(x, list):
        return [n for v in x for n in numbers(v)]
    return [x] if isinstance(x, (int, float)) and not isinstance(x, bool) else []


def test_gpu_bench_smoke_writes_every_section(tmp_path, monkeypatch, capsys, one_thread):
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")  # for its subprocesses: pytest, the memory worker, torchrun
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "bench" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    try:
        gpu.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)])
    except SystemExit as e:  # a failed section (or failed device tests): exit status 1
        out = capsys.readouterr()
        pytest.fail(f"bench/gpu.py --smoke exited {e.code}:\n{out.out[-3000:]}\n{out.err[-3000:]}")
    results = json.loads((tmp_path / "gpu-cpu.json").read_text())
    md = (tmp_path / "gpu-cpu.md").read_text()

    for section in ("tests", "train", "sampler", "fsdp"):
        figures = numbers(results[section])
        assert figures and all(math.isfinite(f) for f in figures), section
    assert results["tests"]["passed"] > 0 and results["tests"]["failed"] == 0
    assert {r["loss"] for r in results["train"]["rows"]} >= {"sft", "gift", "gift-reuse"}
    assert all(r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in results["train"]["rows"])
    assert results["train"]["memory"]["measured_gib"] > 0 and results["train"]["memory"]["plan_gib"] > 0
    assert {r["mode"] for r in results["sampler"]["rows"]} >= {"exact", "prefix", "dual"}
    assert any("threshold" in r["mode"] for r in results["sampler"]["rows"])
    assert results["fsdp"]["world"] == 1 and results["fsdp"]["tokens_per_s"] > 0
    for heading in ("a. tests", "b. one LoRA step", "c. sampler", "d. FSDP2", "989"):
        assert heading in md
