"""RL after GIFT: wd1 (arXiv 2507.08838), the RL framework of GIFT's appendix "SFT Role in Subsequent RL" (arXiv
2509.20863), on this project's model, LoRA, samplers, graders and long-job machinery: a GIFT (or SFT) checkpoint as
the cold start, then reinforcement learning on a task's rewards.

    python rl.py --model runs/sudoku-tiny --task sudoku --out runs/rl-tiny --max-steps 40        # the embedded toy
    torchrun --nproc_per_node 4 rl.py --model runs/s1k-gift --task sudoku --data 4x4_sudoku_unique_puzzles.csv \\
        --lora --out runs/s1k-gift-rl                                                            # the appendix, 8B

One step, as wd1's trainer `wll_d1_neg` runs it (xiaohangt/wd1, its Sudoku scripts; the defaults are its values):
  1. every `--iterations` (8) optimizer steps, a rollout: P prompts (--prompts-per-step 8), G completions each
     (--group-size 6) from LLaDA's block sampler (low-confidence remasking, temperature 0.9, 256 tokens, 128 steps,
     blocks of 32); a reward r_i per completion (d1's reward functions);
  2. A_i = r_i - the mean of its group's rewards (no division by the standard deviation);
  3. within each group w+ = softmax(A), w- = softmax(-A); the loss sum_i (w-_i - w+_i) l_i, averaged over the groups,
     l_i the sum of log p(o_i,t) over the completion's tokens up to and including its first EOS (no length
     normalisation; no ratio, clipping, KL or reference policy);
  4. log p(o_i,t) by d1's one-step estimate: every completion token masked, each prompt token masked with
     probability --prompt-mask (0.15), one forward pass, -cross-entropy at the completion positions; each of the
     rollout's `--iterations` optimizer steps draws its own prompt mask.
Where ours differs, on purpose: a completion ends at its first turn end (every token after it EOS, what the sampler's
early exit returns), in the likelihood and for the reward alike, so that the early exit (on by default) changes
nothing; wd1 reads the reward from the whole decoded generation (for LLaDA-8B, which writes EOS after its turn end,
the same text). Each group is sampled by itself (no padding) from its own generators, and each group's prompt mask
comes from its own generator: 2 processes compute what 1 does, and a resumed run what an unstopped one does.
"""

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cached_sample import generate_with_options
import embedded
from data import chat_format, chat_prompt, encode, load_tokenizer, special_ids
from eval import (ANSWER_TAG, INSTRUCTIONS, SUDOKU_QUESTION, TASKS, d1_options, eval_arithmetic, last_boxed,
                  load_benchmark, load_sudoku, math_equiv)
from gift import AT_LEAST_1, OFF_OR_MORE, chunked_cross_entropy, gradient_sync, lr_lambda, option, uniforms, wrap_model
from longjob import (DTYPES, EXPORTED, SEED_RULE, SEEDS, CheckpointManager, Export, RunError, adapter_fingerprint,
                     add_dataclass_flags, all_reduce, clipped_step, compute_dtype, end_distributed, folder_fingerprint,
                     gather_objects, hms, is_rank0, load_weights, print0, rank_and_world, run_command_line, run_folder,
                     seconds_left, setup_distributed)
from model import check_fields, predicting_hidden, read_config, stored_dtype, unwrap
from sample import SamplerOptions, add_sampler_flags, resolve_model, stop_ids

# =====================================================================================================================
# Part I. wd1's objective


def group_advantages(rewards, group_size):
    """A_i = r_i - the mean of its group's rewards, (P, G) for rewards (P * G,), each group's G contiguous; a group
    whose rewards are all equal has A = 0 exactly (its float mean may differ from them in the last bit)."""
    r = rewards.view(-1, group_size)  # (P, G)
    equal = (r == r[:, :1]).all(dim=1, keepdim=True)  # (P, 1)
    return torch.where(equal, 0.0, r - r.mean(dim=1, keepdim=True))


def wd1_weights(rewards, group_size):
    """(w+, w-), each (P, G): softmax(A) and softmax(-A) within each group (a group of equal rewards: 1/G each)."""
    A = group_advantages(rewards, group_size)
    return A.softmax(dim=1), (-A).softmax(dim=1)


def wd1_loss(logp_sums, rewards, group_size):
    """wd1's loss (rev_grpo_trainer.compute_loss): logp_sums (N,) the completions' summed log-likelihoods l_i, rewards
    (N,), N = P * G, each group's G completions contiguous -> the mean over the P groups of sum_i (w-_i - w+_i) l_i (its
    per-device loss, one group per device, averaged over devices and accumulation steps as its gradients are). A
    group of equal rewards contributes exactly 0, and so does its gradient."""
    if group_size < 1 or logp_sums.ndim != 1 or logp_sums.shape != rewards.shape or len(rewards) % group_size:
        raise ValueError(f"wd1_loss: logp_sums {tuple(logp_sums.shape)} and rewards {tuple(rewards.shape)} must be "
                         f"(P * group_size,) = (P * {group_size},)")
    w_pos, w_neg = wd1_weights(rewards.to(logp_sums.dtype), group_size)
    return ((w_neg - w_pos) * logp_sums.view(-1, group_size)).sum(dim=1).mean()


def end_at_stop(completions, stops, eos_id):
    """(N, C) completions with every token after the first stop (turn end or EOS) set to EOS: what the sampler's early
    exit returns, applied to every rollout so that the exit changes no completion."""
    is_stop = torch.isin(completions, torch.as_tensor(stops, device=completions.device))
    return completions.masked_fill(is_stop.cumsum(dim=1) - is_stop.long() > 0, eos_id)


def completion_mask(completions, eos_id):
    """(N, C) bool: the tokens up to and including the first EOS (wd1's completion_mask); all of them without one."""
    is_eos = completions == eos_id
    return is_eos.cumsum(dim=1) - is_eos.long() == 0


def likelihood_input(prompt_ids, completions, prompt_mask, generator, mask_id):
    """d1's one-step estimate's input (G, P + C) for one prompt (P,) and its G completions (G, C): each prompt token
    masked with probability `prompt_mask` (a U(0, 1) draw per token from `generator`), every completion token masked."""
    G, P = len(completions), len(prompt_ids)
    u = uniforms((G, P), generator, prompt_ids.device)  # (G, P)
    prompts = prompt_ids.expand(G, P).masked_fill(u < prompt_mask, mask_id)
    return torch.cat([prompts, torch.full_like(completions, mask_id)], dim=1)


def completion_logps(model, noisy_ids, completions):
    """log p(o_t) (G, C) at every completion position, from one forward pass on noisy_ids (G, P + C): -cross-entropy,
    one chunk of logits at a time (gift.chunked_cross_entropy). Dream's shifted head: model.predicting_hidden."""
    G, C = completions.shape
    h = predicting_hidden(model, noisy_ids)[:, -C:]  # (G, C, D)
    return -chunked_cross_entropy(unwrap(model).head, h.reshape(G * C, -1), completions.reshape(-1)).view(G, C)


def group_loss(model, prompt_ids, completions, mask, rewards, prompt_mask, generator, mask_id):
    """One group's wd1 loss sum_i (w-_i - w+_i) l_i (wd1_loss of one group) and its l_i (G,): the likelihood pass."""
    noisy = likelihood_input(prompt_ids, completions, prompt_mask, generator, mask_id)
    logp_sums = (completion_logps(model, noisy, completions) * mask).sum(dim=1)  # (G,)
    return wd1_loss(logp_sums, rewards, len(rewards)), logp_sums


# ---------------------------------------------------------------------------------------------------------------------
# The rewards: d1's reward_func.py (wd1 trains with it), on the completion's text up to its turn end


def sudoku_reward(completion, puzzle, solution):
    """d1's Sudoku reward: the LAST <answer>...</answer> (across lines), its digits only (str.isdigit, as d1), padded
    with "0" or cut to 16; the share of the puzzle's empty cells ("0") it fills with the solution's digit. No tag, no
    digit in it, or no empty cell: 0."""
    tags = ANSWER_TAG.findall(completion)
    digits = "".join(c for c in tags[-1].strip() if c.isdigit()) if tags else ""
    empty = [i for i in range(16) if puzzle[i] == "0"]
    if not digits or not empty:
        return 0.0
    digits = digits[:16].ljust(16, "0")
    return sum(digits[i] == solution[i] for i in empty) / len(empty)


def countdown_reward(completion, numbers, target):
    """d1's Countdown reward (compute_score): the last <answer> tag, stripped; none: 0. It must use exactly the given
    numbers (its \\d+ runs, sorted) and only digits, + - * / ( ) . and white space, and equal the target within 1e-5
    as Python arithmetic (eval.eval_arithmetic, d1's eval without eval): 1.0; a tag that fails any of these: 0.1."""
    tags = ANSWER_TAG.findall(completion)
    if not tags:
        return 0.0
    equation = tags[-1].strip()
    if sorted(int(n) for n in re.findall(r"\d+", equation)) != sorted(numbers):
        return 0.1
    if not re.match(r"^[\d+\-*/().\s]+$", equation):
        return 0.1
    try:
        return 1.0 if abs(eval_arithmetic(equation) - target) < 1e-5 else 0.1
    except Exception:  # a syntax error, a division by zero, an overflow
        return 0.1


def xml_answer(text):
    """d1's extract_xml_answer: the text after the last "<answer>", before the first "</answer>" after it, stripped."""
    return text.split("<answer>")[-1].split("</answer>")[0].strip()


def xml_count(text):
    """d1's count_xml: 0.125 per tag line present once, less 0.001 per character after the closing answer tag."""
    count = 0.0
    if text.count("<reasoning>\n") == 1:
        count += 0.125
    if text.count("\n</reasoning>\n") == 1:
        count += 0.125
    if text.count("\n<answer>\n") == 1:
        count += 0.125
        count -= len(text.split("\n</answer>\n")[-1]) * 0.001
    if text.count("\n</answer>") == 1:
        count += 0.125
        count -= (len(text.split("\n</answer>")[-1]) - 1) * 0.001
    return count


def gsm8k_reward(completion, answer):
    """d1's five GSM8K rewards, summed: the <answer> text equal to the gold answer string (2.0), all digits (0.5), the
    strict format (0.5) and the soft one (0.5) matched from the start, and xml_count."""
    extracted = xml_answer(completion)
    strict = re.match(r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n$", completion)
    soft = re.match(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", completion)
    return ((2.0 if extracted == answer else 0.0) + (0.5 if extracted.isdigit() else 0.0) + (0.5 if strict else 0.0)
            + (0.5 if soft else 0.0) + xml_count(completion))


def math_reward(completion, answer):
    """d1's two MATH rewards, summed: the last box's content (the whole text with no closed box) equivalent to the
    answer (eval.math_equiv, Hendrycks' is_equiv): 2.0; and half of boxed_in_answer: 1 for an <answer> tag, plus 1
    where the tag's text (the whole text without one) holds "\x08oxed", else 0.5 (d1 writes "\\boxed" in a string
    that is not raw: "\\b" is a backspace, so a real box is never found)."""
    candidate = last_boxed(completion)
    correct = math_equiv(completion if candidate is None else candidate, answer)
    tagged = "<answer>" in completion
    text = completion.split("<answer>")[1].split("</answer>")[0] if tagged else completion
    return (2.0 if correct else 0.0) + 0.5 * ((1.0 if tagged else 0.0) + (1.0 if "\x08oxed" in text else 0.5))


def reward(task, completion, item):
    """The reward of one completion's text (decoded without special tokens, up to its turn end) for `task`'s item."""
    if task not in TASKS:
        raise ValueError(f"rl.reward: unknown task {task!r}; choose one of {TASKS}")
    if task == "sudoku":
        return sudoku_reward(completion, item["puzzle"], item["solution"])
    if task == "countdown":
        return countdown_reward(completion, item["numbers"], item["target"])
    if task == "gsm8k":  # the text after "####" as GSM8K writes it ("114,200"), as d1 compares it
        return gsm8k_reward(completion, item["answer_text"])
    return math_reward(completion, item["gold"])


# ---------------------------------------------------------------------------------------------------------------------
# The prompts, as wd1 trains on them (data_utils.py): a user turn, the assistant's turn left to the model


WD1_FORMAT = ("\nRespond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>\n")
COUNTDOWN_PROMPT = (
    "{format}\nUsing only the numbers {numbers}, create an arithmetic expression that evaluates to exactly {target}. "
    "You must use all numbers from the list, and each number must be used exactly once. You may use the operations "
    "+, -, *, and / as needed. After reasoning, provide only your final expression inside <answer></answer> tags "
    "without including an equals sign or the target number. For example, if the numbers are [2, 3, 4] and the target "
    "is 5, a valid answer is: <answer>\n2*4-3\n</answer>")
MATH_PROMPT = ("{format}\n\nYou are a math expert. You will be given a question to solve. Solve it step by step. Wrap "
               "the final answer in a \\boxed{{}}. \n\n{question}")


def prompt_text(task, item, style, fmt):
    """wd1's training prompt for an item (style "d1"), or the question alone ("plain": the embedded task's)."""
    if style == "plain":
        user = item["question"]
    elif task == "sudoku":
        user = INSTRUCTIONS["sudoku"] + "\n\n" + item["question"]
    elif task == "countdown":
        user = COUNTDOWN_PROMPT.format(format=WD1_FORMAT, numbers=item["numbers"], target=item["target"])
    elif task == "gsm8k":
        user = WD1_FORMAT + "\n\n" + item["question"]
    else:
        user = MATH_PROMPT.format(format=WD1_FORMAT, question=item["question"])
    return chat_prompt([{"role": "user", "content": user}], fmt)


# =====================================================================================================================
# Part II. Rollouts


def stream_seed(seed, *index):
    """The seed of one draw stream (a completion's sampling, a group's prompt mask) under the user's seed: a hash of
    both, so that streams never collide and none depends on the batch, the rank or the number of processes."""
    return int.from_bytes(hashlib.sha256(repr((seed,) + index).encode()).digest()[:8], "little") >> 1


def rollout_prompts(n_items, rollout, P, seed):
    """The item indices of rollout number `rollout`: P of a seeded permutation per pass over the items."""
    per_pass = n_items // P
    order = torch.randperm(n_items, generator=torch.Generator().manual_seed(stream_seed(seed, "order",
                                                                                        rollout // per_pass)))
    start = rollout % per_pass * P
    return order[start:start + P].tolist()


@dataclass
class Group:
    """One prompt's rollout: what the update needs of it (every tensor on the CPU until used)."""
    index: int  # its place in the rollout's P prompts (its generators' and its prompt mask's stream)
    item: int  # the prompt's item index
    prompt_ids: torch.Tensor  # (P_len,)
    completions: torch.Tensor  # (G, C), every token after the first stop EOS (end_at_stop)
    mask: torch.Tensor  # (G, C) bool: completion_mask
    rewards: torch.Tensor  # (G,) float32


@torch.no_grad()
def rollout_group(model, prompt_ids, options, G, seed, rollout, index, stops, eos_id, stats):
    """G completions of one prompt (no padding: the group alone), each from its own generator, ended at their first
    stop (end_at_stop). stats: the tokens the early exit skipped."""
    device = prompt_ids.device
    gens = [torch.Generator(device).manual_seed(stream_seed(seed, "rollout", rollout, index, g)) for g in range(G)]
    out = generate_with_options(model, prompt_ids.expand(G, -1), None, options, gens, stops, stats, None)
    return end_at_stop(out[:, len(prompt_ids):], stops, eos_id)


def make_rollout(model, tokenizer, task, items, prompts, opts, options, rollout, ids):
    """This rank's groups of rollout number `rollout` (the prompts k = rank, rank + world, ... of the P), rewarded,
    and the rollout's counts (summed over ranks by the caller)."""
    rank, world = rank_and_world()[:2]
    device = next(unwrap(model).parameters()).device
    was_training = unwrap(model).training
    unwrap(model).eval()  # no dropout while sampling
    groups, counts = [], dict(generated=0, skipped=0)
    stops, eos_id = stop_ids(tokenizer), unwrap(model).config.eos_token_id
    for index in range(rank, opts.prompts_per_step, world):
        item = prompts[index]
        stats = {}
        completions = rollout_group(unwrap(model), ids[item].to(device), options, opts.group_size, opts.seed,
                                    rollout, index, stops, eos_id, stats).cpu()
        texts = [tokenizer.decode(c.tolist(), skip_special_tokens=True) for c in completions]
        rewards = torch.tensor([reward(task, t, items[item]) for t in texts], dtype=torch.float32)
        groups.append(Group(index, item, ids[item], completions, completion_mask(completions, eos_id), rewards))
        counts["skipped"] += stats.get("skipped", 0)
        counts["generated"] += completions.numel() - stats.get("skipped", 0)
    unwrap(model).train(was_training)
    return groups, counts


# =====================================================================================================================
# Part III. The loop: the options, the step, checkpoints (gift.py's rules), the metrics


@dataclass
class RLOptions:
    # what to train
    model: str = option("", "the cold start: a Hugging Face LLaDA or Dream folder, a gift.py checkpoint or run folder "
                        "(as eval.py's --model); a LoRA checkpoint is merged into its base first")
    task: str = option("sudoku", "the task: its prompts and d1's reward function", choices=TASKS)
    data: str = option("", "the prompts with their answers (eval.py's --data formats: Sudoku CSV, Countdown / GSM8K "
                       "/ MATH500 JSONL); empty: the model folder's, or the embedded task's training puzzles")
    prompt_style: str = option("", "d1: wd1's prompt (instruction + question); plain: the question alone (the "
                               "embedded task's); empty: the model folder's, else d1", choices=("", "d1", "plain"))
    out: str = option("runs/rl", "output folder: checkpoints, metrics.jsonl")
    # wd1
    group_size: int = option(6, "G: completions per prompt (wd1: 6)", range="[2, inf)",
                             what="must be at least 2 (an advantage compares a group's completions)")
    prompts_per_step: int = option(8, "P: prompts per rollout, over all processes (wd1: 8 = 4 GPUs x 2)", **AT_LEAST_1)
    iterations: int = option(8, "optimizer steps per rollout batch, each with a fresh prompt mask (wd1: 8)",
                             **AT_LEAST_1)
    prompt_mask: float = option(0.15, "the likelihood pass's prompt-token mask probability (wd1: 0.15)",
                                range="[0, 1)")
    # LoRA or full fine-tuning
    lora: bool = option(False, "LoRA (DDP); default full fine-tuning (FSDP2 over several processes)")
    lora_r: int = option(128, "LoRA rank (wd1: 128)", **AT_LEAST_1)
    lora_alpha: float = option(64.0, "LoRA alpha (wd1: 64)", range="(0, inf)", what="must be a positive number")
    lora_dropout: float = option(0.05, "LoRA dropout (wd1: 0.05)", range="[0, 1)")
    lora_targets: str = option("q_proj,k_proj,v_proj,o_proj,up_proj,down_proj,gate_proj", "comma-separated linears, "
                               "matched as PEFT matches them (wd1's list; on LLaDA, whose names differ, it matches "
                               "q_proj, k_proj, v_proj and up_proj, as in wd1)")
    # optimisation (wd1's train.yaml)
    max_steps: int = option(5000, "optimizer steps (wd1: 5000 from an SFT start)", **AT_LEAST_1)
    lr: float = option(3e-6, "learning rate (wd1: 3e-6, constant after the warm-up)", range="[0, inf)",
                       what="must be positive")
    warmup_steps: int = option(1, "linear warm-up steps (wd1: warmup_ratio 1e-4)", **OFF_OR_MORE)
    weight_decay: float = option(0.1, "AdamW weight decay (wd1: 0.1; betas 0.9, 0.99)", range="[0, inf)")
    grad_clip: float = option(0.2, "max gradient norm (wd1: 0.2; 0 = off)", range="[0, inf)")
    seed: int = option(42, "rollout, prompt order, prompt mask and LoRA seed", range=f"[{SEEDS.start}, {SEEDS.stop})",
                       what=f"must be {SEED_RULE}")
    dtype: str = option("auto", "compute dtype (auto: bf16 on GPU, float32 on CPU)", choices=DTYPES)
    save_dtype: str = option("auto", "exported weights (auto: the start's stored dtype)", choices=DTYPES)
    # bookkeeping
    log_every: int = option(1, "optimizer steps between log lines (wd1: 1)", **AT_LEAST_1)
    save_every: int = option(500, "optimizer steps between checkpoints (wd1: 500)", **AT_LEAST_1)
    keep_last: int = option(2, "checkpoints kept (only this run's are ever deleted)", **AT_LEAST_1)
    resume: bool = option(False, "continue the run in --out from its latest complete checkpoint (or from step 0)")
    overwrite: bool = option(False, "delete the run already in --out and start over")
    max_bad_steps: int = option(5, "stop after this many non-finite steps in a row", **AT_LEAST_1)
    # set by parse_options, not flags: the rollouts' SamplerOptions (its flags are sample.py's), the schedule
    adapter: str = field(default="", metadata=dict(flag=False))  # the LoRA checkpoint's adapter, merged into --model
    sampling: dict = field(default_factory=dict, metadata=dict(flag=False))
    schedule: str = field(default="constant", metadata=dict(flag=False))  # wd1's constant_with_warmup


WD1_SAMPLER = dict(gen_length=256, block_length=32, temperature=0.9)  # steps: gen_length / 2 = 128 (d1's rule)
EMBEDDED_RL_PUZZLES = dict(n=4096, n_blanks=8)  # the toy's prompts: puzzles of the grids its held-out ones are not of


def parse_options(argv=None):
    """RLOptions from the command line (`python rl.py --help`), checked before any work. Its `sampling`, the rollouts'
    SamplerOptions (sample.py's flags): a flag, else the model folder's generation_defaults.json (for this task), else
    wd1's (WD1_SAMPLER). --model is resolved to its model folder (a LoRA checkpoint: its base, the adapter merged)."""
    parser = argparse.ArgumentParser(description="wd1 RL after GIFT (arXiv 2507.08838, arXiv 2509.20863's appendix)",
                                     epilog="The rollouts' sampler flags (sample.py's) default to wd1's: --gen-length "
                                     "256, --steps 128, --block-length 32, --temperature 0.9, low-confidence "
                                     "remasking, the early exit on; a model folder's generation_defaults.json comes "
                                     "first (docs/rl.md).")
    add_dataclass_flags(parser, RLOptions)
    add_sampler_flags(parser)  # --gen-length, --steps, --block-length, --temperature, ... (sample.py's)
    args = parser.parse_args(argv)
    own = {f.name for f in dataclasses.fields(RLOptions)}
    opts = RLOptions(**{k: v for k, v in vars(args).items() if k in own and v is not None})
    try:
        check_fields(opts, lambda name: f"--{name.replace('_', '-')} {getattr(opts, name)}")
        if not opts.model:
            raise ValueError("--model: give the cold start (a gift.py run, checkpoint or export, or an HF folder)")
        if opts.resume and opts.overwrite:
            raise ValueError("--resume continues the run in --out, --overwrite deletes it: choose one")
        given = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in own}, model=opts.model,
                                   adapter=None)
        folder, adapter, defaults, options = resolve_model(given, opts.task)  # as eval.py resolves its --model
        if given.temperature is None and "temperature" not in defaults:
            options = dataclasses.replace(options, temperature=WD1_SAMPLER["temperature"], source="flags")
        options = d1_options(options, WD1_SAMPLER["gen_length"], "flags")  # 256 tokens, blocks of 32, 128 steps
        if options.sampler == "dream" and options.early_exit:
            raise ValueError("--early-exit with --sampler dream: Dream's sampler has no blocks")
        opts.model, opts.adapter = str(folder), str(adapter) if adapter else ""
        opts.prompt_style = opts.prompt_style or defaults.get("prompt_style", "d1")
        opts.sampling = dataclasses.asdict(options)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    return opts


def rollout_options(opts):
    """The rollouts' SamplerOptions (opts.sampling)."""
    return SamplerOptions(**opts.sampling, source="flags")


@dataclass
class RLInputs:
    """What the loop trains on and what checkpoints record: the start model, its tokenizer, the task's items and their
    prompts' token ids, the fingerprints --resume compares, the exports."""
    model: object
    tokenizer: object
    items: list
    ids: list  # [(P_len,) long tensor] per item
    fingerprints: dict
    export: Export
    resolved: dict


def rl_items(opts):
    """The task's items: --data (eval.py's formats, every row), or the embedded model's training puzzles."""
    if opts.data:
        return load_sudoku(opts.data, subset=False) if opts.task == "sudoku" else load_benchmark(opts.task, opts.data)
    heldout = Path(opts.model) / embedded.EMBEDDED_EVAL["test_data"]
    if opts.task != "sudoku" or not heldout.is_file():
        raise ValueError(f"--data: give the {opts.task} prompts with their answers ({opts.model} is not the embedded "
                         "task's model, whose training puzzles are the default)")
    return embedded_prompts(heldout, opts.seed)


def embedded_prompts(heldout_csv, seed):
    """Training puzzles for the embedded model: EMBEDDED_RL_PUZZLES of the solution grids that none of its held-out
    puzzles (heldout_csv) comes from, as eval.load_sudoku's items."""
    held = {item["solution"] for item in load_sudoku(heldout_csv, subset=False)}
    pool = [g for g in embedded.sudoku_grids() if g not in held]
    generator, items, seen = torch.Generator().manual_seed(stream_seed(seed, "puzzles")), [], set()
    while len(items) < EMBEDDED_RL_PUZZLES["n"]:
        grid = pool[torch.randint(len(pool), (1,), generator=generator).item()]
        puzzle = embedded.make_puzzle(grid, EMBEDDED_RL_PUZZLES["n_blanks"], generator)
        if puzzle not in seen:
            seen.add(puzzle)
            items.append(dict(question=SUDOKU_QUESTION.format(puzzle=puzzle), puzzle=puzzle, solution=grid))
    return items


def load_inputs(opts, rank, dtype, world):
    """The start model (a LoRA checkpoint merged into its base), the tokenizer and the items, checked (each prompt
    fits the context with the generation; a reward that can be computed) before any rollout."""
    config = read_config(opts.model)
    tokenizer = load_tokenizer(opts.model)
    special_ids(tokenizer, config, opts.model)  # the chat tokens, checked as gift.py and eval.py check them
    items = rl_items(opts)
    options, fmt = rollout_options(opts), chat_format(tokenizer)
    ids = []
    for i, item in enumerate(items):
        ids.append(torch.tensor(encode(tokenizer, prompt_text(opts.task, item, opts.prompt_style, fmt))))
        if len(ids[-1]) + options.gen_length > config.max_sequence_length:
            raise ValueError(f"{opts.data or 'the prompts'}: item {i}: its prompt of {len(ids[-1])} tokens + "
                             f"--gen-length {options.gen_length} exceed the model's max_sequence_length "
                             f"{config.max_sequence_length}; lower --gen-length")
        if opts.task == "sudoku" and "0" not in item["puzzle"]:
            raise ValueError(f"{opts.data}: item {i}: the puzzle {item['puzzle']} has no empty cell, so its reward is "
                             "always 0; remove it")
    if opts.prompts_per_step > len(items):
        raise ValueError(f"--prompts-per-step {opts.prompts_per_step}: more than the {len(items)} prompts")
    if opts.prompts_per_step % world:
        raise ValueError(f"--prompts-per-step {opts.prompts_per_step}: must be a multiple of the {world} processes")
    model = load_weights(opts.model, opts.adapter or None, dtype, merge=True)
    h = hashlib.sha256(json.dumps([[t.tolist(), it] for t, it in zip(ids, items)], sort_keys=True).encode())
    fingerprints = dict(data=h.hexdigest()[:16], examples=len(items), model=folder_fingerprint(opts.model))
    if opts.adapter:  # the start: the base and the adapter merged into it
        fingerprints["files"] = dict(adapter=adapter_fingerprint(opts.adapter))
        fingerprints["model"] += "+" + fingerprints["files"]["adapter"]
    exported = EXPORTED + embedded.EXPORTED
    files = [f for f in sorted(Path(opts.model).iterdir()) if f.is_file() and any(f.match(p) for p in exported)]
    stored = stored_dtype(opts.model)
    save = stored if opts.save_dtype == "auto" else getattr(torch, opts.save_dtype)
    # a LoRA run on a merged start exports merged/ too: its adapter/ alone needs the start, in no folder
    export = Export(save, files, base_name=opts.model, merged=bool(opts.adapter), base_fingerprint=fingerprints["model"])
    return RLInputs(model, tokenizer, items, ids, fingerprints, export,
                    resolved=dict(dtype=str(dtype).removeprefix("torch.")))


class RolloutBuffer:
    """The rollout the next optimizer steps train on (this rank's groups), saved with every checkpoint, so that a run
    resumed between two rollouts trains on the one it had (its state_dict gathers every rank's)."""

    def __init__(self):
        self.rollout, self.groups, self.counts = -1, [], {}

    def state_dict(self):
        mine = [dataclasses.asdict(g) for g in self.groups]
        return dict(rollout=self.rollout, counts=self.counts, groups=gather_objects(mine))  # every rank calls it

    def load_state_dict(self, state):
        rank = rank_and_world()[0]
        self.rollout, self.counts = state["rollout"], state["counts"]
        self.groups = [Group(**g) for g in state["groups"][rank]]


def rollout_counts(groups, counts, G, device):
    """The rollout's statistics over every rank: reward mean and spread (std over all completions; the mean of the
    groups' stds, wd1's reward_std), the share of groups whose rewards are all equal (zero advantage), the completions'
    mean length (completion_mask), the answer tokens generated and those the early exit skipped."""
    r = torch.cat([g.rewards for g in groups]).double() if groups else torch.zeros(0, dtype=torch.float64)
    group_std = sum(float(g.rewards.double().std()) for g in groups)
    zero = sum(bool((g.rewards == g.rewards[0]).all()) for g in groups)
    length = sum(int(g.mask.sum()) for g in groups)
    n, s, sq, gs, z, ln, gen, sk = all_reduce([len(r), float(r.sum()), float((r * r).sum()), group_std, zero, length,
                                               counts["generated"], counts["skipped"]], device)
    n_groups = n / G
    mean = s / max(n, 1)
    return dict(reward_mean=mean, reward_std=math.sqrt(max(sq / max(n, 1) - mean * mean, 0.0)),
                reward_group_std=gs / max(n_groups, 1), zero_advantage=z / max(n_groups, 1),
                answer_length=ln / max(n, 1), tokens_generated=int(gen), tokens_skipped=int(sk))


def update(model, optimizer, groups, opts, step, autocast, mask_id):
    """One optimizer step of wd1's loss over the rollout's P groups (this rank's `groups`): each group one micro-batch,
    its loss / P backpropagated times the world size (DDP and FSDP2 average over the ranks), a fresh prompt mask per
    step and group (stream_seed(seed, "prompt mask", step, group index)). Returns loss, grad_norm, stepped, n_tokens."""
    world, device = rank_and_world()[1], next(unwrap(model).parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    loss_sum = 0.0
    for j, g in enumerate(groups):
        generator = torch.Generator(device).manual_seed(stream_seed(opts.seed, "prompt mask", step, g.index))
        with gradient_sync(model, enabled=j == len(groups) - 1), autocast:
            loss, _ = group_loss(model, g.prompt_ids.to(device), g.completions.to(device), g.mask.to(device),
                                 g.rewards.to(device), opts.prompt_mask, generator, mask_id)
            (loss / opts.prompts_per_step * world).backward()
        loss_sum += float(loss.detach()) / opts.prompts_per_step
    n_tokens = sum(g.completions.numel() + len(g.prompt_ids) * len(g.completions) for g in groups)
    loss, n_tokens = all_reduce([loss_sum, n_tokens], device)
    grad_norm, stepped = clipped_step(params, optimizer, loss, opts.grad_clip)
    return dict(loss=loss, grad_norm=grad_norm, stepped=stepped, n_tokens=n_tokens)


class RLMetrics:
    """The run's log, as gift.py's (longjob.MetricsLog): a line and a metrics.jsonl record (rank 0) every --log-every
    steps and at the last, over the steps since the previous one (`unlogged`: checkpoints save it)."""

    def __init__(self, out, log_every, state, total_steps, unlogged):
        self.file = open(out / "metrics.jsonl", "a") if is_rank0() else None
        self.log_every, self.total_steps, self.unlogged = log_every, total_steps, unlogged
        self.first_step, self.t_attempt, self.t_last = state.step, time.time(), time.time()

    def add(self, result, state, lr):
        now = time.time()
        state.elapsed_s += now - self.t_last
        self.t_last = now
        self.unlogged.append(result)
        if state.step % self.log_every == 0 or state.step == self.total_steps:
            w = self.unlogged
            eta_s = seconds_left(self.t_attempt, state.step - self.first_step, self.total_steps - state.step)
            record = dict(step=state.step, total_steps=self.total_steps, **w[-1], lr=lr)  # the last step's rollout
            record.update(loss=sum(x["loss"] for x in w) / len(w), grad_norm=sum(x["grad_norm"] for x in w) / len(w),
                          rollout_s=sum(x["rollout_s"] for x in w), update_s=sum(x["update_s"] for x in w),
                          elapsed_s=state.elapsed_s, eta_s=eta_s, skipped_steps=state.skipped_steps)
            record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
                      if k not in ("stepped", "n_tokens")}
            num = lambda v, f: "nan" if v is None else format(v, f)  # noqa: E731
            print0(f"step {state.step}/{self.total_steps} (rollout {record['rollout']}) | loss "
                   f"{num(record['loss'], '.4g')} | reward {record['reward_mean']:.3f} +- {record['reward_std']:.3f} "
                   f"| zero-advantage groups {record['zero_advantage']:.0%} | answer {record['answer_length']:.0f} "
                   f"tokens | rollout {record['rollout_s']:.1f} s, update {record['update_s']:.1f} s | "
                   f"{hms(state.elapsed_s)} elapsed, ETA {hms(eta_s)}")
            if self.file:
                self.file.write(json.dumps(record, allow_nan=False) + "\n")
                self.file.flush()
            self.unlogged = []


def train(opts, preemption):
    """The whole run on every rank: set-up, resume, then per step a rollout when due and one update."""
    rank, world, device = setup_distributed()
    dtype = compute_dtype(opts.dtype, device)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype == torch.bfloat16 else contextlib.nullcontext()
    inputs = load_inputs(opts, rank, dtype, world)
    checkpoints = CheckpointManager(opts, world, inputs, preemption)
    lora = (dict(r=opts.lora_r, alpha=opts.lora_alpha, dropout=opts.lora_dropout,
                 targets=tuple(opts.lora_targets.split(","))) if opts.lora else None)
    options = rollout_options(opts)
    if not opts.lora and world > 1 and (options.early_exit is not False or options.threshold is not None):
        options = dataclasses.replace(options, early_exit=False, source="flags")  # FSDP2: every rank's steps in step
        if options.threshold is not None:
            raise ValueError("--threshold with full fine-tuning on several processes: FSDP2 needs every rank to run "
                             "as many sampler steps; use --lora, or drop --threshold")
    model = wrap_model(inputs.model, device, dtype, world, lora, False, opts.seed, "ddp" if opts.lora else "fsdp")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opts.lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=opts.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda("constant", opts.warmup_steps, opts.max_steps))
    what = f"LoRA r {opts.lora_r} on {opts.lora_targets}" if opts.lora else "full fine-tuning"
    print0(f"rl.py: wd1 on {opts.task}, {what}; start {opts.model}{' + ' + opts.adapter if opts.adapter else ''}; "
           f"{len(inputs.items)} prompts; {opts.prompts_per_step} prompts x {opts.group_size} completions per rollout, "
           f"{opts.iterations} steps each; {options.gen_length} tokens, {options.steps} steps, block "
           f"{options.block_length}, temperature {options.temperature}; {world} process{'es' if world > 1 else ''} "
           f"on {device.type}, {str(dtype).removeprefix('torch.')}; {opts.max_steps} steps; output {opts.out}")
    buffer = RolloutBuffer()
    torch.manual_seed(opts.seed * 1000 + rank)  # LoRA dropout draws from each rank's global generator
    state, unlogged = checkpoints.restore(model, optimizer, scheduler, buffer, opts.max_steps)
    metrics = RLMetrics(Path(opts.out), opts.log_every, state, opts.max_steps, unlogged)
    mask_id = unwrap(model).config.mask_token_id
    model.train()
    while state.step < opts.max_steps:
        rollout = state.step // opts.iterations
        t0 = time.time()
        if buffer.rollout != rollout:  # the first step of a rollout batch (a resumed run has its own in the buffer)
            prompts = rollout_prompts(len(inputs.items), rollout, opts.prompts_per_step, opts.seed)
            groups, counts = make_rollout(model, inputs.tokenizer, opts.task, inputs.items, prompts, opts, options,
                                          rollout, inputs.ids)
            buffer.rollout, buffer.groups = rollout, groups
            buffer.counts = rollout_counts(groups, counts, opts.group_size, device)
        t1 = time.time()
        result = update(model, optimizer, buffer.groups, opts, state.step, autocast, mask_id)
        scheduler.step()
        result.update(buffer.counts, rollout=rollout, rollout_s=t1 - t0, update_s=time.time() - t1)
        state.advance(result, opts.iterations, opts.max_bad_steps, Path(opts.out))
        metrics.add(result, state, scheduler.get_last_lr()[0])
        checkpoints.step_done(state, metrics.unlogged, False)
    return checkpoints.final(state)


def main(argv=None):
    opts = parse_options(argv)
    with run_folder(Path(opts.out), opts.resume, opts.overwrite) as preemption:
        final = train(opts, preemption)
    model = final / ("merged" if (final / "merged").is_dir() else "adapter" if opts.lora else "model")
    print0(f"evaluate it:   python eval.py --model {opts.out} --task {opts.task}   (its last checkpoint: {model})")
    end_distributed()


if __name__ == "__main__":
    # a user's mistake (a flag, file, folder, data row, checkpoint): one line from rank 0, exit status 1
    run_command_line(main, "rl.py", rank0_only=True, errors=(ValueError, OSError, RunError))
