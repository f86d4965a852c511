"""BERT (Devlin et al. 2018, arXiv 1810.04805): a bidirectional Transformer encoder, built from tensor-parallel layers.

As the paper and HF's ``BertModel``: word + learned position + token-type embeddings followed by a LayerNorm,
post-LayerNorm blocks (``x = LN(x + attn(x)); x = LN(x + mlp(x))``), exact (erf) GELU, biases everywhere,
self-attention over all positions except padding. Heads: masked-LM (dense, GELU, LayerNorm, then the word
embedding matrix again as the decoder plus its own bias), the pooler (tanh dense on the [CLS] position), the
next-sentence / sentence-order head (2 classes from the pooled output) and a sequence-classification head.

Parallel plan (Megatron-LM, arXiv 1909.08053): the fused QKV and MLP fc1 are column-parallel, the attention output
and MLP fc2 row-parallel (two all-reduces per block forward); the word embedding is vocab-parallel and the MLM
decoder yields vocab-sharded logits for ``vocab_parallel_cross_entropy``. Everything else (position and token-type
embeddings, LayerNorms, the heads' small dense layers) is replicated on the TP group. Sequence parallelism is not
implemented for BERT: :func:`layer_specs` refuses it.

Fused QKV layout (rows of ``attention.qkv.weight``): head by head, ``[q_0; k_0; v_0; q_1; k_1; v_1; ...]``, each
block ``d`` rows, i.e. the output viewed as ``[n, 3, d]``, as Megatron's ``[np, 3, hn]``. A contiguous TP split
then gives each rank whole heads, and ``attention.dense`` is split along the same heads (its input columns).

Pipeline tuple: the first layer takes ``(input_ids, token_type_ids, attention_mask)``, all integer ``[b, s]``
(mask: 1 token, 0 padding); every ``BertLayer`` takes and returns ``(hidden, attention_mask)`` with the mask still
an integer tensor, because DeepSpeed gives every float tensor sent between stages a gradient. What the last layer
returns, per ``head`` of :func:`layer_specs`:

- ``None``: the last hidden state ``[b, s, h]``;
- ``"mlm"``: vocab-sharded MLM logits ``[b, s, V/tp]``;
- ``"mlm+nsp"``: the tuple ``(mlm_logits [b, s, V/tp], nsp_logits [b, 2])``, consumed by :class:`BertMLMLoss` with
  labels ``(mlm_labels [b, s], nsp_labels [b])``;
- ``"classification"``: ``logits [b, num_labels]``, consumed by :class:`BertClassificationLoss`.

The MLM head spans three layers (transform, tied decoder, bias). Partition so that no stage boundary falls
inside it (``type:BertLayer`` does this): otherwise a float tensor crosses the boundary, and with "mlm+nsp"
at tp > 1 that needs ``"pipeline": {"pipe_partitioned": false, "grad_partitioned": false}`` (without it
DeepSpeed's pipeline engine fails at tp > 1 when extra float tensors of the tuple need gradients).

Notation: b batch, s sequence, h hidden, n heads, d head dim, f intermediate, V padded vocabulary; a ``_local``
suffix means "this TP rank's share".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from zoo.models.config import TransformerConfig, preset_config
from zoo.models.gpt import ParallelOptions
from zoo.parallel.cross_entropy import vocab_parallel_cross_entropy
from zoo.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    divide,
    init_method_normal,
    set_tensor_model_parallel_attributes,
)
from zoo.parallel.mappings import copy_to_tensor_model_parallel_region
from zoo.parallel.random import tensor_parallel_rng
from zoo.parallel.topology import get_tensor_model_parallel_group, group_rank_and_size

HEADS = (None, "mlm", "mlm+nsp", "classification")
# The family names of zoo model folders (zoo.models.registry): an encoder (with or without the MLM/NSP heads) and a
# sequence classifier, which fine-tunes and exports differently.
FAMILY, CLASSIFIER_FAMILY = "bert", "bert-classifier"


@dataclass
class BertConfig(TransformerConfig):  # padded_vocab_size, check_layout, from_dict
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072  # Megatron: ffn_hidden_size
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1  # Megatron: hidden_dropout
    attention_probs_dropout_prob: float = 0.1  # Megatron: attention_dropout
    classifier_dropout: float | None = None  # None: hidden_dropout_prob (as HF)
    initializer_range: float = 0.02
    pad_token_id: int | None = 0  # its word-embedding row starts at zero (as HF)
    num_labels: int = 2  # classification head; 1 means regression (MSE), as HF
    make_vocab_size_divisible_by: int = 128  # Megatron: the padded vocabulary is a multiple of this x tp

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def need(ok, msg):
            if not ok:
                raise ValueError(f"BertConfig: {msg}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "max_position_embeddings", "type_vocab_size", "num_labels", "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            need(isinstance(value, int) and value >= 1, f"{name} must be a positive integer, got {value!r}")
        need(self.hidden_size % self.num_attention_heads == 0,
             f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            value = getattr(self, name)
            if value is None and name == "classifier_dropout":
                continue
            need(isinstance(value, (int, float)) and 0.0 <= value < 1.0, f"{name} must be in [0, 1), got {value!r}")
        need(self.pad_token_id is None or 0 <= self.pad_token_id < self.vocab_size,
             f"pad_token_id {self.pad_token_id} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self, head: str | None = "pooler") -> int:
        """Parameters with the vocabulary unpadded, as HF counts them.

        ``head`` as in :func:`layer_specs` gives the model it builds: ``None`` is ``BertModel`` without pooler,
        ``"mlm"`` ``BertForMaskedLM``, ``"mlm+nsp"`` ``BertForPreTraining``, ``"classification"``
        ``BertForSequenceClassification``. The default ``"pooler"`` is ``BertModel`` (encoder + pooler), the size
        the paper quotes: 110M for bert-base (109,482,240), 340M for bert-large.
        """
        if head != "pooler":
            _check_head(head)
        V, h, f, L = self.vocab_size, self.hidden_size, self.intermediate_size, self.num_hidden_layers
        embeddings = (V + self.max_position_embeddings + self.type_vocab_size) * h + 2 * h
        layer = (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * f + f) + (f * h + h) + 2 * h
        pooler = h * h + h
        mlm = (h * h + h) + 2 * h + V  # transform dense, LayerNorm, decoder bias (decoder weight: tied)
        extra = {None: 0, "pooler": pooler, "mlm": mlm, "mlm+nsp": mlm + pooler + 2 * h + 2,
                 "classification": pooler + h * self.num_labels + self.num_labels}[head]
        return embeddings + L * layer + extra

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> BertConfig:
        return preset_config(cls, PRESETS, "BERT", name, overrides)


PRESETS: dict[str, dict] = {
    # Tests and the laptop run.
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                 max_position_embeddings=128),
    # The released shapes (uncased WordPiece vocabulary of 30522).
    "bert-base": dict(),
    "bert-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


def _check_head(head) -> None:
    if head not in HEADS:
        raise ValueError(f"unknown BERT head {head!r}; heads: {list(HEADS)}")


# ---------------------------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------------------------


def _linear(config: BertConfig, in_features: int, out_features: int) -> nn.Linear:
    """A replicated linear layer, initialized as HF's BERT: weight N(0, initializer_range^2), bias 0."""
    linear = nn.Linear(in_features, out_features)
    init_method_normal(config.initializer_range)(linear.weight.data)
    nn.init.zeros_(linear.bias)
    return linear


def _dropout(x, p, training):
    return F.dropout(x, p, True) if training and p > 0.0 else x


def attention_bias(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Integer mask ``[b, s]`` (1 token, 0 padding) -> additive bias ``[b, 1, 1, s]`` over the keys: 0 where a key
    may be attended, the dtype's minimum at padding (a large finite value: an all-padding row stays finite)."""
    keep = attention_mask.bool()[:, None, None, :]
    return torch.zeros(keep.shape, dtype=dtype, device=attention_mask.device).masked_fill(~keep, torch.finfo(dtype).min)


class BertEmbedding(nn.Module):
    """``(input_ids, token_type_ids, attention_mask)`` -> ``(hidden [b, s, h], attention_mask)``.

    hidden = dropout(LN(word[ids] + position[0..s) + token_type[token_type_ids])). Also the tied MLM decoder
    (:func:`mlm_decoder`) on the last pipeline stage. A bare ``input_ids`` tensor is accepted too (one segment,
    no padding).
    """

    def __init__(self, config: BertConfig, par: ParallelOptions):
        super().__init__()
        self.config, self.par = config, par
        tp_rank, tp = group_rank_and_size(par.tp_group)
        init = init_method_normal(config.initializer_range)
        self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size(tp), config.hidden_size,
                                                      init_method=init, tp_group=par.tp_group)
        self.word_embeddings.weight.unpadded_size = config.vocab_size  # rows past it are padding (zoo.convert.io)
        pad = config.pad_token_id
        local = self.word_embeddings
        if pad is not None and local.vocab_start_index <= pad < local.vocab_end_index:
            with torch.no_grad():  # HF zeroes the padding row at init; the rank owning it does the same
                local.weight[pad - local.vocab_start_index].zero_()
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        init(self.position_embeddings.weight.data)
        init(self.token_type_embeddings.weight.data)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    @property
    def word_embeddings_weight(self):  # TiedLayerSpec fetches the shared weight with getattr
        return self.word_embeddings.weight

    def forward(self, inputs):
        if isinstance(inputs, torch.Tensor):
            ids, token_type_ids, attention_mask = inputs, torch.zeros_like(inputs), torch.ones_like(inputs)
        else:
            ids, token_type_ids, attention_mask = inputs
        if attention_mask.is_floating_point():
            raise TypeError("attention_mask must be an integer tensor (1 token, 0 padding), not "
                            f"{attention_mask.dtype}: a float tensor sent between pipeline stages needs a gradient")
        s = ids.shape[1]
        if s > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {s} exceeds max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        x = self.word_embeddings(ids)  # [b, s, h]
        x = x + self.position_embeddings(torch.arange(s, device=ids.device))
        x = x + self.token_type_embeddings(token_type_ids)
        x = _dropout(self.layer_norm(x), self.config.hidden_dropout_prob, self.training)
        return x, attention_mask.long()


class BertSelfAttention(nn.Module):
    """Bidirectional multi-head self-attention with a key padding mask; heads split over TP.

    ``qkv`` is column-parallel (rank r holds heads ``[r n/tp, (r+1) n/tp)``, each as ``[q; k; v]``), ``dense``
    row-parallel over the same heads.
    """

    def __init__(self, config: BertConfig, par: ParallelOptions):
        super().__init__()
        self.config = config
        h, n, d = config.hidden_size, config.num_attention_heads, config.head_dim
        init = init_method_normal(config.initializer_range)
        self.qkv = ColumnParallelLinear(h, 3 * h, init_method=init, tp_group=par.tp_group)
        self.dense = RowParallelLinear(h, h, input_is_parallel=True, init_method=init, tp_group=par.tp_group)
        self.num_heads_local = divide(n, self.qkv.tp_world_size, "num_attention_heads")
        self.head_dim = d

    def forward(self, x, attention_mask):
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.num_heads_local, 3, self.head_dim)  # [b, s, n_local, 3, d]
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each [b, n_local, s, d]
        p = self.config.attention_probs_dropout_prob if self.training else 0.0
        with tensor_parallel_rng(p > 0):  # heads are sharded: each rank draws its own heads' masks
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_bias(attention_mask, q.dtype),
                                                 dropout_p=p)  # [b, n_local, s, d]
        out = out.transpose(1, 2).reshape(b, s, -1)  # [b, s, n_local * d]
        return self.dense(out)


class BertMLP(nn.Module):
    """fc2(gelu(fc1 x)) with the exact (erf) GELU; fc1 column-parallel ``[f/tp, h]``, fc2 row-parallel ``[h, f/tp]``."""

    def __init__(self, config: BertConfig, par: ParallelOptions):
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        init = init_method_normal(config.initializer_range)
        self.fc1 = ColumnParallelLinear(h, f, init_method=init, tp_group=par.tp_group)
        self.fc2 = RowParallelLinear(f, h, input_is_parallel=True, init_method=init, tp_group=par.tp_group)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class BertLayer(nn.Module):
    """Post-LayerNorm block: x = LN(x + attn(x)), then x = LN(x + mlp(x)); ``(hidden [b, s, h], mask)`` in and out."""

    def __init__(self, config: BertConfig, par: ParallelOptions, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.attention = BertSelfAttention(config, par)
        self.post_attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = BertMLP(config, par)
        self.post_mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, inputs):
        x, attention_mask = inputs
        p = self.config.hidden_dropout_prob
        x = self.post_attention_norm(x + _dropout(self.attention(x, attention_mask), p, self.training))
        x = self.post_mlp_norm(x + _dropout(self.mlp(x), p, self.training))
        return x, attention_mask


def last_hidden_state(inputs):
    """The encoder's output for ``head=None``: drop the mask, keep ``hidden [b, s, h]``."""
    return inputs[0]


class BertPooler(nn.Module):
    """tanh(W h_[CLS] + b): the hidden state at position 0, ``[b, h]``."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = _linear(config, config.hidden_size, config.hidden_size)

    def forward(self, hidden):
        return torch.tanh(self.dense(hidden[:, 0]))


class BertMLMHead(nn.Module):
    """The MLM transform LN(gelu(W h + b)), ``[b, s, h]``, ready for the tied decoder; with ``nsp`` also the
    next-sentence (or sentence-order) logits from the pooled output: ``(transformed, nsp_logits [b, 2])``."""

    def __init__(self, config: BertConfig, par: ParallelOptions, nsp: bool = False):
        super().__init__()
        self.nsp = nsp
        self.dense = _linear(config, config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if nsp:
            self.pooler = BertPooler(config)
            self.seq_relationship = _linear(config, config.hidden_size, 2)

    def forward(self, inputs):
        hidden, _ = inputs
        x = self.layer_norm(F.gelu(self.dense(hidden)))
        if self.nsp:
            return x, self.seq_relationship(self.pooler(hidden))
        return x


def mlm_decoder(embedding: BertEmbedding, inputs):
    """Tied decoder: transformed ``[b, s, h]`` -> vocab-sharded scores ``[b, s, V/tp]`` with the word embedding
    (no bias yet: :class:`BertMLMBias` adds it). Extra tuple elements (the NSP logits) pass through."""
    x, *rest = inputs if isinstance(inputs, tuple) else (inputs,)
    x = copy_to_tensor_model_parallel_region(x, embedding.par.tp_group)
    logits = F.linear(x, embedding.word_embeddings.weight)
    return (logits, *rest) if rest else logits


class BertMLMBias(nn.Module):
    """The MLM decoder's output bias, vocab-sharded like the logits: ``bias`` is ``[V/tp]`` (zeros at init).

    Its own layer because the decoder weight lives in the tied embedding module, which is also built on the first
    pipeline stage; a parameter of that module which only the last stage used would get no gradient there.
    """

    def __init__(self, config: BertConfig, par: ParallelOptions):
        super().__init__()
        tp = group_rank_and_size(par.tp_group)[1]
        self.bias = nn.Parameter(torch.zeros(divide(config.padded_vocab_size(tp), tp, "padded vocabulary")))
        set_tensor_model_parallel_attributes(self.bias, partition_dim=0)
        self.bias.unpadded_size = config.vocab_size

    def forward(self, inputs):
        logits, *rest = inputs if isinstance(inputs, tuple) else (inputs,)
        logits = logits + self.bias
        return (logits, *rest) if rest else logits


class BertClassificationHead(nn.Module):
    """``(hidden, mask)`` -> ``logits [b, num_labels]`` = classifier(dropout(pooler(hidden)))."""

    def __init__(self, config: BertConfig, par: ParallelOptions):
        super().__init__()
        p = config.classifier_dropout
        self.dropout_p = config.hidden_dropout_prob if p is None else p
        self.pooler = BertPooler(config)
        self.classifier = _linear(config, config.hidden_size, config.num_labels)

    def forward(self, inputs):
        hidden, _ = inputs
        return self.classifier(_dropout(self.pooler(hidden), self.dropout_p, self.training))


def layer_specs(config: BertConfig, par: ParallelOptions | None = None, head: str | None = "mlm") -> list:
    """The model as DeepSpeed layer specs; the TP group is resolved here, once.

    Layer indices (L = num_hidden_layers): 0 the embedding (tied key ``"embed"``), 1..L the ``BertLayer``s, then
    the head: ``None``: L+1 :func:`last_hidden_state`; ``"mlm"``/``"mlm+nsp"``: L+1 ``BertMLMHead``, L+2 the tied
    decoder, L+3 ``BertMLMBias``; ``"classification"``: L+1 ``BertClassificationHead``.
    """
    _check_head(head)
    par = par or ParallelOptions()
    if par.sequence_parallel:
        raise ValueError("BERT does not implement sequence parallelism; set sequence_parallel=False")
    if par.tp_group is None:
        par = ParallelOptions(par.sequence_parallel, get_tensor_model_parallel_group())
    tp = group_rank_and_size(par.tp_group)[1]
    config.check_layout(tp)
    specs = [TiedLayerSpec("embed", BertEmbedding, config, par, tied_weight_attr="word_embeddings_weight"),
             *(LayerSpec(BertLayer, config, par, i) for i in range(config.num_hidden_layers))]
    if head is None:
        return [*specs, last_hidden_state]
    if head == "classification":
        return [*specs, LayerSpec(BertClassificationHead, config, par)]
    return [
        *specs,
        LayerSpec(BertMLMHead, config, par, nsp=head == "mlm+nsp"),
        TiedLayerSpec("embed", BertEmbedding, config, par, forward_fn=mlm_decoder,
                      tied_weight_attr="word_embeddings_weight"),
        LayerSpec(BertMLMBias, config, par),
    ]


CHECKPOINTABLE_LAYERS = ("BertLayer",)


class BertMLMLoss:
    """Mean cross entropy over the masked positions (labels not ``ignore_index``), from vocab-sharded logits;
    for ``"mlm+nsp"`` outputs ``(mlm_logits, nsp_logits)`` and labels ``(mlm_labels, nsp_labels)`` plus the mean
    2-class cross entropy of the NSP/SOP head (the sum, as HF's ``BertForPreTraining``)."""

    def __init__(self, config: BertConfig, tp_group=None, ignore_index: int = -100):
        self.vocab_size, self.ignore_index = config.vocab_size, ignore_index
        self.tp_group = get_tensor_model_parallel_group() if tp_group is None else tp_group

    def __call__(self, outputs, labels):
        nsp_logits = nsp_labels = None
        if isinstance(outputs, (tuple, list)):
            (logits, nsp_logits), (labels, nsp_labels) = outputs, labels
        losses = vocab_parallel_cross_entropy(logits, labels, ignore_index=self.ignore_index,
                                              vocab_size=self.vocab_size, tp_group=self.tp_group)
        loss = losses.sum() / (labels != self.ignore_index).sum().clamp(min=1)
        if nsp_logits is not None:
            loss = loss + F.cross_entropy(nsp_logits.float(), nsp_labels)
        return loss


class BertClassificationLoss:
    """Mean cross entropy over ``num_labels`` classes; mean squared error when ``num_labels == 1`` (regression)."""

    def __init__(self, config: BertConfig):
        self.num_labels = config.num_labels

    def __call__(self, logits, labels):
        if self.num_labels == 1:
            return F.mse_loss(logits.float().squeeze(-1), labels.float())
        return F.cross_entropy(logits.float(), labels)


FAMILIES = {FAMILY: BertConfig, CLASSIFIER_FAMILY: BertConfig}  # zoo.models.registry
