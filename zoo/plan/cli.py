"""``launch/plan.py``: which layout to launch, before a GPU is rented.

    python launch/plan.py --model llama-7b --gpu h100 --gpus 64 --seq-length 4096 --global-batch 512
    python launch/plan.py --set hidden_size=12288 num_hidden_layers=96 num_attention_heads=96 vocab_size=51200 \\
        max_position_embeddings=2048 --gpu a100-80g --gpus 1024 --seq-length 2048 --global-batch 1536
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from zoo.flags import Parser
from zoo.plan.estimate import ATTENTION, DTYPE_BYTES, OPTIMIZER_STATE_BYTES, Job
from zoo.plan.hardware import GPUS, HardwareError, get_gpu, load_cluster
from zoo.plan.search import PlanError, best, explain_selective, parse_only, plan


def model_field_hints() -> dict[str, str]:
    """A flag that names a GPT config field (Megatron's --hidden-size, --num-attention-heads): the --set to write."""
    from dataclasses import fields

    from zoo.models.gpt import GPTConfig

    hints = {"--" + f.name.replace("_", "-"): f"--set {f.name}={{value}}" for f in fields(GPTConfig)}
    return {**hints, "--num-layers": "--set num_hidden_layers={value}", "--ffn-hidden-size":
            "--set intermediate_size={value}"}


def parse_args(argv=None):
    p = Parser(prog="launch/plan.py", hints=model_field_hints, description="Predict memory and speed of every parallel "
                                "layout of a GPT model on a cluster, ranked by predicted throughput.")
    p.add_argument("--model", help="a zoo GPT preset (tiny, gpt2-124m, llama-7b, mistral-7b, ...), or a zoo or "
                                   "HuggingFace model folder (its config.json); default: GPTConfig's defaults")
    p.add_argument("--set", nargs="+", default=[], metavar="FIELD=VALUE",
                   help="model config fields over --model (e.g. hidden_size=12288 num_hidden_layers=96)")
    p.add_argument("--gpu", default="a100-80g", help=f"GPU type: {', '.join(GPUS)} (default a100-80g)")
    p.add_argument("--cluster", metavar="YAML", help="a GPU/cluster description instead of --gpu: base (a known GPU) "
                   "and any of peak_tflops, memory_gb, hbm_gbps, gpus_per_node, intra_node_gbps, inter_node_gbps")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--seq-length", type=int, help="tokens per sequence (default: 2048, or the model's "
                   "max_position_embeddings if shorter)")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPE_BYTES))
    p.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZER_STATE_BYTES))
    p.add_argument("--attention", default="flash", choices=list(ATTENTION),
                   help="flash: zoo's SDPA (no s x s scores stored); unfused: scores stored and streamed, as "
                        "Megatron-LM ran in 2021 (what its published figures measured)")
    p.add_argument("--fused-cross-entropy", action="store_true",
                   help="price the LM head and the loss fused (training.fused_cross_entropy: no [tokens, vocab] logits "
                        "kept, in every layout); --write-config sets it")
    p.add_argument("--ema-decay", type=float, default=0.0, metavar="D",
                   help="price a weight average (training.ema_decay D: 4 bytes per parameter a rank holds, at ZeRO-3 "
                        "per parameter of its partitions); --write-config sets it")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="price a LoRA fine-tune of rank R (finetune.lora.r R on qkv, dense, fc1, fc2: the base frozen, "
                        "gradients and optimizer state for the adapters only); --write-config sets it")
    p.add_argument("--only", metavar="FIELDS", help="evaluate only layouts with these values, e.g. "
                   "tp=8,pp=35,micro_batch=1,recompute=full,sp=true,zero=1 (unnamed fields take their best value)")
    p.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    p.add_argument("--why-not", action="store_true", help="also list the fastest layouts that do not fit, and why")
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    p.add_argument("--write-config", metavar="FILE", help="write the best layout as a launch/train.py run config")
    p.add_argument("--allow-cross-node-tp", action="store_true", help="also try tp larger than a node")
    return p.parse_args(argv)


def _value(text: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def model_config(name: str | None, sets: list[str]):
    """``(GPTConfig, preset name or None)`` from a preset, a zoo/HF folder or GPTConfig's defaults, plus --set."""
    from zoo.models.gpt import FAMILY, PRESETS, GPTConfig

    overrides = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise PlanError(f"--set {item!r} is not FIELD=VALUE (e.g. --set hidden_size=4096)")
        overrides[key.strip()] = _value(value)
    try:
        if name is None:
            return GPTConfig.from_dict(overrides), None
        if name in PRESETS:
            return GPTConfig.from_preset(name, **overrides), name
        folder = Path(name).expanduser()
        if not (folder / "config.json").is_file():
            raise PlanError(f"--model {name!r} is neither a zoo GPT preset ({', '.join(sorted(PRESETS))}) nor a "
                            f"folder with a config.json")
        meta = json.loads((folder / "config.json").read_text())
        if "zoo_format" in meta:
            if meta.get("family") != FAMILY:
                raise PlanError(f"{folder} holds a {meta.get('family')} model; the planner prices GPT models")
            return GPTConfig.from_dict({**meta["config"], **overrides}), None
        from zoo.convert.gpt import gpt_config_from_hf, read_hf_config

        arch, hf = read_hf_config(folder)
        return GPTConfig.from_dict({**gpt_config_from_hf(arch, hf).to_dict(), **overrides}), None
    except PlanError:
        raise
    except (TypeError, ValueError, OSError) as e:
        raise PlanError(f"model: {str(e).splitlines()[0]}") from None


def _gb(x: float) -> str:
    return f"{x / 2**30:.1f}"


def table(rows, top: int) -> str:
    head = (f"{'#':>3} {'tp':>3} {'pp':>3} {'dp':>5} {'ep':>3} {'cp':>3} {'zero':>4} {'mb':>3} {'sp':>3} "
            f"{'recomp':>9} | {'GiB/GPU':>7} {'param':>6} {'grad':>6} {'optim':>6} {'activ':>6} {'buf':>5} | "
            f"{'step s':>7} {'comp':>6} {'comm':>6} {'bubble':>6} | {'tokens/s':>10} {'TFLOP/s':>7} {'MFU':>5}")
    lines = [head, "-" * len(head)]
    for n, e in enumerate(rows[:top], 1):
        lay, m, t = e.layout, e.memory, e.time
        ep = f"{lay.ep}*" if lay.ep_spans_tp else str(lay.ep)
        lines.append(f"{n:>3} {lay.tp:>3} {lay.pp:>3} {lay.dp:>5} {ep:>3} {lay.cp:>3} {lay.zero:>4} "
                     f"{lay.micro_batch:>3} {'y' if lay.sp else 'n':>3} {lay.recompute:>9} | "
                     f"{e.memory_per_gpu_gb:>7.1f} {_gb(m['params']):>6} {_gb(m['grads']):>6} {_gb(m['optimizer']):>6} "
                     f"{_gb(m['activations']):>6} {_gb(m['buffers'] + m['reserved']):>5} | {e.step_time_s:>7.3f} "
                     f"{t['compute']:>6.3f} {t['communication']:>6.3f} {t['bubble']:>6.3f} | "
                     f"{e.tokens_per_s:>10.0f} {e.tflops_per_gpu:>7.1f} {e.mfu:>5.1%}")
    if any(e.layout.ep_spans_tp for e in rows[:top]):
        lines.append("ep*: the expert-parallel groups span the TP ranks (parallel.ep_spans_tp)")
    return "\n".join(lines)


def run_config(e, job: Job, preset: str | None, gpus_per_node: int = 8, ema_decay: float = 0.0) -> str:
    """The run config YAML for launch/train.py that trains this job in this layout (``ema_decay``: the weight
    average's decay, when ``job.ema``)."""
    import yaml

    from zoo.models.gpt import FAMILY, GPTConfig

    lay = e.layout
    n = -(-job.gpus // gpus_per_node)
    nodes = f"--hostfile HOSTS --num_nodes {n} " if n > 1 else ""
    model = {"family": FAMILY, "preset": preset}  # and the model fields that differ from the preset's
    if preset is None:
        model.update(job.config.to_dict())
    else:
        base = GPTConfig.from_preset(preset).to_dict()
        model.update({k: v for k, v in job.config.to_dict().items() if base.get(k) != v})
    cfg = {"model": model,
           "parallel": {"tp": lay.tp, "pp": lay.pp, "ep": lay.ep, **({"ep_spans_tp": True} if lay.ep_spans_tp else {}),
                        "cp": lay.cp, "zero_stage": lay.zero,
                        "sequence_parallel": lay.sp, "activation_checkpointing": lay.recompute == "full"},
           "training": {"micro_batch_size": lay.micro_batch, "global_batch_size": job.global_batch,
                        "seq_length": job.seq_length, "precision": job.dtype, "fused_cross_entropy": lay.fused_ce,
                        **({"ema_decay": ema_decay} if ema_decay else {})}}
    if job.lora is not None:
        cfg["finetune"] = {"lora": job.lora.to_dict()}
    note = (f"# Written by launch/plan.py: the predicted fastest layout of {job.gpus} GPUs "
            f"({e.tokens_per_s:.0f} tokens/s, {e.memory_per_gpu_gb:.1f} GiB per GPU).\n"
            f"# deepspeed {nodes}--num_gpus {min(job.gpus, gpus_per_node)} launch/train.py --config THIS_FILE   (or "
            f"torchrun with {job.gpus} processes in all)\n"
            f"# Data: set data.source / data.paths for your corpus (default: the embedded one).\n")
    return note + yaml.safe_dump(cfg, sort_keys=False)


def lora_of(r: int):
    """``--lora R``: the adapters a LoRA run of rank R trains (zoo.models.lora.LoraConfig, alpha 2R), or None."""
    if r == 0:
        return None
    if r < 0:
        raise PlanError(f"--lora must be a positive rank (0: full fine-tuning), got {r}")
    from zoo.models.lora import LoraConfig

    return LoraConfig(r=r, alpha=2.0 * r)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        gpu = load_cluster(args.cluster) if args.cluster else get_gpu(args.gpu)
        config, preset = model_config(args.model, args.set)
        seq = args.seq_length or min(2048, config.max_position_embeddings)
        job = Job(config=config, gpus=args.gpus, seq_length=seq, global_batch=args.global_batch,
                  dtype=args.dtype, optimizer=args.optimizer, attention=args.attention,
                  fused_cross_entropy=args.fused_cross_entropy, ema=args.ema_decay > 0, lora=lora_of(args.lora))
        if not 0 <= args.ema_decay < 1:
            raise PlanError(f"--ema-decay must be in [0, 1) (0: no average), got {args.ema_decay}")
        fixed = parse_only(args.only) if args.only else None
        if fixed:
            explain_selective(job, fixed)
        rows = plan(job, gpu, fixed, allow_cross_node_tp=args.allow_cross_node_tp)
        winner = best(rows, job, gpu)
    except (PlanError, HardwareError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fitting = [e for e in rows if e.fits]
    if args.json:
        shown = fitting[:args.top] + ([e for e in rows if not e.fits][:args.top] if args.why_not else [])
        print(json.dumps([e.row() for e in shown], indent=1))
    else:
        c = job.config
        print(f"{c.num_parameters() / 1e9:.3f}B parameters (h={c.hidden_size}, layers={c.num_hidden_layers}, "
              f"heads={c.num_attention_heads}/{c.num_key_value_heads}, vocab={c.vocab_size}) on {job.gpus} x "
              f"{gpu.name}, {job.global_batch} x {job.seq_length} tokens per step, {job.dtype}, {job.optimizer}, "
              f"{job.attention} attention{', fused LM head + loss' if job.fused_cross_entropy else ''}: "
              f"{len(fitting)} of {len(rows)} layouts fit")
        print(table(fitting, args.top))
        if args.why_not:
            misses = [e for e in rows if not e.fits]
            print(f"\n{len(misses)} layouts do not fit; the fastest of them:")
            for e in misses[:args.top]:
                print(f"  {e.layout.describe()}: {e.why_not}")
    if args.write_config:
        Path(args.write_config).write_text(run_config(winner, job, preset, gpu.gpus_per_node, args.ema_decay))
        if not args.json:
            print(f"\nwrote {args.write_config}: {winner.layout.describe()}")
    return 0
