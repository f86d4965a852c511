"""Supervised fine-tuning of a GPT on instruction data, in any layout; the result as a zoo folder and a HF folder.

    python launch/finetune.py --init runs/gpt-tiny/model --data instruct.jsonl
    torchrun --nproc_per_node 2 launch/finetune.py --init HF_FOLDER_OR_HUB_ID --data train.jsonl \\
        --valid-data valid.jsonl --tp 2 --out runs/sft

The run is launch/train.py's (``zoo.training.trainer.Trainer``: tp/pp/dp/ZeRO, evaluation, checkpoints, exact resume)
with three differences: the weights and the model config come from ``--init`` (a zoo model folder, or a HF folder
or Hub id converted on the fly), the samples are ``zoo.data.instruct``'s (one example per sample, loss on the
response tokens only), and the result is written twice: ``<out>/model`` (zoo, layout-free) and ``<out>/hf``
(``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load it), mixture-of-experts models included. Both are
written also with ``training.save=false``, which turns off the DeepSpeed checkpoints only. Everything about the input is
checked before any process group exists; each problem is one ``error: ...`` line and exit status 2, and nothing is
written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from zoo.data.instruct import InstructData, InstructError, load_instruct_data
from zoo.finetune.common import add_finetune_flags, run_config
from zoo.models.gpt import FAMILY
from zoo.package import config_file
from zoo.training.config import ConfigError, RunConfig, lora_config, validate
from zoo.training.run import RunParser, command, layout_line, loss_change, process_group, say, start_run, train_and_save
from zoo.training.train import resume_plan
from zoo.training.trainer import Trainer

DEFAULT_CONFIG = config_file("gpt/finetune.yaml")
GENERATION_CONFIG = "generation_config.json"


def parse_args(argv=None):
    p = RunParser("launch/finetune.py", "Fine-tune a GPT on instruction data (loss on the responses only).",
                  "Writes OUT/model (zoo) and OUT/hf (transformers).")
    p.add_argument("--init", required=True, metavar="SRC",
                   help="the model to fine-tune: a zoo model folder (launch/convert.py hf-to-zoo, or a run's model/), "
                        "or a HuggingFace folder / Hub id; its tokenizer is used unless --set data.tokenizer=DIR")
    p.add_argument("--data", required=True, metavar="FILE.jsonl",
                   help='one example per line: {"prompt": ..., "response": ...} or {"messages": [{"role": ..., '
                        '"content": ...}, ...]} (rendered with the tokenizer\'s chat template when it has one, else '
                        'as "<role>: <content>" lines); see zoo/data/instruct.py')
    p.add_argument("--valid-data", metavar="FILE.jsonl", help="validation examples (default: hold out a fraction "
                                                              "of --data, see --valid-fraction)")
    p.add_argument("--valid-fraction", type=float, metavar="F",
                   help="without --valid-data: hold out this fraction of --data for validation (0: none)")
    p.add_argument("--adapter", metavar="DIR",
                   help="go on training this adapter on --init (its base): a PEFT adapter folder or a zoo folder "
                        "with adapters; its settings become finetune.lora")
    add_finetune_flags(p, DEFAULT_CONFIG, evaluation="validation loss",
                       sample="skip the sample completion printed at the end")
    return p.parse_args(argv)


def config_from_args(args) -> RunConfig:
    cfg = run_config(args, "instruct", [args.data], valid_paths=None if args.valid_data is None else [args.valid_data],
                     valid_fraction=args.valid_fraction)
    if getattr(args, "adapter", None) is not None:
        cfg.finetune.adapter = args.adapter  # as given (a path), not through --set's YAML parsing
    return cfg


def validate_run(cfg: RunConfig, world_size: int):
    """``config.validate`` plus what fine-tuning needs: a tokenizer. Returns the model config (from ``--init``)."""
    model_cfg = validate(cfg, world_size)  # layout, batch, sequence length, tokenizer; the JSONL is read by load_data
    if cfg.model.family != FAMILY:
        raise ConfigError(f"fine-tuning is for the {FAMILY} family, got model.family {cfg.model.family!r}")
    if cfg.data.tokenizer is None:
        raise ConfigError(f"{cfg.training.init_from} holds no tokenizer (tokenizer.json or tokenizer_config.json); "
                          f"pass one with --set data.tokenizer=DIR")
    return model_cfg


def load_data(cfg: RunConfig) -> InstructData:
    """The tokenized instruction data; every rank reads it (small), before any process group."""
    from zoo.data.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(cfg.data.tokenizer)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.tokenizer: {e}") from None
    tr, data = cfg.training, cfg.data
    return load_instruct_data(data.paths[0], tokenizer, tr.seq_length, tr.seed,
                              valid_path=data.valid_paths[0] if data.valid_paths else None,
                              valid_fraction=data.valid_fraction)


def export_hf(cfg: RunConfig, model_dir: Path, tokenizer, lora=None) -> Path:
    """``<out>/hf`` from ``<out>/model``. The special ids and generation defaults come from the init model's
    generation_config.json (kept beside ``<out>/model`` too), else from the tokenizer. A LoRA run's ``model/``
    holds base and adapters: ``hf/`` is the merged model (``zoo.models.lora.merge_folder``, W + s B A)."""
    from zoo.convert.gpt import zoo_to_hf

    for folder in (Path(cfg.training.init_from), Path(cfg.out) / "init-model"):  # a zoo or HF folder; HF's import
        if (folder / GENERATION_CONFIG).is_file():
            shutil.copy2(folder / GENERATION_CONFIG, model_dir / GENERATION_CONFIG)
            break
    else:
        from transformers import GenerationConfig

        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id).save_pretrained(model_dir)
    if lora is None:
        return zoo_to_hf(model_dir, Path(cfg.out) / "hf")
    merged = merge_adapter_folder(model_dir, Path(cfg.out) / "merged-model")
    try:
        return zoo_to_hf(merged, Path(cfg.out) / "hf")
    finally:
        shutil.rmtree(merged, ignore_errors=True)


def merge_adapter_folder(src: Path, out: Path) -> Path:
    """The zoo folder ``src`` (base + adapters) as a plain zoo folder ``out``: every adapted weight merged
    (``zoo.models.lora.merged``), tensor by tensor; tokenizer and generation config copied."""
    from zoo.convert import io
    from zoo.models.lora import LoraConfig, merged_tensors

    family, config = io.read_config(src)
    lora = LoraConfig.from_dict(io.read_adapter(src))
    mapping = io.weight_map(src)
    extra = {GENERATION_CONFIG: (src / GENERATION_CONFIG).read_text()} if (src / GENERATION_CONFIG).is_file() else {}
    tensors = merged_tensors(mapping, lambda k: io.read_tensors(src / mapping[k], [k])[k], lora)
    return io.write_model_folder(out, family, config, tensors, tokenizer_dir=src, extra_files=extra)


def sample_completion(model_dir: Path, tokenizer, prompt_ids: list[int], max_new_tokens: int = 48) -> str:
    """Greedy completion of ``prompt_ids`` by the exported model, read back from disk, in this process alone."""
    from zoo.convert.io import load_model, read_adapter, read_config
    from zoo.models.generate import Generator, SamplingOptions
    from zoo.models.gpt import GPTConfig, ParallelOptions, layer_specs
    from zoo.models.lora import LoraConfig, apply_lora
    from zoo.models.specs import SpecSequential

    config = {k: v for k, v in read_config(model_dir)[1].items() if k != "lora"}
    model = SpecSequential(layer_specs(GPTConfig.from_dict(config), ParallelOptions()))
    adapter = read_adapter(model_dir)
    if adapter is not None:  # a LoRA run's model: base and adapters, applied unmerged
        apply_lora(model, LoraConfig.from_dict(adapter))
    load_model(model_dir, model)
    out = Generator(model.eval()).generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                                           sampling=SamplingOptions(greedy=True),
                                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    new = out.tokens[0, len(prompt_ids):].tolist()
    if tokenizer.eos_token_id in new:
        new = new[:new.index(tokenizer.eos_token_id)]
    return tokenizer.decode(new)


def plan(args, world_size: int) -> tuple:
    """``(run config, model config, resume, universal, instruction data)``, all checked before any process group
    exists."""
    cfg = config_from_args(args)
    model_cfg = validate_run(cfg, world_size)
    return (cfg, model_cfg, *resume_plan(cfg, model_cfg, args), load_data(cfg))


def run(args, cfg: RunConfig, model_cfg, resume, universal: bool, data: InstructData) -> int:
    from zoo.convert.gpt import ConvertError
    from zoo.data.tokenizer import load_tokenizer
    from zoo.training.families import Data

    out, tr = Path(cfg.out), cfg.training
    with process_group(cfg) as grid:
        rank0 = grid.rank == 0
        warning = None if not data.truncated else (
            f"warning: {data.truncated} example(s) longer than training.seq_length + 1 = {tr.seq_length + 1} tokens "
            f"were truncated ({data.emptied} of them lost every response token and train nothing); raise "
            f"training.seq_length to keep them whole")
        lora = lora_config(cfg)
        adapters = "" if lora is None else (f" ({'DoRA' if lora.dora else 'LoRA'} r={lora.r} on "
                                            f"{', '.join(lora.targets)}; the base frozen)")
        start_run(cfg, grid, f"zoo fine-tune of {tr.init_from}: {model_cfg.num_parameters() / 1e6:.2f}M parameters"
                             f"{adapters} | "
                             f"{layout_line(cfg, grid)} | global batch "
                             f"{cfg.global_batch_size} x {tr.seq_length} tokens | {tr.precision} | {data.summary()}",
                  warning)
        with Trainer(cfg, model_cfg, grid, Data(data.train, data.valid, cfg.data.tokenizer), log=say, resume=resume,
                     universal=universal, progress=True) as trainer:
            result = train_and_save(trainer, export=True)
        if rank0 and result.val_losses:
            say(loss_change(result.val_losses, "validation loss (response tokens)"))
    if not rank0:
        return 0
    tokenizer = load_tokenizer(out / "model")
    try:
        hf = export_hf(cfg, out / "model", tokenizer, lora)
        where = f"HF model {hf} (AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load it)"
        if lora is not None:
            where += ", the adapters merged in"
    except ConvertError as e:  # a zoo GPT variant that no transformers architecture describes
        where = f"no HF export ({e})"
    say(f"done: zoo model {out / 'model'} | {where} | metrics {out / 'metrics.jsonl'} | loss plot {out / 'loss.png'}")
    if not args.no_sample and data.sample_prompt:
        which = "validation" if data.valid is not None else "training"
        completion = sample_completion(out / "model", tokenizer, data.sample_prompt)
        say(f"sample (greedy) for the first {which} prompt: {tokenizer.decode(data.sample_prompt)!r} -> "
            f"{completion!r}")
    return 0


def main(argv=None) -> int:
    return command(parse_args(argv), plan, run, errors=(InstructError,))


COMMANDS = {FAMILY: main}  # zoo.finetune.COMMANDS
