"""zoo's BERT computes what HuggingFace's BERT computes, given the same weights, at tp=1, tp=2 and pp=2.

Each test builds a small HF model with random weights (``BertForMaskedLM``, ``BertForPreTraining`` or
``BertForSequenceClassification``, exact GELU, no dropout), copies its weights into zoo's state dict through the
HF adapter's key table (``zoo.convert.bert.hf_rows``) and compares the last hidden state, the MLM / NSP /
classification logits and the losses, on a batch with padding. At tp=2 every rank keeps its slice of the same
full tensors; at pp=2 each pipeline stage loads the keys it holds. HF runs in the test process only: the workers
get its state dict and its outputs as arguments, so they never import transformers (seconds per process on a busy
machine).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zoo.convert.bert import IGNORED, hf_rows
from zoo.data.masking import SpecialTokens, mask_tokens
from zoo.models.bert import (
    BertClassificationLoss,
    BertConfig,
    BertMLMLoss,
    layer_specs,
)
from zoo.models.gpt import ParallelOptions
from zoo.models.specs import SpecSequential, build_pipeline
from zoo.parallel.topology import get_tensor_model_parallel_group, group_rank_and_size
from zoo.training.engine import destroy_engine

VOCAB = 300  # not a multiple of 128: zoo pads it (384 at tp=1, 512 at tp=2), so the padding path is exercised
LAYERS = 2
NUM_LABELS = 3
SEQ = 24
TOL = 1e-5
SPECIAL = SpecialTokens(cls=1, sep=2, mask=3, pad=0)

def local_slice(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This TP rank's part of ``full``: the contiguous chunk along the parameter's partition dim, after padding a
    vocabulary dimension with zero rows up to the padded size. Replicated parameters take ``full`` as is."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    rank, tp = group_rank_and_size(get_tensor_model_parallel_group())
    dim = param.partition_dim
    extra = param.shape[dim] * tp - full.shape[dim]
    if extra:
        full = F.pad(full, [0, 0] * (full.dim() - dim - 1) + [0, extra])
    return full.chunk(tp, dim=dim)[rank]


def load_from_hf(model: torch.nn.Module, hf_sd: dict, head: str | None, *, complete: bool = True) -> None:
    """Copy HF's weights (its state dict) into ``model`` through the adapter's key table (``hf_rows``, QKV fused
    per head). Every zoo tensor must be written; with ``complete`` every HF tensor must be used too, except HF's
    tied copies (pass False for a part of the model: the encoder alone, one pipeline stage)."""
    zoo_params = dict(model.named_parameters(remove_duplicate=False))
    rows = {row.zoo: row for row in hf_rows(zoo_config(), head)}
    used = set()
    for key, dst in model.state_dict().items():
        row = rows[key]
        value = local_slice(zoo_params[key], row.to_zoo(*(hf_sd[k] for k in row.hf)))
        assert value.shape == dst.shape, (key, value.shape, dst.shape)
        with torch.no_grad():
            dst.copy_(value)  # state_dict() tensors share storage with the parameters
        used.update(row.hf)
    if complete:
        unused = sorted(k for k in set(hf_sd) - used if not IGNORED.search(k))
        assert not unused, unused


# ---------------------------------------------------------------------------------------------------------------
# Models and data
# ---------------------------------------------------------------------------------------------------------------


def zoo_config(**overrides) -> BertConfig:
    fields = dict(vocab_size=VOCAB, num_hidden_layers=LAYERS, intermediate_size=128, max_position_embeddings=64,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=NUM_LABELS)
    return BertConfig.from_preset("tiny", **{**fields, **overrides})


def hf_config(cfg: BertConfig):
    from transformers import BertConfig as HFBertConfig

    return HFBertConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                        num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.intermediate_size,
                        max_position_embeddings=cfg.max_position_embeddings, type_vocab_size=cfg.type_vocab_size,
                        layer_norm_eps=cfg.layer_norm_eps, hidden_dropout_prob=cfg.hidden_dropout_prob,
                        attention_probs_dropout_prob=cfg.attention_probs_dropout_prob, pad_token_id=cfg.pad_token_id,
                        num_labels=cfg.num_labels, hidden_act="gelu")


HF_CLASSES = {"mlm": "BertForMaskedLM", "mlm+nsp": "BertForPreTraining",
              "classification": "BertForSequenceClassification"}


def hf_model(kind: str, seed: int = 0):
    """A HF model whose every weight is moved away from its init (LayerNorm weights ~1, everything else ~N(0, 0.1)),
    so a swapped norm, a dropped bias or a mis-ordered head cannot go unnoticed."""
    import transformers

    torch.manual_seed(seed)
    hf = getattr(transformers, HF_CLASSES[kind])(hf_config(zoo_config())).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(1.0 + noise if "LayerNorm.weight" in name else noise)
    return hf


def zoo_model(head, hf_sd=None):
    model = SpecSequential(layer_specs(zoo_config(), head=head)).eval()
    if hf_sd is not None:
        load_from_hf(model, hf_sd, head, complete=head is not None)
    return model


def make_batch(seed: int = 0):
    """Three rows of two segments; rows 1 and 2 end in padding (mask 0, pad id). Returns the model inputs, the
    MLM labels (from zoo's masking), the NSP labels and classification labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (3, SEQ), generator=g)
    ids[0, 1:3] = torch.tensor([VOCAB - 1, VOCAB - 2])  # the vocabulary's edge, next to zoo's padding rows
    ids[:, 0] = SPECIAL.cls
    token_type_ids = torch.zeros_like(ids)
    attention_mask = torch.ones_like(ids)
    for row, (split, length) in enumerate([(10, SEQ), (7, SEQ - 6), (5, SEQ - 13)]):
        ids[row, split - 1] = ids[row, length - 1] = SPECIAL.sep
        token_type_ids[row, split:length] = 1
        attention_mask[row, length:] = 0
        ids[row, length:] = SPECIAL.pad
    masked_ids, mlm_labels = mask_tokens(ids, seed, vocab_size=VOCAB, special=SPECIAL)
    nsp_labels = torch.tensor([0, 1, 1])
    class_labels = torch.tensor([2, 0, 1])
    return (masked_ids, token_type_ids, attention_mask), mlm_labels, nsp_labels, class_labels


def hf_forward(hf, inputs, **kwargs):
    ids, token_type_ids, attention_mask = inputs
    return hf(input_ids=ids, token_type_ids=token_type_ids, attention_mask=attention_mask, **kwargs)


def max_diff(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def vocab_slice(full: torch.Tensor, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the real vocabulary in this rank's ``local`` shard and the matching part of HF's ``full``."""
    rank, _ = group_rank_and_size(get_tensor_model_parallel_group())
    n = local.shape[-1]
    start, stop = rank * n, min((rank + 1) * n, VOCAB)
    return local[..., : max(0, stop - start)], full[..., start:stop]


# ---------------------------------------------------------------------------------------------------------------
# Comparisons, shared by the tp=1 tests and the tp=2 workers
# ---------------------------------------------------------------------------------------------------------------


def pretraining_reference() -> dict:
    """HF ``BertForPreTraining`` on the batch: its weights, outputs, loss and two gradients."""
    hf = hf_model("mlm+nsp")
    inputs, mlm_labels, nsp_labels, _ = make_batch()
    out = hf_forward(hf, inputs, labels=mlm_labels, next_sentence_label=nsp_labels, output_hidden_states=True)
    out.loss.backward()
    return {"state_dict": {k: v.detach().clone() for k, v in hf.state_dict().items()},
            "hidden": out.hidden_states[-1].detach(), "mlm_logits": out.prediction_logits.detach(),
            "nsp_logits": out.seq_relationship_logits.detach(), "loss": out.loss.item(),
            "embed_grad": hf.bert.embeddings.word_embeddings.weight.grad.clone(),
            "mlm_bias_grad": hf.cls.predictions.bias.grad.clone()}


def pretraining_diffs(ref: dict) -> dict[str, float]:
    """Encoder output, MLM and NSP logits, the MLM+NSP loss and two gradients, zoo vs ``ref`` (on this TP rank)."""
    inputs, mlm_labels, nsp_labels, _ = make_batch()
    encoder, model = zoo_model(None, ref["state_dict"]), zoo_model("mlm+nsp", ref["state_dict"])
    with torch.no_grad():
        hidden = encoder(inputs)
    mlm_logits, nsp_logits = model(inputs)
    loss = BertMLMLoss(zoo_config())((mlm_logits, nsp_logits), (mlm_labels, nsp_labels))
    loss.backward()

    params = dict(model.named_parameters())
    ours_logits, hf_logits = vocab_slice(ref["mlm_logits"], mlm_logits)
    embed_grad = params["tied_modules.embed.word_embeddings.weight"].grad
    ours_grad, hf_grad = vocab_slice(ref["embed_grad"].t(), embed_grad.t())
    ours_bias, hf_bias = vocab_slice(ref["mlm_bias_grad"], params[f"{LAYERS + 3}.bias"].grad)
    assert hf_grad.abs().max() > 1e-3 and hf_bias.abs().max() > 1e-3  # gradients worth comparing
    return {
        "hidden": max_diff(hidden, ref["hidden"]),
        "mlm_logits": max_diff(ours_logits, hf_logits),
        "nsp_logits": max_diff(nsp_logits, ref["nsp_logits"]),
        "loss": abs(loss.item() - ref["loss"]),
        "embed_grad": max_diff(ours_grad, hf_grad),
        "mlm_bias_grad": max_diff(ours_bias, hf_bias),
    }


def classification_reference() -> dict:
    hf = hf_model("classification")
    inputs, _, _, labels = make_batch(seed=1)
    with torch.no_grad():
        out = hf_forward(hf, inputs, labels=labels)
    return {"state_dict": hf.state_dict(), "logits": out.logits, "loss": out.loss.item()}


def classification_diffs(ref: dict) -> dict[str, float]:
    inputs, _, _, labels = make_batch(seed=1)
    with torch.no_grad():
        logits = zoo_model("classification", ref["state_dict"])(inputs)
    loss = BertClassificationLoss(zoo_config())(logits, labels)
    return {"logits": max_diff(logits, ref["logits"]), "loss": abs(loss.item() - ref["loss"])}


def _assert_small(diffs: dict[str, float], what: str = "") -> None:
    bad = {k: v for k, v in diffs.items() if not v < TOL}
    assert not bad, f"{what} zoo differs from HF: {bad}"


# ---------------------------------------------------------------------------------------------------------------
# tp=1, in this process
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pretraining_ref():
    return pretraining_reference()


@pytest.fixture(scope="module")
def classification_ref():
    return classification_reference()


def test_pretraining_matches_hf(pretraining_ref):
    _assert_small(pretraining_diffs(pretraining_ref))


def test_classification_matches_hf(classification_ref):
    _assert_small(classification_diffs(classification_ref))


def test_masked_lm_matches_hf_and_padding_matters():
    hf = hf_model("mlm")
    inputs, _, _, _ = make_batch(seed=2)
    model = zoo_model("mlm", hf.state_dict())
    with torch.no_grad():
        theirs = hf_forward(hf, inputs).logits
        ours = model(inputs)
        unmasked = model((inputs[0], inputs[1], torch.ones_like(inputs[2])))
    assert ours.shape == (*inputs[0].shape, zoo_config().padded_vocab_size())
    assert max_diff(ours[..., :VOCAB], theirs) < TOL
    # Without the padding mask, the real tokens of the padded rows see the padding: the comparison has teeth.
    real = inputs[2].bool()
    assert (unmasked - ours)[real].abs().max() > 1e-2


def test_qkv_mapping_has_teeth():
    """Concatenating Q, K and V without the per-head regrouping gives different outputs."""
    hf = hf_model("mlm")
    sd = hf.state_dict()
    model = zoo_model(None, sd)
    inputs = make_batch()[0]
    with torch.no_grad():
        for i in range(LAYERS):
            naive = [sd[f"bert.encoder.layer.{i}.attention.self.{n}.weight"] for n in ("query", "key", "value")]
            dict(model.named_parameters())[f"{i + 1}.attention.qkv.weight"].copy_(torch.cat(naive))
        ours = model(inputs)
        theirs = hf_forward(hf, inputs, output_hidden_states=True).hidden_states[-1]
    assert max_diff(ours, theirs) > 1e-2


@pytest.mark.parametrize("preset", ["tiny", "bert-base", "bert-large"])
def test_num_parameters_match_hf(preset):
    import transformers

    cfg = BertConfig.from_preset(preset)
    classes = {"pooler": transformers.BertModel, None: lambda c: transformers.BertModel(c, add_pooling_layer=False),
               **{head: getattr(transformers, name) for head, name in HF_CLASSES.items()}}
    with torch.device("meta"):
        counts = {head: sum(p.numel() for p in make(hf_config(cfg)).parameters()) for head, make in classes.items()}
    assert {head: cfg.num_parameters(head) for head in classes} == counts
    assert cfg.num_parameters() == counts["pooler"]  # BertModel: 109.48M for bert-base


def test_built_model_has_num_parameters():
    cfg = zoo_config()
    padding = cfg.padded_vocab_size() - cfg.vocab_size
    for head in (None, "mlm", "mlm+nsp", "classification"):
        model = zoo_model(head)
        expected = cfg.num_parameters(head) + padding * cfg.hidden_size + (padding if head and "mlm" in head else 0)
        assert sum(p.numel() for p in model.parameters()) == expected, head


def test_config_round_trip_and_errors():
    cfg = BertConfig.from_preset("bert-large")
    assert BertConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['n_layer'\]"):
        BertConfig.from_dict({"n_layer": 2})
    with pytest.raises(ValueError, match="unknown BERT preset 'bert-huge'"):
        BertConfig.from_preset("bert-huge")
    with pytest.raises(ValueError, match="hidden_size 64 is not divisible by num_attention_heads 5"):
        BertConfig.from_preset("tiny", num_attention_heads=5)
    with pytest.raises(ValueError, match="pad_token_id 600 is outside"):
        BertConfig.from_preset("tiny", pad_token_id=600)


def test_bad_layouts_and_options_are_refused():
    cfg = zoo_config()
    with pytest.raises(ValueError, match="^num_attention_heads 4 is not divisible by tp 3; use a tp that divides it$"):
        cfg.check_layout(3)
    with pytest.raises(ValueError, match="intermediate_size 100 is not divisible by tp 8"):
        zoo_config(intermediate_size=100, num_attention_heads=8).check_layout(8)
    with pytest.raises(ValueError, match="num_hidden_layers 2 is smaller than pp 4"):
        cfg.check_layout(1, 4)
    cfg.check_layout(4, 2)  # fits
    with pytest.raises(ValueError, match="BERT does not implement sequence parallelism"):
        layer_specs(cfg, ParallelOptions(sequence_parallel=True))
    with pytest.raises(ValueError, match="unknown BERT head 'nsp'"):
        layer_specs(cfg, head="nsp")
    inputs = make_batch()[0]
    with pytest.raises(TypeError, match="attention_mask must be an integer tensor"):
        zoo_model(None)((inputs[0], inputs[1], inputs[2].float()))


# ---------------------------------------------------------------------------------------------------------------
# tp=2 and pp=2, in the gloo pools (worker functions are module-level so they pickle)
# ---------------------------------------------------------------------------------------------------------------


def tp2_case(pretraining_ref, classification_ref):
    from zoo.parallel.topology import initialize_model_parallel

    initialize_model_parallel(2, 1)
    classification = classification_diffs(classification_ref)
    return {**pretraining_diffs(pretraining_ref), **{f"classification_{k}": v for k, v in classification.items()}}


def test_tp2_matches_hf(dist_run, pretraining_ref, classification_ref):
    for rank, diffs in enumerate(dist_run(2, tp2_case, pretraining_ref, classification_ref)):
        _assert_small(diffs, f"tp=2 rank {rank}:")


LR = 1e-3


def plain_train_losses(ref: dict, steps: int = 2) -> list[float]:
    """The plain MLM+NSP model loaded from ``ref``: the loss before each of ``steps`` AdamW steps on the batch."""
    model = zoo_model("mlm+nsp", ref["state_dict"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    inputs, mlm_labels, nsp_labels, _ = make_batch()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = BertMLMLoss(zoo_config())(model(inputs), (mlm_labels, nsp_labels))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def pp2_case(ref):
    """The MLM+NSP model as a 2-stage PipelineModule under DeepSpeed's engine: eval (loss and logits) against HF,
    then two training steps (each loss is computed before its update); plus this stage's state-dict keys."""
    import deepspeed

    from zoo.parallel.topology import initialize_model_parallel

    grid = initialize_model_parallel(1, 2)
    cfg = zoo_config()
    inputs, mlm_labels, nsp_labels, _ = make_batch()

    module = build_pipeline(layer_specs(cfg, head="mlm+nsp"), grid, loss_fn=BertMLMLoss(cfg),
                            partition_method="type:BertLayer")
    load_from_hf(module, ref["state_dict"], "mlm+nsp", complete=False)
    config = {"train_micro_batch_size_per_gpu": inputs[0].shape[0], "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
              "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=config)
    batch = [(inputs, (mlm_labels, nsp_labels))]
    eval_loss, outputs = engine.eval_batch(iter(batch), return_logits=True)
    train_losses = [engine.train_batch(iter(batch)).item() for _ in range(2)]
    destroy_engine(engine)
    diffs = {"eval_loss": abs(eval_loss.item() - ref["loss"]), "train_loss": abs(train_losses[0] - ref["loss"])}
    if grid.is_last_stage:
        mlm_logits, nsp_logits = outputs
        diffs["mlm_logits"] = max_diff(mlm_logits[..., :VOCAB], ref["mlm_logits"])
        diffs["nsp_logits"] = max_diff(nsp_logits, ref["nsp_logits"])
    kinds = sorted({type(m).__name__ for m in module.forward_funcs if isinstance(m, torch.nn.Module)})
    return diffs, {k: tuple(v.shape) for k, v in module.state_dict().items()}, kinds, train_losses


def test_pp2_pipeline_matches_hf_and_plain(dist_run, pretraining_ref):
    stages = dist_run(2, pp2_case, pretraining_ref)
    expected_losses = plain_train_losses(pretraining_ref)
    assert expected_losses[1] < expected_losses[0] - 1e-3  # the step changed the model
    merged = {}
    for rank, (diffs, keys, _, losses) in enumerate(stages):
        _assert_small(diffs, f"pp=2 stage {rank}:")
        # The second loss sees the update: gradients crossed the stage boundary and the tied embedding's two
        # copies were summed, as in the plain model.
        torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=0)
        merged.update(keys)  # the tied embedding appears on both stages under the same key
    assert "mlm_logits" in stages[1][0]
    plain = {k: tuple(v.shape) for k, v in zoo_model("mlm+nsp").state_dict().items()}
    assert merged == plain
    assert stages[0][2] == ["BertEmbedding", "BertLayer"]
    assert stages[1][2] == ["BertLayer", "BertMLMBias", "BertMLMHead"]
