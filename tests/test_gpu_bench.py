"""bench/gpu.py --smoke: the GPU command's code on the CPU at tiny shapes, so that it cannot rot between GPU runs.
Every section is in the JSON with finite figures, and in the markdown. Its main runs in this process (it needs no
fresh one: the device tests, the memory measurement and FSDP2 run in subprocesses of their own, as on a GPU). A
section that fails is recorded with its traceback while the others still run, and --sections picks sections."""

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


def load_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "bench" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    return gpu


def test_gpu_bench_smoke_writes_every_section(tmp_path, monkeypatch, capsys, one_thread):
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")  # for its subprocesses: pytest, the memory worker, torchrun
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    gpu = load_gpu()
    try:
        gpu.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)])
    except SystemExit as e:  # a failed section (or failed device tests): exit status 1
        out = capsys.readouterr()
        pytest.fail(f"bench/gpu.py --smoke exited {e.code}:\n{out.out[-3000:]}\n{out.err[-3000:]}")
    results = json.loads((tmp_path / "gpu-cpu.json").read_text())
    md = (tmp_path / "gpu-cpu.md").read_text()

    assert results["sections"] == list(gpu.ORDER)
    for section in gpu.ORDER:
        assert "error" not in results[section] and "not_run" not in results[section], section
        figures = numbers(results[section])
        assert figures and all(math.isfinite(f) for f in figures), section
    assert results["tests"]["passed"] > 0 and results["tests"]["failed"] == 0
    assert {r["loss"] for r in results["train"]["rows"]} >= {"sft", "gift", "gift-reuse"}
    assert all(r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in results["train"]["rows"])
    assert results["train"]["memory"]["measured_gib"] > 0 and results["train"]["memory"]["plan_gib"] > 0
    assert {r["mode"] for r in results["sampler"]["rows"]} >= {"exact", "prefix", "dual"}
    assert any("threshold" in r["mode"] for r in results["sampler"]["rows"])
    assert results["fsdp"]["world"] == 1 and results["fsdp"]["tokens_per_s"] > 0
    # e. the sampler at every batch, exact and the dual cache with refresh and threshold
    e = results["sampler_8b"]
    assert {(r["batch"], r["mode"]) for r in e["rows"]} == {(b, m) for b in gpu.SMOKE["e_batches"] for m, *_ in
                                                             gpu.E_MODES}
    assert all(r["tps"] > 0 and r["forwards"] > 0 and r["tflops"] > 0 for r in e["rows"])
    threshold = [r for r in e["rows"] if "threshold" in r["mode"]]
    assert all(r["forwards_per_block"] == e["block_length"] for r in threshold)  # random weights: one token a step
    # f. the phases of a GIFT LoRA step and the profiler's tables
    f = results["profile"]
    assert "profiler_error" not in f, f.get("profiler_error")
    phases = {r["phase"]: r for r in f["phases"]}
    assert {"entropy pass: blocks (no grad)", "loss pass: blocks forward", "backward: blocks (LoRA)",
            "backward: CE chunks (head recompute, grad)", "AdamW step"} <= set(phases)
    assert all(r["ms"] >= 0 for r in f["phases"]) and f["train_step_ms"] > 0
    assert f["categories"] and f["top_kernels"] and f["top_ops"]
    assert any(c["category"] == "matmul (GEMM)" for c in f["categories"])
    # g. Dream-like LoRA step: GIFT and SFT, and the GIFT step's memory against the plan
    g = results["dream"]
    assert [r["loss"] for r in g["rows"]] == ["sft", "gift"] and g["n_kv_heads"] < g["n_heads"]
    assert all(r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in g["rows"])
    assert g["memory"]["measured_gib"] > 0 and g["memory"]["plan_gib"] > 0
    for heading in ("a. tests", "b. one LoRA step", "c. sampler", "d. FSDP2", "e. sampler", "f. one GIFT LoRA step",
                    "g. one LoRA step at Dream-v0-7B", "989"):
        assert heading in md


def test_gpu_bench_records_a_failed_section_and_runs_the_rest(tmp_path, monkeypatch, capsys, one_thread):
    """--sections in any order runs them in gpu.ORDER; a section that raises is in the JSON and markdown with its
    traceback, the next one still runs, and the exit status is 1."""
    gpu = load_gpu()
    assert gpu.parse_args(["--sections", "g,e,tests"]).sections == ["sampler_8b", "dream", "tests"]
    with pytest.raises(SystemExit):
        gpu.parse_args(["--sections", "e,x"])

    def broken(a):
        raise RuntimeError("a broken section")
    monkeypatch.setattr(gpu, "run_sampler_8b", broken)
    monkeypatch.setattr(gpu, "run_profile", lambda a: dict(phases=[]))  # a result the markdown cannot format
    with pytest.raises(SystemExit) as exit_info:
        gpu.main(["--smoke", "--device", "cpu", "--out", str(tmp_path), "--sections", "g,e,f"])
    assert exit_info.value.code == 1
    results = json.loads((tmp_path / "gpu-cpu.json").read_text())
    assert results["sampler_8b"]["error"] == "RuntimeError: a broken section"
    assert "broken" in results["sampler_8b"]["traceback"]
    assert results["dream"]["rows"] and "error" not in results["dream"]
    md = (tmp_path / "gpu-cpu.md").read_text()
    assert "e. sampler_8b: FAILED" in md and "f. profile: could not be formatted" in md and "g. one LoRA step" in md
