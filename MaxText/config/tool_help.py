"""`--help` / `-h` for every entry point: its usage line and the config keys it reads, by group.

Each key is shown with its type, default, range and doc from `key_docs()` (base.yml's comments and
`Config`'s fields: the same source as docs/reference/config.md). Words after the flag keep only
the keys whose name or doc contains every word: `python train.py --help pipeline`.

`TOOLS` says which keys each tool reads: the groups of base.yml it reads (`groups`, or every
group but `skip_groups`), plus single `keys`, minus `skip_keys`. A tool's entry point calls
`requested(argv)` before parsing anything else and, when it returns words, prints
`help_text(tool, words)` and exits 0; every other argument is parsed as before.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Sequence

from MaxText.config.key_docs import KeyDoc, group_id, key_docs

HELP_FLAGS = ("-h", "--help")
WIDTH = 100


@dataclasses.dataclass(frozen=True)
class Tool:
    usage: tuple[str, ...]  # the usage lines, each a whole command
    about: str  # what the tool does, one sentence
    groups: tuple[str, ...] | None = None  # group ids read whole; None: every group ...
    skip_groups: tuple[str, ...] = ()  # ... but these
    keys: tuple[str, ...] = ()  # keys read outside those groups
    skip_keys: tuple[str, ...] = ()  # keys of those groups it does not read
    keys_title: str = "config keys it reads"
    hint: str = ""  # what to say before the keys; "" -> how keys are set and filtered


_TRAINER_ONLY = (
    "log_period",
    "eval_interval",
    "eval_steps",
    "enable_tensorboard",
    "enable_progress_bar",
    "profiler",
    "profiler_steps",
    "skip_first_n_steps_for_profiler",
    "metrics_file",
    "debug_tracebacks",
)
_TRAIN = Tool(
    usage=(
        "python train.py configs/base.yml [key=value ...]",
        "python -m MaxText.train configs/base.yml [key=value ...]",
    ),
    about="Trains a decoder LLM (pipelined with pipeline_parallelism > 1); resumes a run by its "
    "run_name.",
    skip_groups=("generation", "hugging face checkpoints"),
)
TOOLS: dict[str, Tool] = {
    "train": _TRAIN,
    "MaxText.train": _TRAIN,
    "MaxText.generate": Tool(
        usage=(
            "python -m MaxText.generate configs/base.yml run_name=RUN [prompt=TEXT] "
            "[key=value ...]",
            "python -m MaxText.generate configs/base.yml load_parameters_path=CKPT [key=value ...]",
        ),
        about="Prints a sample from a run's newest checkpoint (model keys from the checkpoint; "
        "parallelism keys are ignored: one device).",
        groups=("run identity and outputs", "model shape", "generation"),
        keys=(
            "load_parameters_path",
            "max_target_length",
            "seed",
            "dataset_type",
            "dataset_path",
            "dataset_name",
            "tokenizer_path",
            "tokenizer_type",
            "add_bos",
            "attention",
            "attention_block_size",
            "hardware",
            "allow_cpu_fallback",
        ),
        skip_keys=("remat_policy", "scan_layers"),
    ),
    "MaxText.plan": Tool(
        usage=(
            "python -m MaxText.plan configs/base.yml [key=value ...] [--hardware NAME] "
            "[--json FILE] [...]",
        ),
        about="Plans a run before launch: memory per pipeline group and device, predicted step "
        "time, and the `auto` keys decided as the trainer decides them.",
        skip_groups=("generation", "hugging face checkpoints", "checkpoints", "data"),
        keys=("load_parameters_path", "dataset_type", "packing"),
        skip_keys=_TRAINER_ONLY,
    ),
    "MaxText.launch": Tool(
        usage=(
            "python -m MaxText.launch --num_processes N [--timeout S] -- configs/base.yml "
            "[key=value ...]",
        ),
        about="Starts N trainer processes on this host (127.0.0.1, a free port) for development; "
        "everything after `--` goes to train.py (its keys: python train.py --help).",
        groups=(),
        keys=("coordinator_address", "num_processes", "process_id"),
        keys_title="config keys it sets for each trainer",
    ),
    "MaxText.to_maxtext": Tool(
        usage=(
            "python -m MaxText.to_maxtext configs/base.yml hf_model_path=DIR "
            "base_output_directory=OUT [model_name=PRESET] [weight_dtype=float32|bfloat16]",
        ),
        about="Converts a Hugging Face Llama folder into a parameters checkpoint OUT/0/items for "
        "load_parameters_path.",
        groups=(),
        keys=("hf_model_path", "base_output_directory", "model_name", "weight_dtype"),
    ),
    "MaxText.to_huggingface": Tool(
        usage=(
            "python -m MaxText.to_huggingface configs/base.yml load_parameters_path=CKPT "
            "hf_output_path=DIR [key=value ...]",
            "python -m MaxText.to_huggingface configs/base.yml run_name=RUN hf_output_path=DIR "
            "[key=value ...]",
        ),
        about="Exports a checkpoint as a Hugging Face Llama folder (config.json, safetensors, "
        "tokenizer).",
        groups=(),
        keys=(
            "load_parameters_path",
            "run_name",
            "base_output_directory",
            "hf_output_path",
            "hf_output_dtype",
            "hf_max_shard_mb",
        ),
    ),
    "MaxText.data.prepare": Tool(
        usage=("python -m MaxText.data.prepare --input FILES --out DIR [...]",),
        about="Prepares a corpus into ArrayRecord shards.",
        groups=(),
        keys=(
            "dataset_type",
            "grain_train_files",
            "grain_eval_files",
            "grain_worker_count",
            "packing",
            "add_bos",
            "add_eos",
        ),
        keys_title="config keys that train on what it writes",
        hint="Then train on the shards: python train.py configs/base.yml dataset_type=grain "
        "grain_train_files='OUT/train-*.array_record' [grain_eval_files='OUT/eval-*.array_record'] "
        "(`python train.py --help grain` lists the grain keys).",
    ),
}


def requested(argv: Sequence[str]) -> list[str] | None:
    """The filter words when `argv` asks for help (`-h`/`--help` before any `--`), else None.
    The words are the plain tokens after the flag (not `key=value`, a YAML file or a flag)."""
    args = list(argv[: list(argv).index("--")] if "--" in argv else argv)
    flags = [i for i, a in enumerate(args) if a in HELP_FLAGS]
    if not flags:
        return None
    after = args[flags[0] + 1 :]
    return [
        a
        for a in after
        if a not in HELP_FLAGS
        and not a.startswith("-")
        and "=" not in a
        and not a.endswith((".yml", ".yaml"))
    ]


def tool_keys(tool: Tool) -> list[KeyDoc]:
    """The keys `tool` reads, in base.yml's order."""
    keys = []
    for k in key_docs():
        gid = group_id(k.group)
        in_group = (tool.groups is None and gid not in tool.skip_groups) or (
            tool.groups is not None and gid in tool.groups
        )
        if (in_group and k.name not in tool.skip_keys) or k.name in tool.keys:
            keys.append(k)
    return keys


def check_tools() -> list[str]:
    """Names in `TOOLS` that base.yml no longer has (a renamed group or key): [] when sound."""
    groups = {group_id(k.group) for k in key_docs()}
    names = {k.name for k in key_docs()}
    problems = []
    for name, tool in TOOLS.items():
        for g in (*(tool.groups or ()), *tool.skip_groups):
            if g not in groups:
                problems.append(f"{name}: no group '{g}' in base.yml")
        for key in (*tool.keys, *tool.skip_keys):
            if key not in names:
                problems.append(f"{name}: no key '{key}' in base.yml")
    return problems


def describe_key(k: KeyDoc) -> str:
    """Two or more lines: `name: type = default  [range]` (and the preset's value), then the doc."""
    head = f"  {k.name}: {k.type} = {k.default}"
    if k.range:
        head += f"  [{k.range}]"
    if k.presets:
        tiny = f"; model_name=tiny sets {k.preset_default}" if k.preset_default else ""
        head += f"  (set by {len(k.presets)} model presets{tiny})"
    doc = textwrap.fill(k.doc, WIDTH, initial_indent="      ", subsequent_indent="      ")
    return f"{head}\n{doc}"


def keys_text(tool: Tool, words: Sequence[str] = ()) -> str:
    """The tool's keys (those matching every word), under their base.yml group titles."""
    keys = [k for k in tool_keys(tool) if all(k.matches(w) for w in words)]
    if not keys:
        return f"no {tool.keys_title.replace('config keys', 'config key')} matches " + " ".join(
            repr(w) for w in words
        )
    blocks, group = [], None
    for k in keys:
        if k.group != group:
            group = k.group
            blocks.append(f"\n{group}:")
        blocks.append(describe_key(k))
    title = tool.keys_title + (f" (matching {' '.join(words)})" if words else "")
    return f"{title}:\n" + "\n".join(blocks)


def usage(name: str) -> str:
    """The tool's usage lines, as argparse's `usage=` wants them (without "usage: ")."""
    return "\n       ".join(TOOLS[name].usage)


def help_text(name: str, words: Sequence[str] = (), parser_help: str = "") -> str:
    """The whole help of tool `name`: usage and what it does (or `parser_help`, argparse's help
    of a tool with flags, which carries both), then the config keys."""
    tool = TOOLS[name]
    head = parser_help.rstrip() or f"usage: {usage(name)}\n\n{textwrap.fill(tool.about, WIDTH)}"
    command = tool.usage[0].split(" configs/")[0].split(" --")[0]
    hint = tool.hint or (
        f"Keys are set as key=value after the YAML file. `{command} --help WORD` shows only the "
        "keys whose name or doc contains WORD; every key: docs/reference/config.md."
    )
    return f"{head}\n\n{textwrap.fill(hint, WIDTH)}\n\n{keys_text(tool, words)}\n"


def show(name: str, words: Sequence[str], parser_help: str = "") -> int:
    """Prints the help of tool `name` on stdout; returns the exit code (0)."""
    print(help_text(name, words, parser_help), end="", flush=True)
    return 0
