"""A real-width dry run of the LLaDA-8B path (and Dream-v0-7B's) on the CPU: the repo's own entry points, at the real
widths, timed.

    python bench/scale.py                   # d_model 4096, vocab 126464, 2 layers, 1024 tokens, bf16 (4-6 min, 2 cores)
    python bench/scale.py --smoke           # tiny widths, the same four steps (~20 s; tests/test_scale.py runs it)
    python bench/scale.py --family dream    # Dream-v0-7B's widths (d_model 3584, 28 / 4 heads, mlp 18944, vocab
                                            # 152064), 2 layers (full fine-tuning: 1 layer, vocab 8192)

What it does:
1. Writes synthetic model folders, as a downloaded LLaDA-8B-Instruct folder looks: config.json with LLaDA-8B's
   widths (d_model 4096, 32 heads, 32 kv heads, mlp 12288, rope_theta 500000) and fewer layers; random bf16
   weights saved as SEVERAL safetensors shards with model.safetensors.index.json (the model is built on the meta
   device and given bf16 storage directly, so no float32 copy of the 8B-width embedding and head is ever made);
   and a tokenizer.json whose special tokens carry LLaDA's real ids (<|startoftext|> 126080, <|endoftext|> 126081,
   <|mdm_mask|> 126336, <|start_header_id|> 126346, <|end_header_id|> 126347, <|eot_id|> 126348), checked after
   loading with data.special_ids. Ordinary text is one token per printable ASCII character (ids 0-95); the other
   ids below the vocabulary size are unreachable filler tokens, so every id the model emits decodes.
   Also a prompt/response JSONL (sums worked out line by line, as long as --max-len allows) and a GSM8K test file.
2. Runs the real entry points on them as subprocesses, in bf16 at --max-len tokens (every example padded to it):
   a. gift.py, LoRA GIFT (r 128, alpha 256, on q/k/v), 2 steps, one process, the real vocabulary;
   b. gift.py, full fine-tuning with FSDP2 over 2 processes (torch.distributed.run), 2 steps, on a second folder
      with a REDUCED vocabulary (default 32768): full fine-tuning keeps float32 master weights and gradients and two
      float32 AdamW states, 16 bytes per parameter, plus a float32 gather of the whole model on rank 0 for the
      Hugging Face export; the real 126464 x 4096 embedding and head alone are 1.04B parameters (16.6 GB of
      training state), which does not fit 24 GB beside the blocks. At vocabulary 32768 two layers peak at 17.5 GiB
      (summed over the processes) and three (--full-layers 3) at 21.4 GiB, the most that fits; the default keeps
      two, leaving room for other work on the machine. Its special ids are LLaDA's shifted down by 126464 - vocab
      (they keep their distance from the top of the vocabulary);
   c. eval.py on GSM8K, --limit 2, a short generation, with step a's LoRA adapter (merged) on the base
      (the base alone when step a left no adapter). eval.py has no dtype flag: on the CPU it runs in float32;
   d. sample.py --dtype bfloat16 on the base, a short generation.
3. Prints a table: wall time, peak host memory and exit status of each step.

--family dream does the same for Dream-v0-7B (Qwen2.5-7B's shapes): config.json in Dream's names (model_type "Dream",
hidden_size 3584, num_attention_heads 28, num_key_value_heads 4, intermediate_size 18944, rope_theta 1e6, q/k/v
biases, an untied head), checkpoint keys in Qwen's names (model.layers.0.self_attn.q_proj.weight, ...), and a
tokenizer with Dream's special tokens at their real ids (<|endoftext|> 151643 = eos = pad, <|im_start|> 151644,
<|im_end|> 151645, <|mask|> 151666; the ChatML format). Layers: 2 of Dream-7B's 28 for the LoRA, eval and sample
model (the real vocabulary: 1,556M parameters, 5.8 GiB in float32 for eval.py); for full fine-tuning ONE layer at
vocabulary 8192 (291.8M parameters), so that the FSDP2 step stays near 10 GB of host memory in all (Dream's
embedding and head are 1.09B parameters, 16 GB of float32 training state on their own). Dream's special ids are
shifted down with a reduced vocabulary as LLaDA's are.

Peak host memory: a single process's is its ru_maxrss from wait4 (the kernel's high-water mark, exact). For torchrun
it is the SUM over the process tree (the launcher and each worker) of each process's VmHWM, read from /proc every
0.1 s while the step runs: a high-water mark only grows, so only growth in a process's last 0.1 s could be missed,
and the sum is an upper bound on the memory the processes held at one time (rank 0's export gather happens while
rank 1 waits). Wall time includes the interpreter start, loading the weights and writing the checkpoint.

OMP_NUM_THREADS: --threads (default: every core this process may use) for a single process, --threads / 2 for each
of the two torchrun workers, so that the steps never oversubscribe the cores.
"""

import argparse
import contextlib
import json
import os
import random
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo's top-level files are plain modules
from data import (BOS, DREAM_MASK, EOS, EOT, END_HEADER, IM_END, IM_START, MASK, START_HEADER,  # noqa: E402
                  encode_examples, load_dataset, load_tokenizer, special_ids)
from model import LLaDA, LLaDAConfig, stored_dtype, weight_files  # noqa: E402

# LLaDA-8B-Instruct's vocabulary (config.json: vocab_size = embedding_size) and special ids (tokenizer.json)
LLADA_VOCAB = 126464
LLADA_SPECIAL_IDS = {BOS: 126080, EOS: 126081, MASK: 126336, START_HEADER: 126346, END_HEADER: 126347, EOT: 126348}
# Dream-v0-7B's (Qwen2.5's vocabulary and ChatML tokens; Dream's mask token)
DREAM_VOCAB = 152064
DREAM_SPECIAL_IDS = {EOS: 151643, IM_START: 151644, IM_END: 151645, DREAM_MASK: 151666}
TEXT_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))  # ordinary text: one token per character, ids 0-95

# per family: its vocabulary, special ids, mask token, the config fields the widths do not give
FAMILIES = dict(
    llada=dict(vocab=LLADA_VOCAB, special_ids=LLADA_SPECIAL_IDS, mask=MASK, config=dict(rope_theta=500000.0)),
    dream=dict(vocab=DREAM_VOCAB, special_ids=DREAM_SPECIAL_IDS, mask=DREAM_MASK,
               config=dict(model_type="Dream", include_qkv_bias=True, weight_tying=False, rope_theta=1e6,
                           rms_norm_eps=1e-6)),
)
DEFAULTS = dict(
    llada=dict(d_model=4096, n_heads=32, n_kv_heads=32, mlp=12288, layers=2, vocab=LLADA_VOCAB, full_layers=2,
               full_vocab=32768, max_len=1024, lora_r=128, lora_alpha=256, gen_length=32, shards=4),
    dream=dict(d_model=3584, n_heads=28, n_kv_heads=4, mlp=18944, layers=2, vocab=DREAM_VOCAB, full_layers=1,
               full_vocab=8192, max_len=1024, lora_r=128, lora_alpha=256, gen_length=32, shards=4))
SMOKE = dict(  # dream's max_len is longer: ChatML's system turn makes its shortest row ~95 tokens
    llada=dict(d_model=64, n_heads=4, n_kv_heads=4, mlp=192, layers=2, vocab=512, full_layers=2, full_vocab=512,
               max_len=64, lora_r=8, lora_alpha=16, gen_length=8, shards=3),
    dream=dict(d_model=64, n_heads=4, n_kv_heads=2, mlp=192, layers=2, vocab=1024, full_layers=2, full_vocab=1024,
               max_len=160, lora_r=8, lora_alpha=16, gen_length=8, shards=3))
N_TRAIN_ROWS = 4  # 2 steps of one example (LoRA, 1 process) or of two (FSDP2, 2 processes)
POLL_S = 0.1  # how often the memory of a running step is read from /proc
GIB = 2**30

# -----------------------------------------------------------------------------
# The synthetic model folders


def special_ids_for(vocab, family="llada"):
    """The family's special ids (LLaDA's or Dream's), shifted down by its real vocabulary - vocab for a reduced
    vocabulary (unchanged at the real one: 126464, 152064)."""
    fam = FAMILIES[family]
    shift = fam["vocab"] - vocab
    ids = {token: i - shift for token, i in fam["special_ids"].items()}
    if min(ids.values()) < len(TEXT_CHARS):
        need = len(TEXT_CHARS) + fam["vocab"] - min(fam["special_ids"].values())
        raise ValueError(f"vocab {vocab} is too small: {family}'s special ids shifted by {shift} collide with the "
                         f"{len(TEXT_CHARS)} text characters (use at least {need})")
    return ids


def make_tokenizer(vocab, family="llada"):
    """A char-level tokenizer of exactly `vocab` ids with the family's special tokens at special_ids_for(vocab), as
    embedded.make_char_tokenizer but with the ids pinned: tokens already in the WordLevel vocabulary keep their id when
    they are added as special tokens (matched in text as one token, which data.special_ids requires)."""
    specials = special_ids_for(vocab, family)
    words = {c: i for i, c in enumerate(TEXT_CHARS)} | specials
    taken = set(words.values())
    words |= {f"<|reserved_{i}|>": i for i in range(vocab) if i not in taken}  # unreachable fillers
    tokenizer = Tokenizer(models.WordLevel(words))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char alone
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tokenizer


def write_model(folder, a, n_layers, vocab, seed):
    """A Hugging Face folder of the family a.family (LLaDA, or Dream-v0: Dream's config.json and key names) with
    random bf16 weights in several shards and the pinned tokenizer; checked after writing. Returns the number of
    parameters and of shards."""
    fam, specials = FAMILIES[a.family], special_ids_for(vocab, a.family)
    config = LLaDAConfig(d_model=a.d_model, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, n_layers=n_layers,
                         mlp_hidden_size=a.mlp, vocab_size=vocab, embedding_size=vocab,
                         mask_token_id=specials[fam["mask"]], eos_token_id=specials[EOS], pad_token_id=specials[EOS],
                         **fam["config"])
    with torch.device("meta"):
        model = LLaDA(config).to(torch.bfloat16)  # no storage yet
    model.to_empty(device="cpu")  # bf16 storage only: 2 bytes per parameter
    model.init_weights(torch.Generator().manual_seed(seed))
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder, max_shard_bytes=2 * n_params // a.shards)  # several shards and an index
    del model
    make_tokenizer(vocab, a.family).save(str(folder / "tokenizer.json"))

    # what the training and evaluation code will see
    files = weight_files(folder)
    if len(files) < 2 or not (folder / "model.safetensors.index.json").is_file():
        raise RuntimeError(f"{folder}: expected several safetensors shards with an index, got {files}")
    keys = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    want = ("model.layers.0.self_attn.q_proj.weight" if a.family == "dream"  # Qwen's key names
            else "model.transformer.blocks.0.q_proj.weight")
    if want not in keys:
        raise RuntimeError(f"{folder}: no key {want!r} among the stored weights ({sorted(keys)[:4]}, ...)")
    if stored_dtype(folder) != torch.bfloat16:
        raise RuntimeError(f"{folder}: weights stored as {stored_dtype(folder)}, not bfloat16")
    loaded = LLaDAConfig.from_json(folder / "config.json")
    if (loaded.model_type == "Dream") != (a.family == "dream") or loaded.n_kv_heads != a.n_kv_heads:
        raise RuntimeError(f"{folder}: config.json reads back as model_type {loaded.model_type}, "
                           f"{loaded.n_kv_heads} kv heads")
    ids = special_ids(load_tokenizer(folder), loaded)
    got = ({EOS: ids.eos, IM_START: ids.start_header, IM_END: ids.eot, DREAM_MASK: ids.mask} if a.family == "dream"
           else {BOS: ids.bos, EOS: ids.eos, MASK: ids.mask, START_HEADER: ids.start_header,
                 END_HEADER: ids.end_header, EOT: ids.eot})
    if got != specials or ids.pad != specials[EOS]:
        raise RuntimeError(f"{folder}: special ids {got} (pad {ids.pad}) after loading, expected {specials}")
    return n_params, len(files)


# -----------------------------------------------------------------------------
# The data files


def sum_row(numbers):
    """A prompt/response row in GSM8K's style: a sum worked out one addition a line."""
    lines, total = [], numbers[0]
    for x in numbers[1:]:
        lines.append(f"{total}+{x}={total + x}")
        total += x
    return dict(prompt="Add " + " ".join(map(str, numbers)) + ".", response="\n".join(lines) +
                f"\nThe answer is {total}.")


def training_rows(tokenizer, n_rows, max_len, seed):
    """n_rows sum rows, each as long as a random 60-95% of max_len tokens (chat format included) allows."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n_rows):
        target = int(max_len * rng.uniform(0.6, 0.95))
        numbers = [rng.randint(1, 99), rng.randint(1, 99)]
        while True:  # one more number while the row still fits
            longer = numbers + [rng.randint(1, 99)]
            row = sum_row(longer)
            [(ids, _)] = encode_examples(tokenizer, [([{"role": "user", "content": row["prompt"]}], row["response"])])
            if len(ids) > target:
                break
            numbers = longer
        rows.append(sum_row(numbers))
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


# -----------------------------------------------------------------------------
# Running a step: wall time, peak host memory, exit status


def process_tree(root):
    """root and every process descended from it, from the parent ids in /proc/<pid>/stat."""
    parents = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path("/proc", entry.name, "stat").read_text()
            except OSError:  # it ended meanwhile
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])  # "pid (comm) state ppid ..."
    tree, frontier = [root], {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier}
        tree += sorted(frontier)
    return tree


def peak_rss_kib(pid):
    """VmHWM (the process's peak resident memory so far) in KiB, or None once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), None)
    except OSError:
        return None


def run_step(name, cmd, env, log_path, timeout_s):
    """Run cmd (cwd: the repo) to its end, its output into log_path. Returns a dict: name, wall_s, peak_gib (see the
    docstring at the top), per_process (GiB, the root first), status (the exit code, or "timeout")."""
    print(f"\n== {name}\n$ {shlex.join(cmd)}\n  (log: {log_path})", flush=True)
    peaks, timed_out = {}, False
    with open(log_path, "w") as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while True:
                for pid in process_tree(proc.pid):
                    kib = peak_rss_kib(pid)
                    if kib:
                        peaks[pid] = max(peaks.get(pid, 0), kib)
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if time.time() - t0 > timeout_s and not timed_out:
                    os.killpg(proc.pid, signal.SIGKILL)  # the step's own session: it and its workers
                    timed_out = True
                time.sleep(POLL_S)
        except BaseException:  # e.g. Ctrl-C: leave no step running behind
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        wall = time.time() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so that Popen does not wait for it again
    per_process = [peaks[pid] / 2**20 for pid in peaks]
    peak = usage.ru_maxrss / 2**20 if len(peaks) <= 1 else sum(per_process)  # ru_maxrss is in KiB on Linux
    result = dict(name=name, wall_s=wall, peak_gib=peak, per_process=per_process,
                  status="timeout" if timed_out else proc.returncode)
    tail = Path(log_path).read_text().splitlines()[-(4 if result["status"] == 0 else 40):]
    print("\n".join("  | " + line for line in tail))
    print(f"  -> exit {result['status']}, {wall:.1f} s, peak {peak:.2f} GiB", flush=True)
    return result


def print_table(results):
    print(f"\n{'step':50} {'wall s':>7} {'peak GiB':>9}  {'per process GiB':22} {'exit':>7}")
    for r in results:
        per = " + ".join(f"{g:.2f}" for g in r["per_process"]) if len(r["per_process"]) > 1 else "1 process"
        print(f"{r['name']:50} {r['wall_s']:7.1f} {r['peak_gib']:9.2f}  {per:22} {r['status']!s:>7}")
    print("peak GiB: ru_maxrss of a single process; for several, the sum of their VmHWM (per process: torchrun's "
          "launcher first, then the workers)")


# -----------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description="Real-width dry run of the LLaDA-8B path (or Dream-v0-7B's) on the CPU: "
                                            "gift.py (LoRA GIFT; full fine-tuning with FSDP2), eval.py and sample.py, "
                                            "each timed.")
    p.add_argument("--family", choices=tuple(FAMILIES), default="llada",
                   help="llada: LLaDA-8B's widths, config and special ids; dream: Dream-v0-7B's (GQA, q/k/v biases, "
                        "Dream's config.json and key names, ChatML special tokens). The defaults below are per family")
    p.add_argument("--smoke", action="store_true",
                   help="tiny widths, max-len 64 (dream 160), the same four steps (seconds; b and d run beside a "
                        "and c)")
    L, D, S = DEFAULTS["llada"], DEFAULTS["dream"], SMOKE["llada"]

    def default(k):
        return f"default {L[k]}, dream {D[k]}"
    p.add_argument("--d-model", type=int, help=f"model width ({default('d_model')}, smoke {S['d_model']})")
    p.add_argument("--n-heads", type=int, help=f"attention heads ({default('n_heads')}, smoke {S['n_heads']})")
    p.add_argument("--n-kv-heads", type=int, help=f"key/value heads ({default('n_kv_heads')}, smoke "
                                                  f"{S['n_kv_heads']} (dream {SMOKE['dream']['n_kv_heads']}))")
    p.add_argument("--mlp", type=int, help=f"mlp_hidden_size ({default('mlp')}, smoke {S['mlp']})")
    p.add_argument("--layers", type=int, help=f"layers of the LoRA, eval and sample model ({default('layers')})")
    p.add_argument("--vocab", type=int, help=f"vocabulary of that model ({default('vocab')}, the real ones; smoke "
                                             f"{S['vocab']} (dream {SMOKE['dream']['vocab']}), special ids shifted "
                                             "down)")
    p.add_argument("--full-layers", type=int, help=f"layers of the full fine-tuning model ({default('full_layers')}; "
                                                   "llada: 3 is the most that fits 24 GB)")
    p.add_argument("--full-vocab", type=int, help=f"vocabulary of the full fine-tuning model ({default('full_vocab')}: "
                                                  "the real ones do not fit 24 GB, see the top)")
    p.add_argument("--max-len", type=int, help=f"training length, every example padded to it (default "
                                               f"{L['max_len']}, smoke {S['max_len']} (dream "
                                               f"{SMOKE['dream']['max_len']}))")
    p.add_argument("--lora-r", type=int, help=f"LoRA rank (default {L['lora_r']}, the paper's)")
    p.add_argument("--lora-alpha", type=int, help=f"LoRA alpha (default {L['lora_alpha']}, the paper's)")
    p.add_argument("--gen-length", type=int, help=f"tokens generated by eval.py and sample.py (default "
                                                  f"{L['gen_length']}, smoke {S['gen_length']})")
    p.add_argument("--shards", type=int, help=f"safetensors shards to aim for (default {L['shards']})")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="OMP_NUM_THREADS of a single-process step; each of the 2 torchrun workers gets half")
    p.add_argument("--timeout", type=float, default=1800, help="seconds after which a step is killed")
    p.add_argument("--work", default=None, help="folder for the model folders, data and runs (kept); default: a "
                                                "temporary folder, deleted at the end (~15 GB at the default sizes)")
    a = p.parse_args(argv)
    for k, v in (SMOKE if a.smoke else DEFAULTS)[a.family].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    torch.set_num_threads(a.threads)

    if a.work:
        Path(a.work).mkdir(parents=True, exist_ok=True)
    with contextlib.nullcontext(a.work) if a.work else tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        work = Path(tmp)
        base, full_base = work / "base", work / "base-full"
        t0 = time.time()
        n_base, shards_base = write_model(base, a, a.layers, a.vocab, seed=0)
        n_full, shards_full = write_model(full_base, a, a.full_layers, a.full_vocab, seed=1)
        tokenizer = load_tokenizer(base)  # the text ids are the same in both folders
        rows = training_rows(tokenizer, N_TRAIN_ROWS, a.max_len, seed=0)
        write_jsonl(work / "train.jsonl", rows)
        examples, stats = load_dataset(work / "train.jsonl", tokenizer, max_len=a.max_len)
        if stats["dropped_too_long"]:
            raise ValueError(f"--max-len {a.max_len} is too short for even the shortest sum row")
        write_jsonl(work / "gsm8k.jsonl", [dict(question=f"What is {x} + {y}?", answer=f"{x} + {y} = {x + y}\n#### "
                                                f"{x + y}") for x, y in ((12, 7), (30, 45), (8, 9))])
        setup = dict(name="0. write the folders and data (this process)", wall_s=time.time() - t0, per_process=[],
                     peak_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, status=0)
        lengths = [len(ids) for ids, _ in examples]
        print(f"base ({a.family}): d_model {a.d_model}, {a.n_heads} heads, {a.n_kv_heads} kv heads, mlp {a.mlp}, "
              f"{a.layers} layers, vocab {a.vocab}: {n_base / 1e6:.1f}M parameters, bf16 in {shards_base} shards "
              f"({base})")
        print(f"full fine-tuning base: the same widths, {a.full_layers} layers, vocab {a.full_vocab}: "
              f"{n_full / 1e6:.1f}M parameters, bf16 in {shards_full} shards; special ids "
              f"{special_ids_for(a.full_vocab, a.family)}")
        print(f"training data: {len(examples)} examples of {min(lengths)}-{max(lengths)} tokens, padded to "
              f"{a.max_len}; setup {setup['wall_s']:.0f} s")

        single = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
        per_worker = {**os.environ, "OMP_NUM_THREADS": str(max(1, a.threads // 2))}
        train = ["--data", str(work / "train.jsonl"), "--loss", "gift", "--dtype", "bfloat16", "--max-len",
                 str(a.max_len), "--pad-to-max-len", "--max-steps", "2", "--batch-size", "1", "--grad-accum", "1",
                 "--log-every", "1", "--overwrite"]
        py = sys.executable
        results = [setup]

        def lora_step():
            return run_step(
                f"a. gift.py LoRA GIFT, vocab {a.vocab}, {a.layers} layers",
                [py, "gift.py", "--model", str(base), *train, "--lora", "--lora-r", str(a.lora_r), "--lora-alpha",
                 str(a.lora_alpha), "--out", str(work / "run-lora")], single, work / "a-lora.log", a.timeout)

        def full_step():
            return run_step(
                f"b. gift.py full FSDP2 x2, vocab {a.full_vocab}, {a.full_layers} layers",
                [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "gift.py", "--model",
                 str(full_base), *train, "--out", str(work / "run-full")], per_worker, work / "b-full.log", a.timeout)

        def eval_step():
            latest = work / "run-lora" / "latest"  # names step a's last checkpoint, if it wrote one
            adapter = (work / "run-lora" / "checkpoints" / latest.read_text().strip() / "adapter"
                       if latest.is_file() else None)
            return run_step(
                f"c. eval.py gsm8k --limit 2, gen {a.gen_length}" + (", adapter" if adapter else ", base (no adapter)"),
                [py, "eval.py", "--model", str(base), *(["--adapter", str(adapter)] if adapter else []), "--task",
                 "gsm8k", "--data", str(work / "gsm8k.jsonl"), "--limit", "2", "--batch-size", "2", "--gen-length",
                 str(a.gen_length), "--block-length", str(min(32, a.gen_length)), "--out", str(work / "eval.json")],
                single, work / "c-eval.log", a.timeout)

        def sample_step():
            return run_step(
                f"d. sample.py bf16, gen {a.gen_length}",
                [py, "sample.py", "--model", str(base), "--prompt", "Add 12 7 30.", "--gen-length", str(a.gen_length),
                 "--dtype", "bfloat16"], single, work / "d-sample.log", a.timeout)

        # --smoke: b and d (which need nothing from a) run in threads beside a and then c (c reads a's adapter), so
        # that the steps' interpreter start-ups overlap; at real widths one at a time, so that each has the machine
        with ThreadPoolExecutor(2) as background:
            pending = {step: background.submit(step) for step in (full_step, sample_step) if a.smoke}
            results += [pending[step].result() if step in pending else step()
                        for step in (lora_step, full_step, eval_step, sample_step)]

    print_table(results)
    failed = [r["name"] for r in results if r["status"] != 0]
    print("all steps succeeded" if not failed else f"FAILED: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
