"""A zoo GPT folder as a library and on the command line: :class:`PretrainedGPT` (one process, no process group) and
text generation in one process, or tp processes under torchrun.

    model = PretrainedGPT.from_pretrained("runs/tiny/model")    # or zoo.load_model("runs/tiny/model")
    print(model.generate("Once upon a time", max_new_tokens=64))
    python launch/generate.py --ckpt runs/tiny/model --prompt "Once upon a time" --max-new-tokens 64
    torchrun --nproc_per_node 2 launch/generate.py --tp 2 --ckpt DIR --prompt "..." --temperature 0.8 --top-p 0.9

Everything about the input (folder, family, layout, tokenizer, prompts) is checked before any process group
exists; the folder is loaded at pp=1 into the plain model and decoded by ``zoo.models.generate.Generator`` (KV cache,
greedy or sampled, any tensor-parallel size). Global rank 0 prints the continuations, and the speed on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from zoo.convert import io
from zoo.flags import Parser
from zoo.models.generate import Generator, SamplingOptions
from zoo.models.gpt import FAMILY
from zoo.models.specs import SpecSequential

DESCRIPTION = ("Text generation from a zoo GPT: a KV cache per block, greedy or sampled decoding, at any "
               "tensor-parallel size.")


def sampling_options(temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                     seed: int = 0) -> SamplingOptions:
    """Greedy unless one of ``temperature``, ``top_k``, ``top_p`` is given; then a draw seeded by ``seed``."""
    sampled = any(v is not None for v in (temperature, top_k, top_p))
    return SamplingOptions(greedy=not sampled, temperature=1.0 if temperature is None else temperature,
                           top_k=top_k or 0, top_p=1.0 if top_p is None else top_p, seed=seed)


def encode_prompts(tokenizer, prompts: list[str], config) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(ids [b, s] left-padded to the longest prompt, attention mask [b, s], pad id)``; a prompt the model cannot
    take (empty, longer than ``max_position_embeddings``, ids outside the vocabulary) is a ValueError."""
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    for text, ids in zip(prompts, encoded):
        if not ids:
            raise ValueError(f"prompt {text!r} encodes to no tokens")
        if len(ids) > config.max_position_embeddings:
            raise ValueError(f"prompt of {len(ids)} tokens is longer than the model's max_position_embeddings "
                             f"({config.max_position_embeddings})")
        if max(ids) >= config.vocab_size:
            raise ValueError(f"the tokenizer produced id {max(ids)}, outside the model's vocab_size "
                             f"{config.vocab_size}")
    eos = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    longest = max(len(ids) for ids in encoded)
    ids = torch.tensor([[pad_id] * (longest - len(x)) + x for x in encoded])  # [b, s], left-padded
    mask = torch.tensor([[0] * (longest - len(x)) + [1] * len(x) for x in encoded])
    return ids, mask, pad_id


def continuation(tokenizer, new_tokens: torch.Tensor) -> str:
    """The text of one row of new tokens, up to the first eos."""
    new, eos = new_tokens.tolist(), tokenizer.eos_token_id
    return tokenizer.decode(new[: new.index(eos)] if eos is not None and eos in new else new)


def apply_folder_adapters(folder: Path, model) -> dict | None:
    """A LoRA run's folder (``"lora"`` in config.json: the base and its adapters): the adapters added to ``model``
    (``zoo.models.lora.apply_lora``) before its tensors load, so it computes the adapted model; returns the settings
    (None: a plain folder)."""
    adapter = io.read_adapter(folder)
    if adapter is not None:
        from zoo.models.lora import LoraConfig, apply_lora

        apply_lora(model, LoraConfig.from_dict(adapter))
    return adapter


class PretrainedGPT(SpecSequential):
    """A zoo GPT folder (GPT-2 or Llama style, dense or mixture-of-experts) as one plain torch module in one process:
    tp=1, every expert local, no process group, no DeepSpeed engine; the same layers and names as in training.

    ``model(ids [b, s]) -> logits [b, s, vocab_size]`` (the vocabulary padding cut off), :meth:`loss` for training
    steps with any torch optimizer, :meth:`generate` for text, :meth:`save_pretrained` to write a zoo folder back
    (what ``--init``, ``launch/generate.py`` and ``launch/convert.py`` read). Build it in a process without a
    tensor-parallel grid (``zoo.parallel.topology``): under one its layers would take their shards of it.
    """

    family = FAMILY

    def __init__(self, config, tokenizer=None, tokenizer_dir=None):
        from zoo.models.gpt import ParallelOptions, layer_specs

        super().__init__(layer_specs(config, ParallelOptions()))
        self.config, self.tokenizer, self.tokenizer_dir = config, tokenizer, tokenizer_dir
        self.lora: dict | None = None  # a LoRA run's folder: its adapters' settings (applied, not merged)

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, *, device=None,
                        dtype: torch.dtype = torch.float32) -> PretrainedGPT:
        """Load a zoo GPT folder (or a run folder with ``model/``) on ``device`` (default CPU), in eval mode, with the
        folder's tokenizer as ``.tokenizer`` (None without tokenizer files)."""
        from zoo.data.tokenizer import TOKENIZER_FILES, load_tokenizer
        from zoo.models.gpt import GPTConfig

        folder = io.resolve_model_folder(folder)
        family, config = io.read_config(folder)
        if family != cls.family:
            raise io.CheckpointError(f"{folder} holds a {family!r} model, not a GPT; zoo.load_model(folder) picks "
                                     f"the class of any family")
        has_tokenizer = any((folder / name).is_file() for name in TOKENIZER_FILES)
        try:
            model = cls(GPTConfig.from_dict(config), load_tokenizer(folder) if has_tokenizer else None,
                        folder if has_tokenizer else None)
            model.lora = apply_folder_adapters(folder, model)
        except ValueError as e:
            raise io.CheckpointError(f"{folder}: {e}") from None
        io.load_model(folder, model)
        return model.to(device=device or "cpu", dtype=dtype).eval()

    def save_pretrained(self, folder: str | os.PathLike) -> Path:
        """Write a zoo model folder (``config.json``, ``model.safetensors``, the tokenizer files it was loaded with),
        replacing ``folder`` once complete."""
        tensors = ((name, io.full_param(t, None).cpu()) for name, t in io.model_tensors(self).items())  # unpadded
        out = io.write_model_folder(folder, self.family, self.config.to_dict(), tensors,
                                    tokenizer_dir=self.tokenizer_dir)
        if self.lora is not None:  # the adapters went out beside the weights: say so, as a LoRA run's export does
            io.write_config(out, self.family, self.config.to_dict(), adapter=self.lora)
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids)[..., : self.config.vocab_size]  # [b, s, V]

    def loss(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross entropy of ``ids [b, s]``: position t predicts ``labels[:, t + 1]`` (default
        ``ids``; -100 is not counted). An MoE model's router losses reach the router in backward, as in training."""
        labels = ids if labels is None else labels
        logits = self(ids[:, :-1])  # [b, s-1, V]
        return F.cross_entropy(logits.float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)

    def generate(self, prompt, max_new_tokens: int = 64, *, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0):
        """Continue ``prompt``: a string (the prompt and its continuation come back as one string), a list of
        strings (a list back), or token ids ``[b, s]`` (``[b, s + n]`` ids back, rows that reached eos padded).

        Greedy unless ``temperature``, ``top_k`` or ``top_p`` is given (then a draw seeded by ``seed``); stops at
        eos or after ``max_new_tokens``. The KV-cache decoder of ``launch/generate.py`` (``zoo.models.generate``)."""
        sampling = sampling_options(temperature, top_k, top_p, seed)
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if isinstance(prompt, torch.Tensor):
            out = Generator(self).generate(prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                                           eos_token_id=eos)
            return out.tokens
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer files: pass token ids [b, s], not text")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        ids, mask, pad_id = encode_prompts(self.tokenizer, prompts, self.config)
        out = Generator(self).generate(ids, max_new_tokens=max_new_tokens, sampling=sampling, eos_token_id=eos,
                                       pad_token_id=pad_id, attention_mask=mask)
        texts = [p + continuation(self.tokenizer, row) for p, row in zip(prompts, out.new_tokens)]
        return texts[0] if isinstance(prompt, str) else texts


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="launch/generate.py", description=DESCRIPTION)
    p.add_argument("--ckpt", required=True,
                   help="a zoo model folder with tokenizer files, or a training run folder holding one as model/")
    p.add_argument("--prompt", action="append", required=True,
                   help="the text to continue; repeat for a batch (left-padded to the longest)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true",
                   help="argmax decoding (the default when no sampling option is given)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the smallest set reaching this mass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (launch tp processes with torchrun)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    return p


def _say(rank: int, *args, **kwargs) -> None:
    if rank == 0:
        print(*args, **kwargs, flush=True)


def main(argv: list[str] | None = None) -> int:
    from zoo.convert.io import load_model, read_config, resolve_model_folder
    from zoo.data.tokenizer import load_tokenizer
    from zoo.models.gpt import GPTConfig, ParallelOptions, layer_specs
    from zoo.parallel.topology import destroy_model_parallel, initialize_model_parallel

    args = _parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))

    # Everything that can be wrong with the input is checked before any process group or model exists.
    try:
        if args.greedy and any(v is not None for v in (args.temperature, args.top_k, args.top_p)):
            raise ValueError("--greedy cannot be combined with --temperature/--top-k/--top-p")
        sampling = sampling_options(args.temperature, args.top_k, args.top_p, args.seed)
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        folder = resolve_model_folder(args.ckpt)
        family, config_dict = read_config(folder)
        if family != FAMILY:
            raise ValueError(f"{folder} holds a {family!r} model; generation is for the {FAMILY!r} family")
        config = GPTConfig.from_dict(config_dict)
        config.check_layout(args.tp)
        tokenizer = load_tokenizer(folder)
        ids, mask, pad_id = encode_prompts(tokenizer, args.prompt, config)
    except (ValueError, OSError) as e:  # CheckpointError and LayoutError are ValueErrors
        _say(rank, f"error: {e}", file=sys.stderr)
        return 2

    eos = tokenizer.eos_token_id
    longest = ids.shape[1]
    room = config.max_position_embeddings - longest + 1
    if args.max_new_tokens > room:
        _say(rank, f"note: at most {room} new tokens fit in max_position_embeddings {config.max_position_embeddings} "
                   f"after a prompt of {longest} tokens", file=sys.stderr)

    own_dist = not torch.distributed.is_initialized()
    try:
        grid = None
        if args.tp > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            grid = initialize_model_parallel(args.tp, 1)
            rank = grid.rank
        from deepspeed.accelerator import get_accelerator

        device = get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0")))
        model = SpecSequential(layer_specs(config, ParallelOptions()))
        apply_folder_adapters(folder, model)
        load_model(folder, model, None if grid is None else grid.tp_group)
        model = model.to(device=device, dtype=getattr(torch, args.dtype)).eval()
        out = Generator(model).generate(ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                        eos_token_id=eos, pad_token_id=pad_id, attention_mask=mask)
    except ValueError as e:
        _say(rank, f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if own_dist and torch.distributed.is_initialized():
            destroy_model_parallel()

    for row, text in enumerate(args.prompt):
        _say(rank, text + continuation(tokenizer, out.new_tokens[row]))
    n = out.new_tokens.shape[1]
    decode_rate = (n - 1) / out.decode_seconds if n > 1 and out.decode_seconds > 0 else float("nan")
    seconds = out.prompt_seconds + out.decode_seconds
    _say(rank, f"[generate] {n} new tokens x {len(args.prompt)} prompt(s) in {seconds:.2f} s: "
               f"{out.tokens_per_second:.1f} tokens/s (prompt of {longest} tokens + first token "
               f"{out.prompt_seconds * 1e3:.0f} ms, then {decode_rate:.1f} tokens/s), tp={args.tp}",
         file=sys.stderr)
    return 0


PRETRAINED = {FAMILY: PretrainedGPT}  # zoo.generate's tables: the class load_model returns, the command
COMMANDS = {FAMILY: main}
