"""The long-job machinery of gift.py, sample.py and eval.py, which a reader of the paper's method can skip (its
collectives are the method's only where train_step calls them: the all-reduce of Algorithm 2's N): what lets an
8-GPU run go on for hours, stop at any moment and continue exactly (docs/long_runs.md says what it guarantees).
Its sections: processes (ranks, collectives), command lines, fingerprints, what a path names, the output folder
(lock, status.json, preemption), checkpoints (TrainState, CheckpointManager), the metrics log, eval.py's records.
It imports model.py and adapters.py only: it is handed names and callables (the embedded task's files, embedded.py's,
from gift.py), and never imports the trainer.
"""

import argparse
import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import hashlib
import io
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from adapters import ADAPTER_BASE, load_adapter, read_adapter_config, save_adapter
from model import (GENERATION_DEFAULTS, LLaDA, atomic_write_text, merge_lora, merged_state_dict, open_regular,
                   read_json, unwrap, weight_files)


# ---------------------------------------------------------------------------------------------------------------------
# Processes: torchrun's ranks, rank 0's prints and the collectives a step needs, each a no-op for one process


def setup_distributed(group_of_one=False):
    """(rank, world size, device) from torchrun's environment, or one process without it; the process group (NCCL on
    GPUs, gloo on the CPU) starts when world > 1, or for one process with `group_of_one` (FSDP2's --cpu-offload)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank, cuda = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if (world > 1 or group_of_one) and not torch.distributed.is_initialized():  # one process: a group of its own
        alone = {} if world > 1 else dict(store=torch.distributed.HashStore(), rank=0, world_size=1)
        torch.distributed.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None, **alone)
    return rank, world, device


# Every command line's seed rule: seeds derived (largest: mixed_seed(seed, epoch) * 10_000_019 + index) fit in 64 bits
SEEDS = range(1_000_000)
SEED_RULE = "in [0, 1000000) (every generator seed derived from it fits in 64 bits)"


def end_distributed():
    """Tear the process group down once every rank is done with every collective. The sleep releases the GIL for gloo's
    threads to drop their last tensors: destroying the group joins them holding it, a deadlock (torch 2.13 on CPU)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        time.sleep(0.2)
        torch.distributed.destroy_process_group()


def is_rank0():
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args):
    if is_rank0():
        print(*args, flush=True)


def barrier():
    if dist.is_initialized():
        dist.barrier()


def all_reduce(values, device, op="sum"):
    """A list of floats summed over ranks (op="max": their largest), in float64."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.tolist()


def gather_objects(obj):
    """Every rank's object, on every rank, in rank order."""
    if dist.is_initialized():
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def broadcast_object(obj):
    """Rank 0's `obj` on every rank."""
    box = [obj]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def on_rank0(fn):
    """fn() on rank 0; its result there, None elsewhere. Its exception is raised on every rank: none waits forever."""
    result, error = None, None
    if is_rank0():
        try:
            result = fn()
        except Exception as e:  # re-raised below, on every rank
            error = e
    error = broadcast_object(error)
    if error is not None:
        raise error
    return result


def rank_and_world():
    """(rank, world size) of this process; (0, 1) without torch.distributed."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def compute_device(model):
    """The device the model computes on: its parameters', or under --cpu-offload (parameters on the host) the GPU."""
    device = next(model.parameters()).device
    if device.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def is_sharded(model):
    """Whether FSDP2 shards the model (its parameters are DTensors: a full state dict is a collective)."""
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


# ---------------------------------------------------------------------------------------------------------------------
# Command lines: flags from dataclasses, --dtype, a user's mistake in one line


class RunError(RuntimeError):
    """A run that cannot go on for a reason the user can fix: `python gift.py` prints it in one line, no traceback."""


def run_command_line(main, name, rank0_only=False, errors=(ValueError, OSError)):
    """main() for `python <name>`: a user's mistake (one of `errors`: a flag, a file, a folder, a data row, a prompt)
    ends in one line, "<name>: error: ..." on stderr, exit status 1 (tracebacks are for bugs); rank0_only: rank 0's."""
    try:
        main()
    except errors as e:
        if not rank0_only or is_rank0():
            print(f"{name}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:  # Ctrl-C: one line, and the shell's status for SIGINT
        print(f"{name}: interrupted{': ' + str(e) if str(e) else ''}", file=sys.stderr)
        sys.exit(130)


def parse_dataclass_flags(parser, cls, argv=None):
    """add_dataclass_flags, then parse (unknown flags are an error): the fields given (a flag given as 0 is given)."""
    add_dataclass_flags(parser, cls)
    return {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}


def add_dataclass_flags(parser, cls):
    """One flag per field of the dataclass `cls` (--name-with-dashes, typed, its help and choices from the field's
    metadata), each defaulting to None, so that a flag not given can be told from one given with the default; a field
    whose metadata says flag=False is none (set by the program)."""
    for f in (f for f in dataclasses.fields(cls) if f.metadata.get("flag", True)):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f.metadata["help"])
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type, f.type) if isinstance(f.type, str) else f.type
            parser.add_argument(flag, type=kind, default=None, choices=f.metadata.get("choices"),
                                help=f"{f.metadata['help']} (default {f.default!r})")


DTYPES = ("auto", "bfloat16", "float32")  # --dtype's choices (+ float64 where a check wants it: the harness)


def add_model_flags(parser):
    """--model and --adapter, as sample.py and eval.py take them (find_model: a run or checkpoint finds its model)."""
    parser.add_argument("--model", required=True, help="model folder (config.json, safetensors, tokenizer.json), or "
                        "what gift.py printed: a checkpoint or run folder")
    parser.add_argument("--adapter", default=None, help="LoRA adapter folder (adapter_config.json, "
                        "adapter_model.safetensors), merged before sampling")


def add_dtype_flag(parser, choices=DTYPES):
    """--dtype, as every command line takes it (gift.py's is TrainOptions.dtype, with these choices)."""
    parser.add_argument("--dtype", choices=choices, default="auto",
                        help="compute dtype of the weights (auto: bfloat16 on a GPU, float32 on the CPU)")


def compute_dtype(name, device):
    """A --dtype flag's value as a torch dtype: auto is bfloat16 on a GPU, float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, name)


# ---------------------------------------------------------------------------------------------------------------------
# Fingerprints: short sha256 prefixes that tell a changed base model or data apart (checkpoints record them; --resume
# refuses another base). Whole-file hashes of weight files are cached in memory and in this file (file_sha256):
WEIGHT_HASH_CACHE = Path(os.environ.get("GIFT_CACHE_DIR") or Path.home() / ".cache" / "gift") / "weight_hashes.json"
WEIGHT_HASH_CACHE_SIZE = 4096  # entries kept (a few hundred bytes each)
RACY_SECONDS = 2  # a file changed this recently may change again within the same timestamp: hashed, not cached
_weight_hashes = {}  # this process's
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt")  # a fast tokenizer, or a slow one's two files


def folder_fingerprint(folder):
    """sha256 of a Hugging Face folder's config.json, tokenizer (TOKENIZER_FILES) and weights, every byte of them: a
    model re-merged or retrained into the same path is another model for eval's resume, --resume and check_adapter.
    The identity every record holds (trainer.json's, eval.py's, adapter_base.json's), so its recipe never moves; where
    a record also holds file_fingerprints, "the same base" is decided file by file (base_changes)."""
    folder = Path(folder)
    tokenizer = TOKENIZER_FILES[:1] if (folder / TOKENIZER_FILES[0]).is_file() else TOKENIZER_FILES[1:]
    return hash_weights(hash_files(folder, ("config.json",) + tokenizer), folder).hexdigest()[:16]


def adapter_fingerprint(folder):
    """sha256 of an adapter's two files, every byte (small beside its base): another adapter at one path is another."""
    return hash_files(folder, ("adapter_config.json", "adapter_model.safetensors"), missing_ok=False).hexdigest()[:16]


def hash_files(folder, names, missing_ok=True):
    """A sha256 fed each named file of `folder` (one missing is skipped, with missing_ok): its name, then its bytes."""
    h = hashlib.sha256()
    for name in names:
        if not missing_ok or (Path(folder) / name).is_file():
            h.update(name.encode() + (Path(folder) / name).read_bytes())
    return h


def hash_weights(h, folder):
    """Feed the hash `h` each safetensors file of `folder`: its name and the sha256 of all its bytes. Returns h."""
    for path in weight_files(folder):
        h.update(f"{path.name} {file_sha256(path)}".encode())
    return h


def file_sha256(path):
    """sha256 of a whole file, cached in memory and in WEIGHT_HASH_CACHE by its real path, size, inode, mtime and ctime:
    LLaDA-8B's 16 GB are read once, not at every start. Any write moves the ctime, which no user call can set back, so
    no changed byte is missed; a file changed in the last RACY_SECONDS is not cached (its timestamp may not move)."""
    st = os.stat(path)
    key = f"{os.path.realpath(path)} {st.st_size} {st.st_ino} {st.st_mtime_ns} {st.st_ctime_ns}"
    if key not in _weight_hashes:
        _weight_hashes.update(json_or_empty(WEIGHT_HASH_CACHE))  # none yet, or unreadable: hashed again
    if key in _weight_hashes:
        return _weight_hashes[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    if time.time() - st.st_ctime_ns / 1e9 > RACY_SECONDS and os.stat(path).st_ctime_ns == st.st_ctime_ns:
        _weight_hashes[key] = h.hexdigest()
        # processes hashing at the same time lose an entry at worst; a cache that cannot be written is only memory
        cache = dict(list({**json_or_empty(WEIGHT_HASH_CACHE), key: h.hexdigest()}.items())[-WEIGHT_HASH_CACHE_SIZE:])
        with contextlib.suppress(OSError):
            WEIGHT_HASH_CACHE.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(WEIGHT_HASH_CACHE, json.dumps(cache))
    return h.hexdigest()


def tensors_fingerprint(model):
    """sha256 of every tensor of a (small) model: the embedded task's base, which exists only in memory."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode() + tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def file_fingerprint(path):
    """sha256 of a base folder's file as "the same base" reads it: a JSON file's parsed content in canonical form
    (sorted keys, no spaces), so that a re-indented config.json is the same file; any other file's bytes."""
    data = Path(path).read_bytes()
    if Path(path).name.endswith(".json"):
        with contextlib.suppress(ValueError, RecursionError):  # not JSON: its bytes
            data = json.dumps(json.loads(data), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def file_fingerprints(folder):
    """The base folder's fingerprint file by file (file_fingerprint; the weights as folder_fingerprint hashes them),
    which --resume and an adapter's record compare (base_changes)."""
    folder = Path(folder)
    prints = {name: file_fingerprint(folder / name) for name in ("config.json",) + TOKENIZER_FILES
              if (folder / name).is_file()}
    prints["weights"] = hash_weights(hashlib.sha256(), folder).hexdigest()[:16]
    return prints


def base_changes(then, now):
    """The one rule of "the same base model", --resume's and an adapter's: the files whose fingerprints differ between
    two file_fingerprints (then: recorded; now: the folder's), as "name (fingerprint A then, B now)"; [] for the
    same."""
    return [f"{name} (fingerprint {then.get(name)} then, {now.get(name)} now)"
            for name in sorted(then.keys() | now.keys()) if then.get(name) != now.get(name)]


def check_same_inputs(fingerprints):
    """Refuse to train when the ranks read different data or base models (a file changed meanwhile, another copy)."""
    every = gather_objects({k: fingerprints.get(k) for k in ("data", "examples", "model", "files")})
    for key, what in (("data", "training data"), ("model", "base model"), ("files", "base model")):
        if any(f[key] != every[0][key] for f in every):
            seen = "; ".join(f"rank {r}: {f[key]}" + (f" ({f['examples']} examples)" if key == "data" else "")
                             for r, f in enumerate(every))
            raise RunError(f"the ranks read different {what} ({seen}): every rank must read the same --data and "
                           "--model (the same files on every node)")


def check_adapter(folder, adapter):
    """--adapter against the model folder, before either loads: a one-line ValueError for a gift.py checkpoint's merged
    export given with its own adapter (added twice), or its adapter, in its checkpoint or copied anywhere, on another
    base than trained on (the one save_adapter recorded, else its checkpoint's trainer.json's): file by file where the
    record has them (base_changes, --resume's rule: a re-indented config.json is the same base), else (a record of
    older code) by folder_fingerprint, every byte."""
    if not adapter:
        return
    if problem := adapter_problem(adapter):  # a model folder given as --adapter, a checkpoint, ...
        raise FileNotFoundError(problem)
    read_adapter_config(adapter)  # its fields, before any weight loads
    model_dir, adapter_dir = Path(folder).resolve(), Path(adapter).resolve()
    checkpoint = adapter_dir.parent  # a gift.py checkpoint: step-N/{adapter, merged, trainer.json}
    if model_dir.name == "merged" and model_dir.parent == checkpoint:
        raise ValueError(f"--adapter {adapter}: the model {folder} is the merged export of the same checkpoint, the "
                         "base with this adapter already folded in, so it would be applied twice; drop --adapter, or "
                         "give the base model with it")
    record = adapter_dir / ADAPTER_BASE
    then, files = adapter_base(record)  # save_adapter's record of the base
    if not then:  # saved without it (PEFT's own, an older one): its gift.py checkpoint's, if it sits in one
        try:
            meta, record = read_json(checkpoint / "trainer.json"), checkpoint / "trainer.json"
            then = meta["options"]["model"] and meta["fingerprints"]["model"]  # the embedded task's base: in memory
            files = meta["fingerprints"].get("files")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return  # nothing recorded to compare with
    if not then:
        return
    changed = base_changes(files, file_fingerprints(folder)) if isinstance(files, dict) else []
    if (changed or not isinstance(files, dict)) and (now := folder_fingerprint(folder)) != then:
        what = f"; its {', '.join(changed)}" if changed else ""
        raise ValueError(f"--adapter {adapter}: trained on a base model with fingerprint {then} ({record}), but "
                         f"{folder} has fingerprint {now}{what}: another model (a merged export, another base, or one "
                         "replaced or retrained into the same path); give the base it was trained on")


def adapter_base(record):
    """(the base fingerprint, its file_fingerprints) in an adapter's ADAPTER_BASE; (None, None) where there is none
    (PEFT's own adapter); the files None in a record of older code, which has only the fingerprint. One that exists
    but cannot be read (not JSON, not save_adapter's object, a FIFO) is a ValueError naming it, never "none"."""
    if not os.path.lexists(record):
        return None, None
    hint = ": save_adapter's record of the adapter's base is damaged; copy it again from the adapter's checkpoint"
    try:
        saved = read_json(record)
    except (OSError, ValueError) as e:
        raise ValueError(f"{e}{hint}") from None
    then, files = saved.get("base_fingerprint"), saved.get("base_files")
    if not isinstance(then, str) or not then:
        raise ValueError(f"{record}: no base_fingerprint string{hint}")
    if files is not None and not (isinstance(files, dict) and all(isinstance(v, str) for v in files.values())):
        raise ValueError(f"{record}: base_files is not an object of fingerprints{hint}")
    return then, files


# ---------------------------------------------------------------------------------------------------------------------
# What a path names: a model folder, a gift.py checkpoint or run folder, an adapter; loading it


def folder_kind(path):
    """What a folder is, by the files its writer leaves: "model" (config.json), "adapter" (adapter_config.json), "run"
    (a gift.py run folder: `latest`), "checkpoint" (a gift.py step-N: model/, merged/ or adapter/), or None."""
    p = Path(path)
    if (p / "config.json").is_file():
        return "model"
    if (p / "adapter_config.json").is_file():
        return "adapter"
    if (p / "latest").is_file():
        return "run"
    if checkpoint_export(p) or (p / "adapter" / "adapter_config.json").is_file():
        return "checkpoint"
    return None


def checkpoint_export(p):
    """A gift.py checkpoint's Hugging Face folder, its model/ or merged/ (None: none, a LoRA run's adapter only)."""
    return next((p / sub for sub in ("model", "merged") if (p / sub / "config.json").is_file()), None)


def find_model(path):
    """What sample.py's or eval.py's --model names, as (model folder, adapter folder or None): a model folder, a gift.py
    checkpoint (its model/, merged/, or adapter/ on the base its adapter_config.json names), or a run (its `latest`)."""
    p, kind = Path(path), folder_kind(path)
    if kind == "run":
        named = (p / "latest").read_text().strip()
        if named and (Path(named).name != named or named in (".", "..")):  # gift.py writes a step-N name only
            raise FileNotFoundError(f"--model {path}: its `latest` file ({p / 'latest'}) names {named!r}, outside the "
                                    f"run folder's checkpoints/; give the checkpoint as --model {p}/checkpoints/step-N")
        if not named or not (p / "checkpoints" / named).is_dir():  # deleted or moved since
            there = sorted(c.name for c in (p / "checkpoints").glob("step-*") if checkpoint_step(c.name) is not None)
            raise FileNotFoundError(f"--model {path}: its `latest` file names the checkpoint {named!r}, and "
                                    f"{p / 'checkpoints' / named} is missing (deleted or moved); the checkpoints "
                                    f"there: {', '.join(there) or 'none'}; give one as --model {p}/checkpoints/step-N")
        p, kind = p / "checkpoints" / named, folder_kind(p / "checkpoints" / named)
    if kind == "model":
        return p, None
    if kind == "adapter":  # the adapter itself, not a checkpoint holding one
        base = read_adapter_config(p).get("base_model_name_or_path") or "BASE_FOLDER"
        raise FileNotFoundError(f"--model {path}: a LoRA adapter folder (adapter_config.json), not a model; give "
                                f"--model {base} --adapter {path}")
    if kind == "checkpoint" and checkpoint_export(p):
        return checkpoint_export(p), None
    if kind == "checkpoint":
        adapter = p / "adapter"
        base = read_adapter_config(adapter).get("base_model_name_or_path") or ""
        if folder_kind(base) == "model":
            return Path(base), adapter
        raise FileNotFoundError(f"{adapter} is a LoRA adapter on {base!r}, which is not a model folder here: give "
                                f"--model BASE_FOLDER --adapter {adapter}")
    raise FileNotFoundError(f"--model {path}: not a model folder (no config.json), nor a gift.py checkpoint (with "
                            "model/, merged/ or adapter/) or run folder (with a `latest` file)")


def not_a_model_folder(path):
    """Why `path` cannot be gift.py's --model (a base model folder), saying what to give instead; None if it can."""
    p, kind = Path(path), folder_kind(path)
    if kind == "adapter":
        return ("a LoRA adapter folder (adapter_config.json), not a model: give the base it was trained on as --model "
                "(its adapter_config.json names it), or merge it first")
    if kind == "run":
        return (f"a gift.py run folder, not a model: continue that run with --resume --out {path}, or give one of its "
                "checkpoints' model/ or merged/ folders as --model")
    if kind == "checkpoint" and checkpoint_export(p):
        return f"a gift.py checkpoint, not a model folder: give --model {checkpoint_export(p)}"
    if kind == "checkpoint":
        return ("a gift.py checkpoint of a LoRA run (adapter/ only): give the base model as --model, or export "
                "merged/ with --save-merged")
    return None  # a model folder, or a folder of no known kind (or none): the loader says what is missing


def adapter_problem(path):
    """Why `path` cannot be given as --adapter, saying what to give instead; None for an adapter folder."""
    if (kind := folder_kind(path)) == "adapter":
        return None
    hint = {"model": f"it is a model folder (config.json): give it as --model {path}",
            "checkpoint": f"it is a gift.py checkpoint: give --adapter {Path(path) / 'adapter'}"}.get(
        kind, "a LoRA adapter folder holds adapter_config.json and adapter_model.safetensors")
    return f"--adapter {path}: no adapter_config.json; {hint}"


@contextlib.contextmanager
def loading(*folders):
    """Reading model folders: an error because one disappeared meanwhile (a running gift.py's rotation) in one line."""
    try:
        yield
    except (OSError, ValueError):
        gone = [p for p in folders if p and not Path(p).is_dir()]
        if not gone:
            raise
        raise FileNotFoundError(f"{gone[0]} was removed while it loaded (a running gift.py rotates its checkpoints "
                                "away, keeping the last --keep-last); rerun with the run folder to take the newest "
                                "checkpoint") from None


def load_weights(folder, adapter=None, dtype=None, device=None, merge=False):
    """The one way gift.py, sample.py and eval.py load a model: LLaDA.from_pretrained(folder) (find_model's), then the
    adapter, merged into it with `merge` (eval.py: one weight per layer, faster sampling); inside loading()."""
    with loading(folder, adapter):
        model = LLaDA.from_pretrained(folder, dtype=dtype, device=device)
        if adapter:
            load_adapter(model, adapter)  # adds LoRA layers (on the model's device) with the adapter's r / alpha
            if merge:
                merge_lora(model)
    return model


# ---------------------------------------------------------------------------------------------------------------------
# The output folder: one run per folder, never overwritten by accident; preemption; status.json for a requeue script


def lock_file(path, note=True):
    """An exclusive flock on `path` while the returned file stays open (the kernel drops it however the process ends,
    kill -9 included): (the open file, None), or (None, its holder). note: `path` is a lock file, which then names its
    holder ("pid N on HOST"); else a file of ours (eval.py's records), opened to append and never truncated. No locks
    there (network mounts): only a warning."""
    lock = open(path, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = note and lock.read().strip() or flock_holder(lock) or "another process"
        lock.close()
        return None, holder
    except OSError as e:
        print(f"warning: cannot lock {path} ({e}); make sure no other job writes there", file=sys.stderr)
    if note:
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        lock.flush()
    return lock, None


def flock_holder(f):
    """ "pid N on HOST" holding a flock on the open file `f`, from Linux's /proc/locks (N: FLOCK ADVISORY WRITE pid
    MAJ:MIN:INODE ...), else None (another system, or a holder on another host)."""
    st = os.fstat(f.fileno())
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with contextlib.suppress(OSError), open("/proc/locks") as locks:
        for fields in map(str.split, locks):
            if fields[1:2] == ["FLOCK"] and fields[5:6] == [where]:
                return f"pid {fields[4]} on {socket.gethostname()}"
    return None


WANDB_ID = "wandb_run_id"  # <out>/wandb_run_id: the W&B run this output folder logs to (--wandb-project)
RUN_FILES = ("checkpoints", "latest", "metrics.jsonl", "ref_betas.pt", WANDB_ID, "wandb")  # what a run writes
CHECKPOINT_NAME = re.compile(r"step-(\d{7})(\.tmp)?")  # checkpoints/step-N (N in 7 digits), .tmp while written


def checkpoint_name(step):
    """The folder name of step `step`'s checkpoint."""
    return f"step-{step:07d}"


def checkpoint_step(name):
    """N of a finished checkpoint's folder name step-N; None for any other name (a .tmp one included)."""
    m = CHECKPOINT_NAME.fullmatch(name)
    return int(m.group(1)) if m and not m.group(2) else None


# the base folder's files an exported model folder needs besides its config and weights: not a 16 GB pytorch_model.bin
# (gift.py adds the embedded task's, embedded.EXPORTED)
EXPORTED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
            "added_tokens.json", "chat_template.jinja", "generation_config.json", GENERATION_DEFAULTS, "modeling_*.py",
            "configuration_*.py", "generation_utils.py", "tokenization_*.py")
# step-N/manifest.json: every file its save wrote (write_checkpoint), the run's; anything else there is a user's. A
# checkpoint without one (older code's, tests/data/ebf2705; a save killed before its manifest) keeps the name rule,
# each part's files as written, below, but only where its trainer.json names it (names_this_run): else all is a user's
# (older code's embedded runs also exported their held-out puzzles, sudoku_heldout.csv: a name of the past, fixed)
MANIFEST = "manifest.json"
MODEL_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json", *EXPORTED, "sudoku_heldout.csv")
PART_FILES = {"train_state": (".metadata", "*.distcp", "*.metadata.tmp"), "adapter": ("adapter_config.json", "adapter_model.safetensors"),
              "model": MODEL_FILES, "merged": MODEL_FILES}


def lock_folder(out):
    """An exclusive lock on <out>/.lock for the run's life (lock_file: the kernel drops it however it ends). A .lock
    that no run wrote (not empty nor "pid N on HOST": a user's file, a link, a folder) is refused, never truncated."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / ".lock"
    head = path.read_bytes()[:4096] if path.is_file() and not path.is_symlink() else b""
    if path.is_symlink() or path.exists() and not path.is_file() or not re.fullmatch(rb"(pid \d+ on .*\n)?", head):
        raise FileExistsError(f"{path} is not a lock a gift.py run wrote; nothing was changed: move it away, or "
                              "choose another --out")
    try:
        lock, holder = lock_file(path)
    except OSError as e:  # a full disk when its holder line is written: say where
        raise OSError(e.errno, f"cannot lock {path} ({e.strerror or e})") from e
    if lock is None:
        raise RunError(f"{out} is in use by a running job ({holder}): one run per output folder; wait for it to end, "
                       "or choose another --out")
    return lock


def claim_output_folder(out, resume, overwrite, replaced=None):
    """Rank 0, before anything is written: lock the folder, refuse to replace a file no run wrote (`replaced`: {name:
    whether the file is the run's}, None: REPLACED), refuse a fresh run over an existing one (unless `overwrite`:
    deleted), remove interrupted saves. Returns the lock."""
    lock = lock_folder(out)
    try:
        # a file the run would replace (a folder of that name cannot be: StatusFile says so)
        users = [str(out / name) for name, ours in (REPLACED if replaced is None else replaced).items()
                 if (out / name).is_symlink() or ((out / name).is_file() and not ours(out / name))]
        if users:
            raise FileExistsError(f"{out} holds {', '.join(users)}, which the run would replace and no gift.py run "
                                  "wrote; nothing was changed: move those away, or choose another --out")
        links = [str(p) for p in (out / "checkpoints").glob("step-*")
                 if p.is_symlink() and CHECKPOINT_NAME.fullmatch(p.name)]
        if links:  # never followed: a save, rotation or --resume would write, delete or read a user's files through it
            raise FileExistsError(f"{', '.join(links)}: a symbolic link where the run keeps a checkpoint, which "
                                  "gift.py never follows; nothing was changed: move it away, or choose another --out")
        existing = [name for name in RUN_FILES if (out / name).exists() or (out / name).is_symlink()]
        foreign = not_ours(out) if existing else []
        named = (out / "latest").read_text().strip() if (out / "latest").is_file() else ""  # "": a damaged one
        theirs = [f for f in foreign if f.endswith("metrics.jsonl") or (f.endswith("latest") and named)]
        if resume and theirs:  # --resume would rewrite these
            raise FileExistsError(f"--resume: {out} holds what no gift.py run wrote ({', '.join(theirs)}); nothing "
                                  "was changed: move those away, or choose another --out")
        if existing and not resume:
            if not overwrite:
                raise FileExistsError(f"{out} already holds a run ({', '.join(existing)}): continue it with --resume, "
                                      "start over with --overwrite (deletes it), or choose another --out")
            if foreign:
                raise FileExistsError(f"--overwrite: {out} holds what no gift.py run wrote ({', '.join(foreign)}); "
                                      "nothing was deleted: move those away, or choose another --out")
            print(f"--overwrite: deleting the run in {out} ({', '.join(existing)})")
            for name in existing:
                shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
        for tmp in (out / "checkpoints").glob("*.tmp"):  # interrupted saves (tens of GB each at 8B)
            if tmp.is_dir() and not tmp.is_symlink() and CHECKPOINT_NAME.fullmatch(tmp.name):
                if not delete_own_files(tmp):  # a user's files in it, or no trainer.json naming it: kept, said
                    print(f"removed {tmp}, left by an interrupted save")
    except BaseException:
        lock.close()
        raise
    return lock


def not_ours(out):
    """What --overwrite would delete in `out` that a gift.py run did not write: in checkpoints/, anything but step-N
    folders (and .tmp) holding a checkpoint's parts only; a symbolic link; a `latest`, metrics.jsonl or ref_betas.pt
    not ours; a wandb/ folder where no run of ours logged to W&B (no wandb_run_id)."""
    foreign = [str(out / name) for name in RUN_FILES if (out / name).is_symlink()]
    if (out / "checkpoints").is_dir() and not (out / "checkpoints").is_symlink():
        for p in (out / "checkpoints").iterdir():
            if p.is_symlink() or not p.is_dir() or not CHECKPOINT_NAME.fullmatch(p.name):
                foreign.append(str(p))
            else:  # a folder named like ours, holding a user's files at any depth
                foreign += checkpoint_files(p)[1]
    if (out / "latest").is_file() and checkpoint_step((out / "latest").read_text()[:64].removesuffix("\n")) is None:
        foreign.append(str(out / "latest"))
    if (out / "metrics.jsonl").is_file():
        with open_regular(out / "metrics.jsonl") as f:
            first = f.readline()
        if first and not first.startswith(b'{"step": '):
            foreign.append(str(out / "metrics.jsonl"))
    if (out / "wandb").exists() and not (out / WANDB_ID).is_file():
        foreign.append(str(out / "wandb"))
    if (out / "ref_betas.pt").is_file() and not betas_cache(out / "ref_betas.pt"):
        foreign.append(str(out / "ref_betas.pt"))
    return foreign


def betas_cache(path):
    """Whether `path` holds gift.py's GIFT* cache (gift_star_betas: {"key", "betas"}), read as weights, not loaded."""
    with contextlib.suppress(Exception):  # not a torch file, another pickle: not ours
        return set(torch.load(path, weights_only=True, mmap=True)) == {"key", "betas"}
    return False


def json_or_empty(path):
    """The JSON object in the file `path` (model.read_json), or {} (no such file, not JSON, not an object)."""
    with contextlib.suppress(OSError, ValueError):
        return read_json(path)
    return {}


# The files a run writes beside RUN_FILES, each with the test that tells its own from a user's (refused, not replaced;
# the embedded run's more: embedded.REPLACED)
STATES = ("running", "done", "preempted", "interrupted", "failed")  # status.json's
REPLACED = {"status.json": lambda path: json_or_empty(path).get("state") in STATES}


class StatusFile:
    """<out>/status.json, for a requeue script: {"state": one of STATES, "checkpoint": the latest's absolute path,
    "step": its step, ...}. Rank 0 writes it. One that cannot be written is said once, never hiding the run's error."""

    def __init__(self, out):
        self.out, self.warned = Path(out).absolute(), False

    def write(self, state, **extra):
        try:
            named = (self.out / "latest").read_text().strip() if (self.out / "latest").is_file() else ""
            step = checkpoint_step(named)
            status = dict(state=state, checkpoint=None if step is None else str(self.out / "checkpoints" / named),
                          step=step or 0, pid=os.getpid(), time=time.strftime("%Y-%m-%dT%H:%M:%S"))
            atomic_write_text(self.out / "status.json", json.dumps(dict(status, **extra)) + "\n")
        except (OSError, ValueError) as e:
            if not self.warned:
                self.warned = True
                print(f"warning: cannot write {self.out / 'status.json'} ({type(e).__name__}: {e}); a requeue script "
                      "reading it sees an old state", file=sys.stderr, flush=True)


def stopped_state(signum):
    """status.json's state after a signal: Ctrl-C is a person's interruption, the others a cluster's preemption."""
    return "interrupted" if signum == signal.SIGINT else "preempted"


class Preemption:
    """SIGTERM or SIGUSR1 (what Slurm and most clusters send before a kill), or SIGINT (Ctrl-C): the loop finishes
    its step, writes a checkpoint and exits with 128 + the signal. Before the first step (the set-up) and at a second
    signal: exit at once; within REPEAT_S, one notice twice (Slurm signals every process, and torchrun passes it on)."""
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    REPEAT_S = 2.0

    def __init__(self, status=None):
        self.status = status  # rank 0's StatusFile; None on the other ranks
        self.signum, self.since, self.previous, self.looping, self.parent = 0, 0.0, {}, False, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # Python runs handlers in the main thread only
            self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}
            if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker
                self.parent = os.getppid()
                if sys.platform.startswith("linux"):  # the kernel's SIGTERM when the launcher dies (of SIGUSR1)
                    with contextlib.suppress(OSError, AttributeError):
                        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
        return self

    def handle(self, signum, frame):
        if self.signum and time.monotonic() - self.since < self.REPEAT_S:  # the same notice, twice
            return
        if self.signum or not self.looping:  # a second signal, or one during the set-up: no checkpoint to wait for
            self.exit_now(signum)
        self.signum, self.since = signum, time.monotonic()
        os.write(2, f"{signal.Signals(signum).name}: finishing this step, then a checkpoint and exit "
                    "(send it again to exit at once)\n".encode())

    def exit_now(self, signum):
        """Record the stop in status.json (rank 0) and die of `signum`: exit status 128 + signum, no traceback."""
        name = signal.Signals(signum).name
        if self.status:
            self.status.write(stopped_state(signum), exit_code=128 + signum, signal=name)
        os.write(2, f"{name}: exiting now without a checkpoint; --resume continues from the last one\n".encode())
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def pending(self):
        """The signal to stop for after this step, or 0 (SIGTERM once a torchrun worker's launcher is gone)."""
        if not self.signum and self.parent is not None and os.getppid() != self.parent:
            print(f"the launcher (pid {self.parent}) is gone: stopping as if sent SIGTERM", file=sys.stderr)
            self.signum = signal.SIGTERM
        return self.signum

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def run_folder(out, resume, overwrite, replaced=None):
    """The run's output folder, claimed for its life (rank 0: the lock, status.json; `replaced`: claim_output_folder's);
    yields every rank's Preemption."""
    setup_distributed()
    lock = on_rank0(lambda: claim_output_folder(out, resume, overwrite, replaced))
    status = StatusFile(out) if is_rank0() else None
    write_status = status.write if status else lambda state, **extra: None
    try:
        with Preemption(status) as preemption:  # its handlers stay until the final state is written
            try:
                write_status("running")
                yield preemption
                write_status("done")
            except SystemExit as e:  # train's exit after a preemption checkpoint (128 + the signal)
                code = e.code if isinstance(e.code, int) else 1
                write_status(stopped_state(code - 128) if code > 128 else "failed", exit_code=e.code)
                raise
            except BaseException as e:
                write_status("failed", error=f"{type(e).__name__}: {e}")
                raise
    finally:
        if lock is not None:
            lock.close()  # releases the flock


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints: <out>/checkpoints/step-N/ = the model in an ecosystem format (a PEFT adapter, or a complete Hugging
# Face folder) + train_state/ (torch.distributed.checkpoint: model + optimizer, sharded under FSDP2) + trainer.json
# (TrainState, options, fingerprints) + loop_state.pt (every rank's RNG state, the LR schedule, unlogged steps).


# options a resumed run may change (the data and the base model may move: their content is checked by fingerprint)
RESUMABLE_CHANGES = {"out", "resume", "overwrite", "log_every", "save_every", "keep_last", "max_bad_steps",
                     "eval_puzzles", "epochs", "max_steps", "model", "data", "save_dtype", "save_merged",
                     "wandb_project", "cpu_offload"}


@contextlib.contextmanager
def quiet_single_process_dcp():
    """torch.distributed.checkpoint warns that it saves "in a single process" when run without torchrun: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@dataclass
class TrainState:
    """Where the run is: with the model, the optimizer and loop_state.pt, all a resumed run needs to go on exactly."""
    step: int = 0  # optimizer steps done
    epoch: int = 0  # the epoch of the next step
    step_in_epoch: int = 0  # its index in that epoch's order
    bad_in_row: int = 0  # non-finite steps in a row (the updates were skipped)
    skipped_steps: int = 0
    elapsed_s: float = 0.0  # training time, summed over every attempt
    tokens_seen: int = 0  # padded tokens of every step so far
    checkpoints: list = field(default_factory=list)  # this run's checkpoints, oldest first: rotation deletes these only
    total_steps: int = 0  # the run's length (and its learning-rate schedule's) when this state was saved

    def advance(self, result, steps_in_epoch, max_bad_steps, out):
        """Count the step train_step just took (`result`); returns whether it ended its epoch."""
        self.step, self.step_in_epoch = self.step + 1, self.step_in_epoch + 1
        if epoch_done := self.step_in_epoch == steps_in_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        self.tokens_seen += int(result["n_tokens"])
        self.bad_in_row = 0 if result["stepped"] else self.bad_in_row + 1
        self.skipped_steps += not result["stepped"]
        if not result["stepped"]:
            print0(f"step {self.step}: non-finite loss {result['loss']} or grad norm {result['grad_norm']}, "
                   f"update skipped ({self.bad_in_row} in a row)")
            if self.bad_in_row >= max_bad_steps:
                raise RunError(f"{max_bad_steps} non-finite steps in a row, the last at step {self.step}; "
                               f"stopping (last good checkpoint in {out / 'latest'})")
        return epoch_done


def clipped_step(model_params, optimizer, loss, grad_clip):
    """The end of every optimizer step (gift.py's and rl.py's): the gradient norm (before clipping, clipped to
    `grad_clip` unless 0), then the optimizer steps unless the loss or the norm is not finite (TrainState.advance
    counts it, max_bad_steps stops the run). Returns (grad_norm, stepped)."""
    params = list(model_params)
    grad_norm = (torch.nn.utils.clip_grad_norm_(params, grad_clip) if grad_clip > 0 else
                 torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    stepped = math.isfinite(loss) and math.isfinite(grad_norm)
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped


class CheckpointManager:
    """The run's checkpoints (as torchtitan's CheckpointManager). Built, it finds what --resume can continue and
    refuses a checkpoint of other options, data or base model; then `restore` once, `step_done` each step, `final`."""

    def __init__(self, opts, world, inputs, preemption, aliases=None):
        self.opts, self.world, self.inputs, self.preemption = opts, world, inputs, preemption
        self.aliases = aliases or {}  # {option: {old name: name}}: a checkpoint's option saved under an old name
        self.out, self.kept = Path(opts.out), set()  # kept: old checkpoints that could not be deleted
        if opts.model:  # the base folder file by file, so that --resume can say which file changed (and the caller's)
            inputs.fingerprints["files"] = file_fingerprints(opts.model) | inputs.fingerprints.get("files", {})
        check_same_inputs(inputs.fingerprints)
        self.candidates = broadcast_object(on_rank0(lambda: resume_candidates(self.out))) if opts.resume else []
        if self.candidates:
            check_resumable(self.out / "checkpoints" / self.candidates[0], opts, world, inputs, self.aliases)

    def restore(self, model, optimizer, scheduler, beta_cache, total_steps):
        """--resume: load the first candidate checkpoint that loads (a damaged one is skipped, saying why), RNG states
        and beta cache included; trim metrics.jsonl. Returns (TrainState, the train_step results not yet logged)."""
        self.model, self.optimizer, self.scheduler, self.beta_cache = model, optimizer, scheduler, beta_cache
        self.device, opts, out = compute_device(model), self.opts, self.out
        state, unlogged, rank = TrainState(), [], rank_and_world()[0]
        for i, name in enumerate(self.candidates):
            ckpt = out / "checkpoints" / name
            meta = check_resumable(ckpt, opts, self.world, self.inputs, self.aliases)
            try:
                loop_state = load_checkpoint(model, optimizer, scheduler, ckpt, opts.lora)
            except (Exception, CheckpointException) as e:  # damage the checks missed (DCP's is a BaseException)
                print0(f"--resume: cannot load {ckpt} ({type(e).__name__}: {e})")
                if i + 1 == len(self.candidates):
                    raise RunError(f"--resume: no checkpoint in {out / 'checkpoints'} loads; start over with "
                                   "--overwrite") from e
                continue
            state, unlogged = TrainState(**meta["state"]), loop_state["log_window"]
            if beta_cache:
                beta_cache.load_state_dict(loop_state["beta_cache"])
            torch.set_rng_state(loop_state["rng"][rank]["cpu"])
            if loop_state["rng"][rank]["cuda"] is not None:
                torch.cuda.set_rng_state(loop_state["rng"][rank]["cuda"], self.device)
            on_rank0(lambda: atomic_write_text(out / "latest", name + "\n"))  # it may have named a damaged one
            print0(f"resumed from {ckpt}: step {state.step} (epoch {state.epoch}, step {state.step_in_epoch} in it)")
            if state.total_steps not in (0, total_steps):
                self.stretch_schedule(state, total_steps)
            break
        if opts.resume:
            if not state.checkpoints:
                print0(f"--resume: no checkpoint in {out} yet; starting at step 0")
            on_rank0(lambda: truncate_metrics(out / "metrics.jsonl", state.step))
        state.total_steps = total_steps
        self.preemption.looping = True  # from here a signal waits for the step's end and a checkpoint
        return state, unlogged

    def stretch_schedule(self, state, total_steps):
        """A run resumed at another length (--epochs / --max-steps): the next lr, of the schedule stretched to it."""
        lr = self.opts.lr * self.scheduler.lr_lambdas[0](state.step)  # train's schedule, made for total_steps
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        print0(f"--resume: the run now has {total_steps} steps, it had {state.total_steps} (--epochs / --max-steps "
               f"changed): the {self.opts.schedule} learning-rate schedule is stretched to {total_steps} steps, as if "
               f"planned so; step {state.step + 1} runs at lr {lr:.3g}")

    def step_done(self, state, unlogged, epoch_done):
        """After each optimizer step (every rank): a checkpoint when due (each epoch or --save-every steps, the last
        step) or when any rank caught a preemption signal; after a preemption's checkpoint, exit with 128 + it."""
        signum = int(all_reduce([self.preemption.pending()], self.device, op="max")[0])
        due = state.step % self.opts.save_every == 0 if self.opts.save_every else epoch_done
        if due or state.step == state.total_steps or signum:
            self.save_step(state, unlogged)
        if signum:
            print0(f"{stopped_state(signum)} by {signal.Signals(signum).name} at step {state.step}: checkpoint "
                   f"{self.out / 'checkpoints' / state.checkpoints[-1]} written; resume with --resume")
            raise SystemExit(128 + signum)

    def final(self, state):
        """The last checkpoint's folder, once the run is done; a run whose every step was skipped is refused."""
        final = self.out / "checkpoints" / state.checkpoints[-1]
        if state.skipped_steps == state.step:
            raise RunError(f"every step ({state.step}) had a non-finite loss or gradient and changed nothing; lower "
                           f"--lr (or --lora-alpha); the checkpoint {final} is the initial model")
        print0(f"done: {state.step} steps in {hms(state.elapsed_s)}; checkpoint {final}")
        return final

    def save_step(self, state, unlogged):
        """The checkpoint of step state.step (every rank calls it), then rotation to the newest --keep-last."""
        opts, out = self.opts, self.out
        name = checkpoint_name(state.step)
        state.checkpoints = ([n for n in state.checkpoints if n != name] + [name])[-opts.keep_last:]
        rng = gather_objects({"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(self.device)
                              if self.device.type == "cuda" else None})
        trainer = dict(state=dataclasses.asdict(state), options=dataclasses.asdict(opts), world_size=self.world,
                       fingerprints=self.inputs.fingerprints, resolved=self.inputs.resolved)
        loop_state = dict(rng=rng, scheduler=self.scheduler.state_dict(), log_window=unlogged,
                          beta_cache=self.beta_cache.state_dict() if self.beta_cache else None)
        save_checkpoint(self.model, self.optimizer, out / "checkpoints" / name, trainer, loop_state, opts.lora,
                        self.inputs.export)
        if is_rank0():
            if self.preemption.status:
                self.preemption.status.write("running")  # with the checkpoint a kill -9 would resume from
            # every older checkpoint in the folder, not only those this process wrote: a kill -9 between a save and
            # its rotation leaves one that no process remembers
            older = [n for n in saved_checkpoints(out / "checkpoints", state.step) if n not in self.kept]
            for old in older[:-opts.keep_last]:
                if not delete_checkpoint(out / "checkpoints" / old):
                    self.kept.add(old)  # said once; no longer rotated


def listed_files(folder):
    """The files (relative paths) checkpoint `folder`'s MANIFEST lists, itself included; None for a checkpoint of older
    code or a save killed before its manifest (no manifest, and trainer.json names none). Unreadable, or missing where
    trainer.json names it: set(), nothing is the run's (rotation keeps the checkpoint whole, saying so)."""
    if not os.path.lexists(folder / MANIFEST):
        return set() if json_or_empty(folder / "trainer.json").get("manifest") == MANIFEST else None
    with contextlib.suppress(OSError, ValueError):
        names = None if (folder / MANIFEST).is_symlink() else read_json(folder / MANIFEST, object_only=False)
        if isinstance(names, list) and all(isinstance(name, str) for name in names):
            return {MANIFEST, *names}
    return set()


# the temporaries of the run's own writers, in a checkpoint folder a kill left: model.atomic_write_text's
# (<name>.<pid>-<8 hex>.tmp) and model.atomic_folder's (<name>.tmp-<mkdtemp suffix>), e.g. model.tmp-_3y4wk3u/
WRITER_TEMP = re.compile(r".+\.\d+-[0-9a-f]{8}\.tmp|.+\.tmp-[0-9A-Za-z_]+")


def names_this_run(folder):
    """Whether a checkpoint folder without a manifest (older code's, or a save killed before it) is this run's, so that
    its files are matched by name: its trainer.json (a file, not a link) records this very step (state.step, the N of
    step-N or step-N.tmp) among the run's checkpoints (state.checkpoints), in the run's own checkpoints/ folder (not
    one a link leads to). Otherwise nothing in it is the run's: a user's step-N.tmp/model/ is never deleted."""
    name = folder.name.removesuffix(".tmp")
    if folder.parent.is_symlink() or (folder / "trainer.json").is_symlink() or checkpoint_step(name) is None:
        return False
    if folder.name.endswith(".tmp") and not os.path.lexists(folder / "trainer.json"):  # killed before it named itself
        return all(WRITER_TEMP.fullmatch(p.name) and not p.is_symlink() for p in folder.iterdir())
    state = json_or_empty(folder / "trainer.json").get("state")
    return (isinstance(state, dict) and state.get("step") == checkpoint_step(name)
            and isinstance(state.get("checkpoints"), list) and name in state["checkpoints"])


def checkpoint_files(folder):
    """(ours, theirs): the paths under a step-N folder, at any depth, that its save wrote (listed_files, or for a
    checkpoint without a manifest that names_this_run, the names of PART_FILES), and the others (a user's notes, an
    eval.json beside model/, a symbolic link, all of a folder no trainer.json names), which nothing of the run
    deletes."""
    ours, theirs, listed = [], [], listed_files(folder)
    by_name = listed is None and names_this_run(folder)
    for root, dirs, files in os.walk(folder):
        rel = Path(root).relative_to(folder)
        for name in files + [d for d in dirs if Path(root, d).is_symlink()]:
            path = Path(root, name)
            if path.is_symlink():
                own = False
            elif listed is not None:
                own = (rel / name).as_posix() in listed
            elif not by_name:
                own = False
            elif rel == Path("."):
                own = name in ("trainer.json", "loop_state.pt") or WRITER_TEMP.fullmatch(name) is not None
            else:
                own = len(rel.parts) == 1 and any(path.match(p) for p in PART_FILES.get(rel.parts[0], ()))
            (ours if own else theirs).append(str(path))
        if rel == Path("."):
            temps = [d for d in dirs if by_name and WRITER_TEMP.fullmatch(d) and not Path(root, d).is_symlink()]
            ours += [str(Path(root, d)) for d in temps]  # a save's own folder, half written: removed whole
            theirs += [str(Path(root, d)) for d in dirs if d not in PART_FILES and d not in temps
                       and not Path(root, d).is_symlink()]
            dirs[:] = [d for d in dirs if d in PART_FILES]  # a folder of the user's is kept whole, unread
        else:
            theirs += [str(Path(root, d)) for d in dirs if not Path(root, d).is_symlink()]
            dirs[:] = []
    return ours, theirs


def delete_own_files(folder):
    """Delete a checkpoint's own files (checkpoint_files) in `folder` and the folders left empty; say what is kept."""
    ours, theirs = checkpoint_files(folder)
    if not theirs:
        remove_whole(folder)
        return []
    # trainer.json last: a kill midway leaves a folder that still names itself the run's (names_this_run)
    for path in sorted(set(ours) - {str(folder / MANIFEST)}, key=lambda p: p == str(folder / "trainer.json")):
        with contextlib.suppress(OSError):
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
    if str(folder / MANIFEST) in ours:  # kept, listing nothing (last): what is left is the user's, whatever its names
        with contextlib.suppress(OSError):
            (folder / MANIFEST).write_text("[]\n")
    for part in [folder / name for name in PART_FILES] + [folder]:
        with contextlib.suppress(OSError):
            part.rmdir()  # only when empty
    print(f"kept {', '.join(theirs)} in {folder}: not written by gift.py (the checkpoint's own files are deleted)",
          flush=True)
    return theirs


def remove_whole(folder):
    """A folder of the run's own files removed, its parts first: a kill midway leaves the small files that name it
    (trainer.json, the manifest), and the next start still knows it as the run's (names_this_run, listed_files)."""
    for name in PART_FILES:
        shutil.rmtree(folder / name, ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)


def move_into(tmp, folder):
    """A new checkpoint's files (tmp) moved into `folder`, which holds a user's files only: its manifest first (what
    it lists is the run's), trainer.json last (a kill midway leaves an incomplete checkpoint). A part that is a user's
    file or symbolic link, or a file of the user's where the save puts one, is refused, nothing moved."""
    targets = [folder / part.name for part in tmp.iterdir() if part.is_dir()]
    blocked = [str(t) for t in targets if t.is_symlink() or t.exists() and not t.is_dir()]
    if blocked:
        raise OSError(errno.EEXIST, f"{', '.join(blocked)} is not a folder gift.py wrote (a file or a link of the "
                                    "user's where the checkpoint writes a folder); move it away")
    order = {MANIFEST: 0, "trainer.json": 2}
    files = sorted((f for f in tmp.rglob("*") if not f.is_dir()), key=lambda f: order.get(f.name, 1))
    taken = [str(folder / f.relative_to(tmp)) for f in files if f != tmp / MANIFEST  # ours, listing nothing
             and os.path.lexists(folder / f.relative_to(tmp))]
    if taken:  # what is left in `folder` is the user's (delete_own_files): never replaced
        raise OSError(errno.EEXIST, f"{', '.join(taken)}: a user's file where the checkpoint writes one (no gift.py "
                                    "run's trainer.json names the folder); move it away")
    for f in files:
        (folder / f.relative_to(tmp)).parent.mkdir(parents=True, exist_ok=True)
        os.replace(f, folder / f.relative_to(tmp))
    shutil.rmtree(tmp, ignore_errors=True)


def delete_checkpoint(folder):
    """Rotation's delete of an old checkpoint of this run: renamed to .tmp first (start-up removes a .tmp a kill left),
    then removed; a user's files in it stay where they are. Returns False when it kept it whole (a read-only folder)."""
    if not folder.exists():
        return True
    parts = [folder.parent, folder] + [d for d in folder.rglob("*") if d.is_dir() and not d.is_symlink()]
    locked = [d for d in parts if not os.access(d, os.W_OK)]
    if locked or listed_files(folder) == set():  # read-only, or which files are the run's is unknown
        why = f"{locked[0]} is read-only" if locked else f"its {MANIFEST} is unreadable or missing"
        print(f"warning: cannot delete the old checkpoint {folder} ({why}): kept; delete it yourself when you no "
              "longer need it", file=sys.stderr, flush=True)
        return False
    if checkpoint_files(folder)[1]:  # a user's files in it: deleted in place, nothing renamed
        delete_own_files(folder)
        return True
    doomed = folder.with_name(folder.name + ".tmp")
    os.replace(folder, doomed)
    remove_whole(doomed)
    return True


def saved_checkpoints(folder, up_to):
    """The step-N checkpoints in `folder` up to step `up_to`, oldest first, those a kill left behind included."""
    found = [p for p in folder.iterdir() if p.is_dir() and not p.is_symlink()] if folder.is_dir() else []
    # a checkpoint: files of its save left besides its manifest, or a manifest unreadable (kept whole, said once)
    return sorted(p.name for p in found if (step := checkpoint_step(p.name)) is not None and step <= up_to
                  and (set(checkpoint_files(p)[0]) - {str(p / MANIFEST)} or listed_files(p) == set()))


@dataclass
class Export:
    """What every checkpoint exports for use outside training, besides its training state."""
    dtype: torch.dtype  # of the Hugging Face folders' weights: by default the base's own (bf16 in, bf16 out)
    files: list  # the base folder's other files (tokenizer, official modeling code, ...), copied into each folder
    base_name: str = ""  # adapter_config.json's base_model_name_or_path
    merged: bool = False  # LoRA: also merged/, the base with the adapters folded in
    base_fingerprint: str = ""  # the base folder's (folder_fingerprint, made once at start), recorded in each adapter
    merge_from: str = ""  # a folder: merged/ folds the adapters into its stored weights (LoRA below their precision)


def export_pretrained(config, state_dict, path, dtype, files=()):
    """A Hugging Face folder from a full state dict: the module built on the meta device, filled with assign=True,
    the weights cast to `dtype` one by one (each float32 tensor freed as its copy is made), and `files` beside them."""
    with torch.device("meta"):
        export = LLaDA(config)
    export.load_state_dict({k: state_dict.pop(k).to(dtype) for k in list(state_dict)}, assign=True)
    export.save_pretrained(path)
    for f in files:
        shutil.copy2(f, path / f.name)


def save_checkpoint(model, optimizer, folder, trainer, loop_state, lora, export):
    """Every rank calls it: the checkpoint (its parts: the comment above TrainState) written to <folder>.tmp,
    renamed to `folder` when complete, then named in <out>/latest. A failed write says where and frees the space."""
    tmp = folder.with_name(folder.name + ".tmp")
    try:
        write_checkpoint(model, optimizer, folder, tmp, trainer, loop_state, lora, export)
    except (OSError, CheckpointException) as e:  # disk full, file too large, no permission: say where, free the space
        if is_rank0() and tmp.is_dir() and not tmp.is_symlink():
            delete_own_files(tmp)  # the save's (its trainer.json names it); a user's folder of that name stays
        why = getattr(e, "strerror", None) or str(e).strip().splitlines()[-1][:300]
        raise OSError(getattr(e, "errno", None), f"cannot write the checkpoint {tmp} ({why}); its partial files are "
                                                 "removed; resume with --resume once it can be written") from e


def write_checkpoint(model, optimizer, folder, tmp, trainer, loop_state, lora, export):
    if is_rank0():
        if os.path.lexists(tmp) and (tmp.is_symlink() or delete_own_files(tmp)):  # a leftover of ours goes
            raise OSError(errno.EEXIST, f"{tmp} holds files no gift.py run wrote, where the checkpoint is written; "
                                        "move it away")
        tmp.mkdir(parents=True)
        # names the folder as this run's from the start (names_this_run): a kill mid-save leaves a .tmp that start-up
        # removes by name; rewritten last with its manifest's name
        atomic_write_text(tmp / "trainer.json", json.dumps(trainer, indent=2))
    barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=lora))
    with quiet_single_process_dcp():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "train_state"))
    full = None  # LoRA under DDP: rank 0 reads its own whole copy
    if not lora or is_sharded(model):  # gather the full weights (collective under FSDP2) onto rank 0's host, one
        # tensor at a time: for a sharded LoRA base only the adapters, unless the merged model is exported
        full = get_model_state_dict(model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora and not export.merged))
    if is_rank0():
        module = unwrap(model)  # DDP's .module
        if lora:
            save_adapter(module, tmp / "adapter", base_model_name_or_path=export.base_name, state=full,
                         base_fingerprint=export.base_fingerprint, base_files=trainer["fingerprints"].get("files"))
            if export.merged:
                export_pretrained(module.config, merged_state_dict(module, full, export.merge_from), tmp / "merged",
                                  export.dtype, export.files)
        else:
            export_pretrained(module.config, full, tmp / "model", export.dtype, export.files)
        torch.save(loop_state, tmp / "loop_state.pt")
        listed = sorted(f.relative_to(tmp).as_posix() for f in tmp.rglob("*") if f.is_file() and f != tmp /
                        "trainer.json") + ["trainer.json"]
        atomic_write_text(tmp / MANIFEST, json.dumps(listed, indent=0) + "\n")  # whole or absent, if a kill comes
        (tmp / "trainer.json").write_text(json.dumps(dict(trainer, manifest=MANIFEST), indent=2))
        if folder.is_symlink():  # never followed: a save through it would delete and write a user's files
            raise OSError(errno.EEXIST, f"{folder} is a symbolic link, which gift.py never follows; move it away")
        if folder.exists():  # saved again at its step (resume fell back past a damaged one): ours go, a user's stay
            delete_own_files(folder)
        if folder.exists():
            move_into(tmp, folder)
        else:
            os.replace(tmp, folder)  # the checkpoint becomes visible only when complete
        atomic_write_text(folder.parent.parent / "latest", folder.name + "\n")
    barrier()


# Reading a checkpoint runs no code from it. torch.distributed.checkpoint's FileSystemReader unpickles .metadata with
# pickle.load, its load planner the non-tensor values (the optimizer's settings) with torch.load(weights_only=False):
# a planted pickle would run at --resume. These build only what a checkpoint's metadata is made of.
METADATA_CLASSES = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
    "TensorProperties", "_MEM_FORMAT_ENCODING")} | {("torch", "Size"), ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


class MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that builds only METADATA_CLASSES and torch's dtypes."""

    def find_class(self, module, name):
        if (module, name) in METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is no part of a checkpoint's metadata (refused: "
                                     "unpickling it could run code)")


class CheckpointReader(dcp.FileSystemReader):
    """FileSystemReader whose read_metadata builds train_state/.metadata with MetadataUnpickler."""

    def read_metadata(self, *args, **kwargs):
        with open(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class CheckpointLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor values are read by torch.load(weights_only=True), then pickled again."""

    def load_bytes(self, read_item, value):
        safe = io.BytesIO()
        torch.save(torch.load(value, weights_only=True), safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


def checkpoint_problem(ckpt):
    """Why checkpoint folder `ckpt` cannot be resumed from, or None: a missing, unreadable or truncated part."""
    if ckpt.is_symlink():
        return "a symbolic link (gift.py never follows one)"
    if not ckpt.is_dir():
        return "the folder does not exist"
    for part in ("trainer.json", "loop_state.pt", "train_state/.metadata"):
        if not (ckpt / part).is_file():
            return f"{part} is missing"
    try:
        meta = read_json(ckpt / "trainer.json")
        step = TrainState(**meta["state"]).step
        meta["options"], meta["fingerprints"], meta["world_size"]
    except (ValueError, KeyError, TypeError) as e:
        return f"trainer.json is unreadable ({type(e).__name__}: {e})"
    try:  # the step three times: the folder's name, trainer.json and the saved schedule (one step per step)
        scheduled = torch.load(ckpt / "loop_state.pt", weights_only=True)["scheduler"]["last_epoch"]
    except Exception as e:  # any unpickling error
        return f"loop_state.pt is unreadable ({type(e).__name__})"
    if checkpoint_step(ckpt.name.removesuffix(".tmp")) not in (None, step) or scheduled != step:
        return (f"trainer.json says step {step}, the folder's name {ckpt.name} and loop_state.pt's schedule step "
                f"{scheduled} (edited or mixed up)")
    try:
        storage = CheckpointReader(str(ckpt / "train_state")).read_metadata().storage_data
    except Exception as e:  # any unpickling error, a refused class included
        detail = f": {e}" if isinstance(e, pickle.UnpicklingError) else ""
        return f"train_state/.metadata is unreadable ({type(e).__name__}{detail})"
    for info in storage.values():
        shard = ckpt / "train_state" / info.relative_path
        if not shard.is_file() or shard.stat().st_size < info.offset + info.length:
            return f"train_state/{info.relative_path} is missing or truncated"
    return None


def resume_candidates(out):
    """Rank 0, for --resume: the checkpoints (names) to try, <out>/latest's, then newest first; says what it skips."""
    latest = out / "latest"
    named = latest.read_text().strip() if latest.is_file() else ""
    folders = sorted(p for p in (out / "checkpoints").glob("step-*") if checkpoint_step(p.name) is not None)[::-1]
    order = ([out / "checkpoints" / named] if named else []) + [p for p in folders if p.name != named]
    good, notes = [], [] if named else [f"{latest} is {'empty' if latest.exists() else 'missing'}"]
    for ckpt in order:
        if problem := checkpoint_problem(ckpt):
            notes.append(f"skipping {ckpt}: {problem}")
        else:
            good.append(ckpt.name)
    if not good and folders:
        raise RunError(f"--resume: no usable checkpoint in {out / 'checkpoints'}: " + "; ".join(notes)
                       + ". Restore one, or start over with --overwrite")
    if good and notes:
        print("--resume: " + "; ".join(notes) + f"; using {good[0]}")
    return good


def check_resumable(ckpt, opts, world, inputs, aliases=None):
    """Refuse to continue checkpoint `ckpt` with other options, another number of processes, other data or another
    base model, saying what changed. An "auto" option and the value it resolved to are the same option."""
    fingerprints, meta = inputs.fingerprints, read_json(ckpt / "trainer.json")
    if (then := meta["world_size"]) != world:  # first: with the embedded task --batch-size derives from it
        command = "python gift.py" if then == 1 else f"torchrun --nproc_per_node {then} gift.py"
        raise ValueError(f"--resume: {ckpt} was written by {then} process{'es' if then > 1 else ''}, this is {world}: "
                         f"resume with the same number (`{command} ... --resume`); each rank's random state is saved")
    saved, then_resolved, now_resolved = meta["options"], meta.get("resolved") or {}, inputs.resolved or {}

    def resolve(name, value, resolved):  # "auto" stands for what it resolved to (dtype auto = float32 on the CPU)
        return resolved.get(name, value) if value == "auto" else value
    aliases = aliases or {}  # a run saved as --loss dream is cart
    saved = {k: aliases[k].get(v, v) if k in aliases else v for k, v in saved.items()}
    differ = {k: (saved.get(k), v) for k, v in dataclasses.asdict(opts).items() if k not in RESUMABLE_CHANGES
              and resolve(k, saved.get(k), then_resolved) != resolve(k, v, now_resolved)}
    if differ:
        raise ValueError(f"--resume: {ckpt} was written with different options (saved, now): {differ}")
    then, base = meta["fingerprints"], opts.model or "the embedded task"
    if "files" in then and "files" in fingerprints:  # file by file (the embedded task: the whole model's fingerprint)
        if changed := base_changes(then["files"], fingerprints["files"]):
            raise ValueError(f"--resume: the base model changed since {ckpt}: its {', '.join(changed)} in {base}; "
                             "resume with the original base, or start over with --overwrite")
    elif then["model"] != fingerprints["model"]:
        raise ValueError(f"--resume: the base model changed since {ckpt}: fingerprint {then['model']} then, "
                         f"{fingerprints['model']} now ({base}); resume with the original base, or start over with "
                         "--overwrite")
    if then["data"] != fingerprints["data"]:
        raise ValueError(f"--resume: the training data changed since {ckpt}: {then['examples']} examples (fingerprint "
                         f"{then['data']}) then, {fingerprints['examples']} ({fingerprints['data']}) now from "
                         f"{opts.data or 'the embedded task'}; resume with the original data, or start over with "
                         "--overwrite")
    return meta


def load_checkpoint(model, optimizer, scheduler, ckpt, lora):
    """Load `ckpt`'s model and optimizer state (every rank its shards) and LR schedule; returns loop_state.pt."""
    sd_opts = StateDictOptions(ignore_frozen_params=lora, strict=not lora)  # LoRA: adapters only
    model_sd, optim_sd = get_state_dict(model, optimizer, options=sd_opts)
    state = {"model": model_sd, "optim": optim_sd}
    with quiet_single_process_dcp():
        dcp.load(state, storage_reader=CheckpointReader(str(ckpt / "train_state")), planner=CheckpointLoadPlanner())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=sd_opts)
    loop_state = torch.load(ckpt / "loop_state.pt", weights_only=True)
    scheduler.load_state_dict(loop_state["scheduler"])
    return loop_state


def truncate_metrics(path, step):
    """Rank 0, on resume: keep metrics.jsonl's records of steps <= `step` (later ones are recomputed; torn ones go)."""
    if not path.exists():
        return
    kept = []
    with open_regular(path) as f:
        text = f.read().decode()
    for line in text.splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
    atomic_write_text(path, "".join(kept))


# ---------------------------------------------------------------------------------------------------------------------
# The metrics log, the start-up banner (the embedded run's results: embedded.write_results)


class MetricsLog:
    """The run's log: a line and a metrics.jsonl record (rank 0) every --log-every steps and at the last, over the
    train_step results since the previous record (`unlogged`: checkpoints save it, so a resumed run writes the same)."""

    def __init__(self, out, log_every, state, total_steps, unlogged, wandb_project="", config=None):
        self.file = open(out / "metrics.jsonl", "a") if is_rank0() else None
        self.log_every, self.total_steps, self.unlogged = log_every, total_steps, unlogged
        self.first_step, self.t_attempt, self.t_last = state.step, time.time(), time.time()
        self.tracker = WandbRun(wandb_project, out, config) if wandb_project and is_rank0() else None

    def add(self, result, state, epoch, lr):
        now = time.time()
        state.elapsed_s += now - self.t_last
        self.t_last = now
        self.unlogged.append(result)
        if state.step % self.log_every == 0 or state.step == self.total_steps:
            eta_s = seconds_left(self.t_attempt, state.step - self.first_step, self.total_steps - state.step)
            record = log_record(self.unlogged, state, epoch, self.total_steps, lr, eta_s)
            log(self.file, record)
            if self.tracker:
                self.tracker.log(record)
            self.unlogged = []


class WandbRun:
    """--wandb-project: every metrics.jsonl record also goes to a W&B run (rank 0), its id in <out>/wandb_run_id for
    --resume. W&B, not TensorBoard: a run id that resumes, offline runs synced later (`wandb sync`), no log folder."""

    def __init__(self, project, out, config):
        import wandb  # here, not at the top: a run without --wandb-project imports nothing new
        id_file = out / WANDB_ID
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        atomic_write_text(id_file, run_id + "\n")
        self.run = wandb.init(project=project, id=run_id, resume="allow", dir=str(out), config=config)

    def log(self, record):
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        self.run.log(numbers, step=record["step"])


def log_record(window, state, epoch, total_steps, lr, eta_s):
    """One metrics.jsonl record for the train_step results in `window`: loss and gradient norm averaged over the
    steps; the masked fraction and the beta statistics pooled over every answer token. Non-finite values: None."""
    total = {k: sum(w[k] for w in window) for k in ("n_masked", "n_answer", "beta_n", "beta_sum", "beta_sq_sum")}
    record = dict(step=state.step, total_steps=total_steps, epoch=epoch,
                  loss=sum(w["loss"] for w in window) / len(window), lr=lr,
                  grad_norm=sum(w["grad_norm"] for w in window) / len(window),
                  masked_fraction=total["n_masked"] / max(total["n_answer"], 1.0),
                  tokens_per_s=state.tokens_seen / max(state.elapsed_s, 1e-9), elapsed_s=state.elapsed_s,
                  eta_s=eta_s, skipped_steps=state.skipped_steps)
    if total["beta_n"] > 0:
        mean = total["beta_sum"] / total["beta_n"]
        record.update(beta_mean=mean, beta_std=math.sqrt(max(total["beta_sq_sum"] / total["beta_n"] - mean ** 2, 0)))
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


def log(metrics, record):
    """Print the record as one line (rank 0) and append it to metrics.jsonl (`metrics`: the open file, or None)."""
    r, num = record, lambda v, f: "nan" if v is None else format(v, f)
    beta = f" | beta {num(r['beta_mean'], '.3g')} +- {num(r['beta_std'], '.2g')}" if "beta_mean" in r else ""
    skipped = f" | {r['skipped_steps']} skipped" if r["skipped_steps"] else ""
    print0(f"step {r['step']}/{r['total_steps']} (epoch {r['epoch']}) | loss {num(r['loss'], '.4f')} | lr "
           f"{r['lr']:.2e} | grad norm {num(r['grad_norm'], '.3g')} | masked {num(r['masked_fraction'], '.0%')}{beta}"
           f"{skipped} | {r['tokens_per_s']:,.0f} tokens/s | {hms(r['elapsed_s'])} elapsed, ETA {hms(r['eta_s'])}")
    if metrics:
        try:
            metrics.write(json.dumps(record, allow_nan=False) + "\n")
            metrics.flush()
        except OSError as e:  # e.g. a full disk: say which file
            raise OSError(e.errno, f"{metrics.name}: {e.strerror or e}") from None


def seconds_left(start, done, left):
    """The ETA of every progress line (the training log's, eval.py's, the harness's): `left` more units at the pace
    of the `done` since time.time() was `start`."""
    return (time.time() - start) / max(done, 1) * left


def hms(seconds):
    """h:mm:ss"""
    seconds = int(round(seconds or 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def describe_data(stats):
    """data.load_dataset's statistics in words."""
    line = (f"data: {stats['examples']:,} examples ({stats['tokens']:,} tokens) from {stats['path']}, format "
            f"{stats['format']}")
    dropped = [f"{stats['dropped_too_long']} longer than --max-len"] if stats["dropped_too_long"] else []
    dropped += [f"{stats['skipped_bad_rows']} bad rows skipped"] if stats["skipped_bad_rows"] else []
    return line + (f"; of {stats['rows']:,} rows, {', '.join(dropped)}" if dropped else "")


def banner(opts, inputs, model, world, device, dtype, total_steps, global_batch):
    """The start-up summary: what is trained, on what, where, and how long the run is."""
    n_params = sum(p.numel() for p in unwrap(model).parameters())  # FSDP2: DTensors report the full size
    c = unwrap(model).config
    what = (f"LoRA r {opts.lora_r} on {opts.lora_targets}" if opts.lora else "full fine-tuning") + f", loss {opts.loss}"
    base = opts.model or "a tiny LLaDA from scratch (the embedded task)"
    family = "Dream, " if c.predicts_shifted else ""  # LLaDA: the banner's default
    return (f"gift.py: {what}; {base}: {n_params / 1e6:.2f}M parameters ({family}d_model {c.d_model}, "
            f"{c.n_layers} layers, {c.n_heads} heads); {world} process{'es' if world > 1 else ''} on {device.type}, "
            f"{str(dtype).replace('torch.', '')}; {total_steps} optimizer steps of {global_batch} examples; "
            f"output {opts.out}")


# ---------------------------------------------------------------------------------------------------------------------
# eval.py's output: a summary file and its records (one JSON line per graded item), resumable


FINGERPRINTS = ("model_fingerprint", "adapter_fingerprint")  # of the weights the records were generated with


def open_output(p, args):
    """--out checked before the model loads: the summary and the records file beside it (.jsonl) must each be absent
    or eval.py's (check_summary, check_records); rank 0 locks the records file for the run's life (lock_records: one
    eval per output file, as gift.py's one run per folder, the second refused naming the holder; a new records file is
    also locked with its first batch: append_records). Returns (summary, records, lock); Nones without --out."""
    if not args.out:
        return None, None, None
    out = Path(args.out)
    if out.is_dir() or out.suffix.lower() == ".jsonl":  # up.JSONL: the records file up.jsonl itself, where case folds
        p.error(f"--out {args.out}: name the summary .json file (the records go beside it, in a .jsonl)")
    records_path = out.with_suffix(".jsonl")
    inputs = {os.path.realpath(f): flag for flag, f in (("--data", args.data), ("--shot-data", args.shot_data)) if f}
    for path in (out, records_path):
        if os.path.realpath(path) in inputs:
            p.error(f"--out {args.out}: it would write {path}, which is the {inputs[os.path.realpath(path)]} file; "
                    "name another summary file")
    lock = None
    try:
        check_summary(out)
        check_records(records_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(out.parent, os.W_OK):
            raise PermissionError(errno.EACCES, "permission denied")
        if int(os.environ.get("RANK", "0")) == 0:  # before the process group starts
            lock = lock_records(records_path)
            if isinstance(lock, str):
                p.error(f"--out {args.out}: another eval.py is writing {records_path} ({lock}); one evaluation per "
                        "--out at a time: wait for it, or use another --out")
    except ValueError as e:
        p.error(str(e))
    except OSError as e:
        p.error(f"--out {args.out}: cannot write {records_path} ({e.strerror})")
    return out, records_path, lock


LOCKS = WEIGHT_HASH_CACHE.parent / "locks"  # eval.py's: one lock file per records file (never beside a user's files)


def lock_records(path):
    """Rank 0: the records file `path` locked for the run's life: LOCKS/<its real path's hash>.lock (lock_file, naming
    its holder; the records file may not exist yet), and the records file itself where it exists (another host's run,
    and an older eval.py's, lock that one). An ExitStack to close at the end, or the holder while another eval.py
    writes there: one process per --out at a time."""
    key = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:16]
    stack = contextlib.ExitStack()
    for lock_path, note in ((LOCKS / f"{key}.lock", True), (path, False)):
        if not (note or path.exists()):
            continue
        try:
            lock_path.parent.mkdir(parents=True, exist_ok=True)
            lock, holder = lock_file(lock_path, note=note)
        except OSError as e:
            if not note:
                raise
            print(f"warning: cannot lock {lock_path} ({e}); make sure no other eval.py writes {path}", file=sys.stderr)
            continue
        if lock is None:
            stack.close()
            return holder
        stack.callback(lock.close)
    return stack


def parse_record(line):
    """The record on a line (bytes) of a records file, or None: not JSON, not an object with seed, index, settings."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    ok = isinstance(record, dict) and isinstance(record.get("settings"), dict) and {"seed", "index"} <= record.keys()
    return record if ok else None


def not_records(path, n):
    """The error for line n of a file at a records file's place that is not eval.py's."""
    return ValueError(f"{path}, line {n}: not an eval.py records file (a record has seed, index and settings); --out "
                      "names the summary .json, and its .jsonl beside it must be eval.py's: use another --out")


RECORD_HEAD = b'{"index": 0, "seed": 0, "'  # how a record's line begins (eval.graded_records' first fields), numbers 0


def torn_record(line):
    """Whether a last line without its line break begins as a record does (a kill mid-write), not as a user's line."""
    line = re.sub(rb"\d+", b"0", line)
    return RECORD_HEAD.startswith(line) or line.startswith(RECORD_HEAD)


def check_records(path):
    """A ValueError unless `path` is absent or eval.py's records: its first line a whole record (append_records creates
    the file with its first batch, whole), so that a user's file is never taken for a torn one, or written."""
    if path.exists():
        first = b""
        if path.is_file():  # a FIFO would never end
            with open_regular(path) as f:
                first = f.readline(1 << 26)
        if parse_record(first) is None:
            raise not_records(path, 1)


def read_records(path, settings):
    """Rank 0: the records an earlier run of this command left in `path` (JSON lines), {(seed, index): record}, refused
    unless made with `settings` and, where both have them, the same FINGERPRINTS; a torn last line (a kill mid-write:
    no line break, the start of a record: torn_record) is cut off, any other makes the file not eval.py's."""
    if path is None:
        print("no --out: the generations are not saved, and an interrupted run cannot continue", flush=True)
        return {}
    if not path.exists():
        return {}
    records = {}
    with open_regular(path) as f:  # a FIFO: refused, never read
        lines = f.readlines()
    for n, line in enumerate(lines, 1):
        if 1 < n == len(lines) and not line.endswith(b"\n"):  # torn by a kill: cut off, the batch is generated again
            if not torn_record(line):  # a user's note, say: not ours to cut
                raise not_records(path, n)
            os.truncate(path, sum(map(len, lines[:-1])))
            break
        record = parse_record(line)
        if record is None:
            raise not_records(path, n)
        old = record["settings"]
        for k in FINGERPRINTS:
            if k in old and k in settings and old[k] != settings[k]:
                what = "model" if k == "model_fingerprint" else "adapter"
                raise SystemExit(f"eval.py: {path} holds generations of another {what}: fingerprint {old[k]} in the "
                                 f"file, {settings.get(k)} now ({settings[what]}: replaced or retrained since); use "
                                 "another --out, or delete the file to start over")
        # both ways: a setting recorded only when set (eval.run_settings' extras) and unset now differs too
        changed = {k: (old.get(k), settings.get(k)) for k in {**settings, **old}
                   if old.get(k) != settings.get(k) and k not in FINGERPRINTS}
        if changed:
            what = ", ".join(f"{k} {old!r} in the file, {new!r} now" for k, (old, new) in changed.items())
            raise SystemExit(f"eval.py: {path} holds generations made with other settings ({what}); use another "
                             "--out, or delete the file to start over")
        records[record["seed"], record["index"]] = record
    if records:
        print(f"{path}: {len(records)} graded items found; generating the rest", flush=True)
    return records


SUMMARY_FIELDS = ("task", "accuracy_mean", "n_items", "runs")  # what report() writes besides the settings


def check_summary(out, settings=None):
    """A ValueError unless an existing --out is an eval.py summary (report()) of these settings (once known)."""
    if not out.exists():
        return
    if not set(SUMMARY_FIELDS) <= (summary := json_or_empty(out)).keys():
        raise ValueError(f"--out {out}: the file exists and is not an eval.py summary; it would be replaced: name "
                         "another --out, or move the file away")
    changed = [k for k, v in (settings or {}).items()
               if (k in summary and summary[k] != v) or (k not in summary and k not in FINGERPRINTS)]
    if changed:
        raise ValueError(f"--out {out}: the file is the summary of another evaluation ({', '.join(changed)} differ); "
                         "name another --out, or move the file away")


def append_records(path, records, settings):
    """One JSON line per graded item (with the settings), on disk before the next batch starts. A new file comes whole
    with its first batch (written under a name of its own, locked, then linked to `path`: never over another's file)
    and is returned, open and locked, for the caller to keep while it writes; None otherwise."""
    text = "".join(json.dumps(dict(r, settings=settings)) + "\n" for r in records)
    try:
        if path.exists():  # this run's (open_output checked it, and locked it)
            with open(path, "a") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            return None
        tmp = path.with_name(f"{path.name}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # created here: no one else's file
        try:
            lock, _ = lock_file(tmp, note=False)
            lock.write(text)
            lock.flush()
            os.fsync(lock.fileno())
            os.link(tmp, path)  # FileExistsError: another eval.py made it meanwhile
        finally:
            os.unlink(tmp)
        return lock
    except FileExistsError as e:
        raise OSError(e.errno, f"eval.py: another eval.py started writing {path} meanwhile; use another --out") from e
    except OSError as e:
        raise OSError(e.errno, f"eval.py: cannot write {path} ({e.strerror}); the items before this batch are "
                               "saved, rerun the same command to continue") from e
