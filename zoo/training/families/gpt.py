"""The GPT family in the training run: next-token prediction on packed token windows (zoo/models/gpt.py)."""

from __future__ import annotations

from pathlib import Path

from zoo.models.gpt import FAMILY
from zoo.training.families import Data, Family, prepare_once, read_run_config

SOURCES = ("embedded", "indexed", "synthetic", "instruct")  # instruct: launch/finetune.py (zoo.data.instruct)


def evaluated_bytes_per_token(valid, tokenizer_dir, cfg) -> float | None:
    """UTF-8 bytes per label token of the samples an evaluation reads (the first ``eval_iters`` global batches of
    the validation set), from the tokenizer's own decoding: validation loss / ln 2 / this is bits per byte, which
    compares runs whatever their vocabularies (val_bpb in metrics.jsonl)."""
    if valid is None or tokenizer_dir is None or not cfg.training.eval_interval:
        return None
    from zoo.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    count = min(len(valid), cfg.training.eval_iters * cfg.global_batch_size)
    labels = [valid[i][1:].tolist() for i in range(count)]
    n_bytes = sum(len(tokenizer.decode(ids).encode("utf-8")) for ids in labels)
    n_tokens = sum(len(ids) for ids in labels)
    return n_bytes / n_tokens if n_tokens and n_bytes else None


class GPTFamily(Family):
    name = FAMILY
    checkpointable_layers = ("GPTBlock",)
    init_overridable = ("hidden_dropout", "attention_dropout")
    context_parallel = True
    fused_cross_entropy = True
    lora = True

    @property
    def config_class(self):
        from zoo.models.gpt import GPTConfig

        return GPTConfig

    def config_from_init(self, src, overrides):
        from zoo.convert import io
        from zoo.convert.gpt import gpt_config_from_hf, read_hf_config, refuse_pickle_only, resolve_hf_folder

        folder = resolve_hf_folder(src)
        refuse_pickle_only(folder)
        arch, hf_config = read_hf_config(folder)
        config = self.config_class.from_dict({**gpt_config_from_hf(arch, hf_config).to_dict(), **overrides})
        has_tokenizer = any((folder / name).is_file() for name in io.TOKENIZER_FILES[:2])
        return config, str(folder) if has_tokenizer else None

    def import_folder(self, src, out):
        from zoo.convert.gpt import hf_to_zoo

        hf_to_zoo(src, out)

    def layer_specs(self, config, par):
        """``par`` (``zoo.models.gpt.ParallelOptions``) with ``cp_group``: each layer holds this CP rank's
        ``[b, s/cp, h]`` (also what a pipeline stage sends), attention by ``cp_algorithm``; with ``ep_group``: each MoE
        layer holds its share of the experts (``ep_spans_tp``: the EP group takes in the TP ranks); with
        ``fused_cross_entropy`` the head hands the loss its input and weight (no logits)."""
        from zoo.models.gpt import layer_specs

        return layer_specs(config, par)

    def loss(self, config, par=None):
        """The whole sequence's mean; with ``par.cp_group`` its gradient is right once averaged over dp x cp, which
        is what DeepSpeed does (its data-parallel group is dp x cp: zoo.parallel.topology)."""
        from zoo.models.gpt import GPTLoss

        return GPTLoss(config, cp_group=None if par is None else par.cp_group)

    def training_flops_per_sample(self, cfg, config):
        from zoo.training.metrics import training_flops_per_token

        seq = cfg.training.seq_length
        return seq * training_flops_per_token(config, seq, cfg.parallel.activation_checkpointing)

    def add_adapters(self, module, lora, seed):
        from zoo.models.lora import apply_lora

        return apply_lora(module, lora, seed=seed)

    def universal_checkpoint_info(self, config):
        from zoo.training.checkpoint import universal_checkpoint_info

        return universal_checkpoint_info(config)

    def validate(self, cfg, model) -> None:
        """Data problems found by opening files (cheap: indexes are memory-mapped), before any process group."""
        data, tr = cfg.data, cfg.training
        if tr.seq_length > model.max_position_embeddings:
            raise ValueError(f"training.seq_length {tr.seq_length} exceeds the model's max_position_embeddings "
                             f"{model.max_position_embeddings}")
        if data.source not in SOURCES:
            raise ValueError(f"data.source {data.source!r} is not available for GPT; supported: {list(SOURCES)}")
        if not 0.0 <= data.valid_fraction < 1.0:
            raise ValueError(f"data.valid_fraction must be in [0, 1), got {data.valid_fraction}")
        if data.source == "instruct" and not data.paths:
            raise ValueError("data.source instruct needs data.paths=[FILE.jsonl] (launch/finetune.py --data sets it)")
        if data.source == "instruct" and data.tokenizer is None:
            raise ValueError("data.source instruct needs a tokenizer, and the init folder holds no tokenizer; pass "
                             "--set data.tokenizer=DIR")
        if data.source == "indexed":
            if not data.paths:
                raise ValueError("data.source indexed needs data.paths (prefixes of .bin/.idx files written by "
                                 "launch/preprocess.py), e.g. --set data.paths=[data/my-corpus]")
            from zoo.data.gpt_dataset import parse_blend
            from zoo.data.indexed import IndexedDataset

            try:
                prefixes = parse_blend([str(p) for p in data.paths])[1]
                prefixes += parse_blend([str(p) for p in data.valid_paths])[1] if data.valid_paths else []
                for prefix in prefixes:
                    ds = IndexedDataset(prefix)
                    if len(ds) == 0 or int(ds.sizes.sum()) == 0:
                        raise ValueError(f"{prefix}.bin/.idx holds no tokens; preprocess a non-empty input with "
                                         f"launch/preprocess.py")
            except ValueError as e:
                raise ValueError(f"data: {e}") from None
        if data.tokenizer is not None:
            from zoo.data.tokenizer import load_tokenizer

            try:
                n = len(load_tokenizer(data.tokenizer))
            except (OSError, ValueError) as e:
                raise ValueError(f"data.tokenizer: {e}") from None
            if n > model.vocab_size:
                raise ValueError(f"tokenizer {data.tokenizer} has {n} tokens but the model's vocab_size is "
                                 f"{model.vocab_size}; set model.vocab_size >= {n} (e.g. --set model.vocab_size={n})")
        if data.source == "embedded":
            n = data.tokenizer_vocab_size or model.vocab_size
            if n > model.vocab_size:
                raise ValueError(f"data.tokenizer_vocab_size {n} exceeds the model's vocab_size {model.vocab_size}; "
                                 f"lower it or raise model.vocab_size")
            if n < 257:
                raise ValueError(f"a byte-level BPE needs at least 257 tokens, got vocabulary {n}; "
                                 f"set model.vocab_size (or data.tokenizer_vocab_size) >= 257")

    def build_data(self, cfg, model, grid) -> Data:
        """Training and validation samples; the embedded corpus is prepared once, by global rank 0."""
        from zoo.data.synthetic import SyntheticTokens

        data, tr = cfg.data, cfg.training
        if data.source == "instruct":  # prompt/response or chat jsonl (launch/finetune.py documents the format)
            from zoo.data.instruct import load_instruct_data
            from zoo.data.tokenizer import load_tokenizer

            got = load_instruct_data(data.paths[0], load_tokenizer(data.tokenizer), tr.seq_length, tr.seed,
                                     valid_path=data.valid_paths[0] if data.valid_paths else None,
                                     valid_fraction=data.valid_fraction)
            return Data(got.train, got.valid, data.tokenizer)
        if data.source == "synthetic":
            return Data(SyntheticTokens(model.vocab_size, tr.seq_length, seed=tr.seed),
                        SyntheticTokens(model.vocab_size, tr.seq_length, seed=tr.seed + 1), data.tokenizer)
        from zoo.data.gpt_dataset import build_gpt_datasets, prepare_embedded_corpus

        tokenizer, paths = data.tokenizer, data.paths
        if data.source == "embedded":
            prepared = prepare_once(prepare_embedded_corpus, cfg, model, grid)
            tokenizer, paths = tokenizer or prepared["tokenizer"], [prepared["prefix"]]
        train, valid = build_gpt_datasets([str(p) for p in paths], tr.seq_length, tr.seed,
                                          valid_fraction=data.valid_fraction,
                                          valid_paths=[str(p) for p in data.valid_paths] if data.valid_paths else None)
        return Data(train, valid, tokenizer, evaluated_bytes_per_token(valid, tokenizer, cfg))

    def after_training(self, model_dir, log, prompts=("The ", "def ", "To "), max_new_tokens: int = 48) -> None:
        """Continuations of a few prompts by the exported model, in this process alone (any training layout),
        sampled as :func:`sample_continuations` does: a small model's greedy text repeats one token, which shows
        nothing. Reading the exported folder back also proves the export: what is printed comes from the files on
        disk."""
        if not any((Path(model_dir) / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
            return  # trained without a tokenizer (synthetic tokens): nothing to show as text
        continuations = sample_continuations(model_dir, prompts, max_new_tokens)
        for prompt, text in zip(prompts, continuations):
            log(f"sample (temperature {SAMPLING['temperature']}, top-k {SAMPLING['top_k']}): " + repr(prompt + text))
        if trained_on_embedded_corpus(model_dir):
            from zoo.data.corpus import known_words

            known, total = known_words(continuations)
            log(f"samples: {known} of {total} words ({known / max(total, 1):.0%}) occur in the embedded corpus")


SAMPLING = {"temperature": 0.8, "top_k": 40}  # what reads best from a small model (greedy text repeats)


def sample_continuations(model, prompts, max_new_tokens: int = 48) -> list[str]:
    """The text ``model`` (a zoo model folder, or a :class:`zoo.generate.gpt.PretrainedGPT` with its tokenizer)
    continues each prompt with: sampled at ``SAMPLING``, the random draws seeded by the prompt's position."""
    from zoo.generate.gpt import PretrainedGPT

    if not isinstance(model, PretrainedGPT):
        model = PretrainedGPT.from_pretrained(model)
    model.eval()
    return [model.generate(prompt, max_new_tokens, seed=n, **SAMPLING)[len(prompt):]
            for n, prompt in enumerate(prompts)]


def trained_on_embedded_corpus(model_dir) -> bool:
    """Whether the run that exported ``model_dir`` (its folder's config.yaml) trained on the embedded corpus."""
    import yaml

    try:
        return (read_run_config(Path(model_dir).parent).get("data") or {}).get("source") == "embedded"
    except (OSError, yaml.YAMLError, AttributeError):
        return False


FAMILIES = {FAMILY: GPTFamily()}  # zoo.training.families.REGISTRY
