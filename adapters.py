"""PEFT's LoRA adapter folders, written and read (adapter_config.json + adapter_model.safetensors, PEFT's format and
names), so that adapters move between this code and PEFT on the official LLaDA and Dream-v0 models: save_adapter writes
one, read_adapter_config checks its adapter_config.json before any weight loads, load_adapter adds the LoRA layers
(PEFT's matching rules, add_peft_lora, on model.add_lora) and fills them. The LoRA itself is model.py's; this file imports model.py only.
"""

import json
import math
import re
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from model import LoRALinear, add_lora, atomic_folder, lora_layers, open_weights, read_json

# PEFT's on-disk names (base_model.model.<module name>.lora_A.weight): adapters move between this code and PEFT
_PEFT_PREFIX = "base_model.model."
# adapter_config.json settings that change what the adapter computes and that this code does not implement: a
# true / non-empty value is refused by name (the others, e.g. init_lora_weights, do not matter once trained)
PEFT_UNSUPPORTED = ("use_dora", "fan_in_fan_out", "modules_to_save", "layer_replication", "lora_bias",
                    "target_parameters", "exclude_modules", "trainable_token_indices", "megatron_config",
                    "use_qalora", "alora_invocation_tokens")


ADAPTER_BASE = "adapter_base.json"  # save_adapter's record of the base the adapter was trained on


# PEFT's adapter_config.json fields besides r, alpha, dropout and target_modules that this code computes
PEFT_OPTIONS = ("rank_pattern", "alpha_pattern", "use_rslora", "layers_to_transform", "layers_pattern")


def peft_target_names(model, targets, layers_to_transform=None, layers_pattern=None, checkpoint_names_only=False):
    """The names of the linear layers an adapter goes on, matched as PEFT matches them: `targets` a string is a
    regex matching a module's whole name; a list is model.lora_target_names' rule. layers_to_transform (int or list)
    keeps the matches whose name holds "<layers_pattern>.<index>." (any "<word>.<index>." without a pattern) with
    that index: never the head. A module answers to our name and to its checkpoint's, or with checkpoint_names_only
    to the checkpoint's alone, as PEFT on the official model matches."""
    aliases = {n: {model.config.checkpoint_name(n)} | (set() if checkpoint_names_only else {n})
               for n, m in model.named_modules() if isinstance(m, (nn.Linear, LoRALinear))}
    if isinstance(targets, str):
        return [n for n, names in aliases.items() if any(re.fullmatch(targets, a) for a in names)]
    chosen = [n for n, names in aliases.items()
              if any(a in targets or any(a.endswith("." + t) for t in targets) for a in names)]
    if layers_to_transform is None or layers_to_transform == []:
        return chosen
    wanted = [layers_to_transform] if isinstance(layers_to_transform, int) else list(layers_to_transform)
    patterns = [layers_pattern] if isinstance(layers_pattern, str) else list(layers_pattern or [])
    kept = []
    for n in chosen:
        found = ([re.match(rf".*\.{pat}\.(\d+)\.", a) for pat in patterns for a in aliases[n]] if patterns
                 else [re.match(r".*\.[^.]*\.(\d+)\.", a) for a in aliases[n]])
        index = next((int(f.group(1)) for f in found if f), None)
        if index is not None and index in wanted:
            kept.append(n)
    return kept


def peft_pattern(model, patterns, name, default):
    r"""PEFT's rank_pattern / alpha_pattern for module `name`: the value of the key equal to its checkpoint name, else
    of the first key that matches its end as a regex ("(.*\.)?key$"); else the same for our name; else `default`."""
    patterns = patterns or {}
    for n in (name, model.config.checkpoint_name(name)):  # the checkpoint's name, tried last, wins
        default = patterns[n] if n in patterns else next(
            (v for k, v in patterns.items() if re.match(rf"(.*\.)?{k}$", n)), default)
    return default


def add_peft_lora(model, r, alpha, dropout, targets, generator=None, **peft):
    """model.add_lora with PEFT's matching and options (PEFT_OPTIONS, as adapter_config.json names them):
    rank_pattern / alpha_pattern give some modules their own rank / alpha (a key may use our name or the
    checkpoint's), use_rslora scales by alpha / sqrt(r), layers_to_transform / layers_pattern restrict the blocks.
    model.lora_config keeps them, so that save_adapter writes the targets as given."""
    if unknown := set(peft) - set(PEFT_OPTIONS):
        raise TypeError(f"add_peft_lora: unknown options {sorted(unknown)}; PEFT's are {PEFT_OPTIONS}")
    which, pattern = peft.get("layers_to_transform"), peft.get("layers_pattern")
    names = peft_target_names(model, targets, which, pattern)
    if not names:
        raise ValueError(f"LoRA targets {targets!r} (layers {which!r}) match no linear layer of the model")
    add_lora(model, r, alpha, dropout, names, generator, use_rslora=bool(peft.get("use_rslora")),
             ranks={n: peft_pattern(model, peft.get("rank_pattern"), n, r) for n in names},
             alphas={n: peft_pattern(model, peft.get("alpha_pattern"), n, alpha) for n in names})
    model.lora_config |= dict(targets=targets, layers_to_transform=which, layers_pattern=pattern)
    return model


def save_adapter(model, path, base_model_name_or_path="", state=None, base_fingerprint="", base_files=None):
    """adapter_config.json + adapter_model.safetensors in PEFT's LoRA format, written atomically, in the
    checkpoint's module names (Dream's for Dream): the targets as given when PEFT on the official model matches them
    to the same modules (the paper's q_proj, k_proj, v_proj always do), else the adapted modules' full names; and
    the modules whose rank or alpha differ from the run's in rank_pattern / alpha_pattern under their full names.
    state: as in model.merged_state_dict. base_fingerprint: the base folder's (longjob.folder_fingerprint), kept in
    ADAPTER_BASE beside them (PEFT reads neither more nor less), so the adapter, copied anywhere, names its base; with
    base_files, its fingerprint file by file (longjob.file_fingerprints: what longjob.check_adapter compares)."""
    if not (layers := lora_layers(model)):
        raise ValueError("the model has no LoRA adapters to save")
    cfg, name_of = model.lora_config, model.config.checkpoint_name
    state = dict(model.named_parameters()) if state is None else state
    tensors = {f"{_PEFT_PREFIX}{name_of(name)}.lora_{ab}.weight": state[f"{name}.lora_{ab}"].detach().contiguous().cpu()
               for name, _ in layers for ab in "AB"}  # lora_A (r, in), lora_B (out, r)
    targets, which, pattern = cfg["targets"], cfg.get("layers_to_transform"), cfg.get("layers_pattern")
    if peft_target_names(model, targets, which, pattern, checkpoint_names_only=True) != [n for n, _ in layers]:
        targets, which, pattern = [name_of(n) for n, _ in layers], None, None  # e.g. our "attn_out" on Dream
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg["r"], "lora_alpha": cfg["alpha"],
        "lora_dropout": cfg["dropout"], "bias": "none",
        "target_modules": targets if isinstance(targets, str) else list(targets),
        "layers_to_transform": which, "layers_pattern": pattern,
        "rank_pattern": {name_of(name): m.r for name, m in layers if m.r != cfg["r"]},
        "alpha_pattern": {name_of(name): m.alpha for name, m in layers if m.alpha != cfg["alpha"]},
        "fan_in_fan_out": False, "use_rslora": cfg.get("use_rslora", False), "use_dora": False,
        "inference_mode": True, "base_model_name_or_path": str(base_model_name_or_path),
    }
    with atomic_folder(path) as tmp:
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        if base_fingerprint:  # not in the safetensors metadata: two keys there are written in a random order
            record = {"base_fingerprint": base_fingerprint} | ({"base_files": base_files} if base_files else {})
            (tmp / ADAPTER_BASE).write_text(json.dumps(record) + "\n")


def read_adapter_config(path):
    """An adapter folder's adapter_config.json, checked before any weight loads: a ValueError in one line naming the
    file and the field for what PEFT would reject or this code cannot compute. Returns the dict."""
    cfg_file = Path(path) / "adapter_config.json"
    if not cfg_file.is_file():  # the command lines say what the folder is instead (longjob.adapter_problem)
        raise FileNotFoundError(f"{path}: no adapter_config.json (a LoRA adapter folder holds adapter_config.json and "
                                "adapter_model.safetensors)")
    cfg = read_json(cfg_file)

    def number(value, whole):  # json gives bool for true / false, which is an int to Python
        kinds = int if whole else (int, float)
        return isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value) and value > 0

    def refuse(field, value, what):
        raise ValueError(f"{cfg_file}: field {field!r} = {json.dumps(value)}: expected {what}")

    checks = {"r": (True, "a whole number >= 1 (the rank)"), "lora_alpha": (False, "a finite number > 0")}
    for field, (whole, what) in checks.items():
        if field not in cfg:
            raise ValueError(f"{cfg_file}: no field {field!r} ({what})")
        if not number(cfg[field], whole):
            refuse(field, cfg[field], what)
    for field, base in (("rank_pattern", "r"), ("alpha_pattern", "lora_alpha")):
        patterns = cfg.get(field) or {}
        if not isinstance(patterns, dict):
            refuse(field, patterns, "an object of module name: value")
        for key, value in patterns.items():
            if not number(value, checks[base][0]):
                refuse(f"{field}[{key!r}]", value, f"as {base}, {checks[base][1]}")
    targets = cfg.get("target_modules")
    if not (isinstance(targets, str) and targets or isinstance(targets, list) and targets
            and all(isinstance(t, str) and t for t in targets)):
        refuse("target_modules", targets, "a non-empty list of module names, or a regex string")
    dropout = cfg.get("lora_dropout", 0.0)
    if not (isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and 0 <= dropout < 1):
        refuse("lora_dropout", dropout, "a probability in [0, 1)")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{cfg_file}: peft_type = {cfg['peft_type']!r} is not supported (only LORA)")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{cfg_file}: bias = {cfg['bias']!r} is not supported (need 'none')")
    for key in PEFT_UNSUPPORTED:
        if cfg.get(key):
            raise ValueError(f"{cfg_file}: {key} = {cfg[key]!r} is not supported by this implementation")
    return cfg


def load_adapter(model, path):
    """Load a PEFT LoRA adapter (ours or PEFT's) into `model`, adding the LoRA layers (add_peft_lora) if it has none;
    adapter_config.json checked first (read_adapter_config)."""
    path = Path(path)
    cfg = read_adapter_config(path)
    if not lora_layers(model):
        add_peft_lora(model, cfg["r"], cfg["lora_alpha"], cfg.get("lora_dropout", 0.0), cfg["target_modules"],
                      **{k: cfg.get(k) for k in PEFT_OPTIONS})
    with open_weights(path / "adapter_model.safetensors") as f:
        # PEFT sometimes writes the adapter name into the key ("lora_A.default.weight"); accept both
        tensors = {k.replace(".default.weight", ".weight"): f.get_tensor(k) for k in f.keys()}
    expected = {f"{_PEFT_PREFIX}{model.config.checkpoint_name(name)}.lora_{ab}.weight": getattr(m, f"lora_{ab}")
                for name, m in lora_layers(model) for ab in "AB"}
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path / 'adapter_model.safetensors'}: missing {missing} unexpected {unexpected} "
                         f"(targets {cfg['target_modules']!r} as PEFT matches them)")
    with torch.no_grad():
        for k, p in expected.items():
            if tuple(tensors[k].shape) != tuple(p.shape):
                raise ValueError(f"{path}: {k} has shape {tuple(tensors[k].shape)}, the model wants {tuple(p.shape)} "
                                 "(rank from r and rank_pattern)")
            p.copy_(tensors[k])
    return model
