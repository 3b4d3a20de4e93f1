"""Peak host memory of loading a full fine-tuning model into FSDP2, per rank: the whole model first, or the meta device.

    python bench/fsdp_load.py            # a ~134M-parameter LLaDA (d_model 768, 12 layers, vocab 32k), 2 processes
    python bench/fsdp_load.py --smoke    # tiny (tests/test_bf16.py runs this)

"whole": what gift.py did before: every rank reads the whole checkpoint as float32
(LLaDA.from_pretrained(dtype=float32)), then gift.wrap_model shards it with fully_shard. At LLaDA-8B that is 32 GB of
host memory per rank, 8 ranks on one node.
"meta": what gift.py does now: every rank builds the model on the meta device (no memory), gift.wrap_model shards it
and gives each rank empty float32 storage for its own shards, then model.load_weight_rows fills them, each rank
reading only its rows of each tensor from the safetensors files (memory-mapped; a slice is read, cast and copied).
We chose this over rank 0 reading everything and broadcasting (set_model_state_dict(..., broadcast_from_rank0=True)):
rank 0 would still hold the whole model, and the broadcast moves every byte over the network; here no process ever
holds more than its shards.

The checkpoint is written once in bf16 as several safetensors shards with an index (as LLaDA-8B's). Each mode runs in
fresh processes under torchrun (gloo); a worker reports its resident memory before loading (torch imported, the
process group up) and its peak (VmHWM) after, and saves its local shards; the parent checks that both modes give
every rank identical shards and prints the peaks and their ratio.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's top-level files are plain modules
from gift import wrap_model  # noqa: E402
from model import LLaDA, LLaDAConfig, load_weight_rows  # noqa: E402

DEFAULTS = dict(d_model=768, n_layers=12, n_heads=12, mlp=2048, vocab=32000, nproc=2)
SMOKE = dict(d_model=64, n_layers=2, n_heads=4, mlp=128, vocab=512, nproc=2)
MODES = ("whole", "meta")


def memory_kb(field):
    """VmRSS (now) or VmHWM (peak) of this process from /proc/self/status, in KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def write_checkpoint(a, folder):
    config = LLaDAConfig(d_model=a.d_model, n_heads=a.n_heads, n_kv_heads=a.n_heads, n_layers=a.n_layers,
                         mlp_hidden_size=a.mlp, vocab_size=a.vocab, embedding_size=a.vocab, mask_token_id=a.vocab - 1,
                         eos_token_id=a.vocab - 2, pad_token_id=a.vocab - 2)
    model = LLaDA(config).init_weights(torch.Generator().manual_seed(0)).to(torch.bfloat16)
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(folder, max_shard_bytes=n_bytes // 3)  # several shards and an index, as LLaDA-8B
    return sum(p.numel() for p in model.parameters())


def worker(mode, folder, out):
    """One rank: load the model into FSDP2 the `mode` way; save its local shards and its memory figures."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    before = memory_kb("VmRSS")
    device = torch.device("cpu")
    if mode == "whole":
        model = LLaDA.from_pretrained(folder, dtype=torch.float32)
        model = wrap_model(model, device, torch.float32, world)
    else:
        with torch.device("meta"):
            model = LLaDA(LLaDAConfig.from_json(Path(folder) / "config.json"))
        model = wrap_model(model, device, torch.float32, world)
        load_weight_rows(model, folder, rank, world)
    peak = memory_kb("VmHWM")
    shards = {k: p.to_local().detach().clone() for k, p in model.named_parameters()}
    torch.save(shards, Path(out) / f"{mode}-{rank}.pt")
    (Path(out) / f"{mode}-{rank}.json").write_text(json.dumps(dict(before_kb=before, peak_kb=peak)))
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description="Peak host memory per rank of loading a model into FSDP2, two ways.")
    p.add_argument("--smoke", action="store_true", help="tiny model (seconds)")
    for k, v in DEFAULTS.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"default {v} (smoke {SMOKE[k]})")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)  # internal: one torchrun rank
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a.worker, a.folder, a.out)
    for k, v in (SMOKE if a.smoke else DEFAULTS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)

    with tempfile.TemporaryDirectory() as tmp:
        folder, out = Path(tmp) / "model", Path(tmp)
        n_params = write_checkpoint(a, folder)
        for mode in MODES:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(a.nproc),
                   str(Path(__file__).resolve()), "--worker", mode, "--folder", str(folder), "--out", str(out)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
            result = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if result.returncode != 0:
                raise RuntimeError(f"bench/fsdp_load.py: the {mode} workers failed:\n{result.stderr[-3000:]}")
        figures = {(m, r): json.loads((out / f"{m}-{r}.json").read_text()) for m in MODES for r in range(a.nproc)}
        same = all(
            all(torch.equal(x, y) for x, y in zip(torch.load(out / f"whole-{r}.pt").values(),
                                                   torch.load(out / f"meta-{r}.pt").values()))
            for r in range(a.nproc))

    print(f"LLaDA d_model {a.d_model}, {a.n_layers} layers, mlp {a.mlp}, vocab {a.vocab}: {n_params / 1e6:.1f}M "
          f"parameters ({4 * n_params / 2**20:.0f} MiB in float32), stored in bf16; FSDP2 over {a.nproc} processes")
    print(f"{'mode':6} {'rank':>4} {'before MiB':>10} {'peak MiB':>9} {'peak - before':>13}")
    for (mode, rank), f in figures.items():
        print(f"{mode:6} {rank:4d} {f['before_kb'] / 1024:10.0f} {f['peak_kb'] / 1024:9.0f} "
              f"{(f['peak_kb'] - f['before_kb']) / 1024:13.0f}")
    for rank in range(a.nproc):
        w, m = figures[("whole", rank)], figures[("meta", rank)]
        loading = (m["peak_kb"] - m["before_kb"]) / (w["peak_kb"] - w["before_kb"])
        print(f"rank {rank}: meta / whole peak {m['peak_kb'] / w['peak_kb']:.2f}, "
              f"of the loading itself (peak - before) {loading:.2f}")
    print(f"local shards identical on every rank: {'yes' if same else 'NO'}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
