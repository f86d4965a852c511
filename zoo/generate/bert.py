"""A zoo BERT folder as one plain module: :class:`PretrainedBert` (one process, tp=1, no process group).

    model = PretrainedBert.from_pretrained("runs/bert-cls/model")     # or zoo.load_model(folder)
    batch = model.tokenizer(["a good film"], return_tensors="pt")
    logits = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])

The head is the folder's (``zoo.convert.bert.zoo_bert_config``: the ``"head"`` key of its config, or what its
tensors hold), so the output is what the folder was trained for; BERT generates no text, and its fine-tuning commands
are ``launch/finetune.py`` (classification) and ``launch/train.py --config configs/bert/tiny.yaml`` (pretraining).
"""

from __future__ import annotations

import json
import os

import torch

from zoo.convert import io
from zoo.models.bert import CLASSIFIER_FAMILY, FAMILY
from zoo.models.specs import SpecSequential


class PretrainedBert(SpecSequential):
    """A zoo ``bert`` or ``bert-classifier`` folder in one process: the same layers and names as in training.

    ``model(input_ids [b, s], token_type_ids=None, attention_mask=None)`` (defaults: one segment, no padding) gives,
    by ``.head``: None, the last hidden state ``[b, s, h]``; ``"mlm"``, the masked-LM logits ``[b, s, vocab_size]``;
    ``"mlm+nsp"``, those and the next-sentence logits ``[b, 2]``; ``"classification"``, ``[b, num_labels]`` (the
    label names, when the folder has them, in ``.labels``).
    """

    def __init__(self, config, head: str | None, tokenizer=None, labels: list[str] | None = None):
        from zoo.models.bert import layer_specs
        from zoo.models.gpt import ParallelOptions

        super().__init__(layer_specs(config, ParallelOptions(), head=head))
        self.config, self.head, self.tokenizer, self.labels = config, head, tokenizer, labels

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, *, device=None,
                        dtype: torch.dtype = torch.float32) -> PretrainedBert:
        """Load a zoo BERT folder (or a run folder with ``model/``) on ``device`` (default CPU), in eval mode, with
        the folder's tokenizer as ``.tokenizer`` (None without tokenizer files)."""
        from zoo.convert.bert import LABELS_FILE, zoo_bert_config
        from zoo.data.tokenizer import TOKENIZER_FILES, load_tokenizer

        folder = io.resolve_model_folder(folder)
        try:
            _, config, head = zoo_bert_config(folder)  # its errors name the folder
        except ValueError as e:
            raise io.CheckpointError(str(e)) from None
        try:
            labels = None
            if (folder / LABELS_FILE).is_file():
                id2label = json.loads((folder / LABELS_FILE).read_text()).get("id2label") or {}
                labels = [id2label[str(i)] for i in range(len(id2label))] or None
            tokenizer = load_tokenizer(folder) if any((folder / n).is_file() for n in TOKENIZER_FILES) else None
            model = cls(config, head, tokenizer, labels)
        except (ValueError, KeyError) as e:  # labels.json, the tokenizer, the config's values
            raise io.CheckpointError(f"{folder}: {e}") from None
        io.load_model(folder, model)
        return model.to(device=device or "cpu", dtype=dtype).eval()

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None):
        token_type_ids = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        out = super().forward((input_ids, token_type_ids, attention_mask.long()))
        if self.head in ("mlm", "mlm+nsp"):  # cut the vocabulary padding off the MLM logits
            v = self.config.vocab_size
            return (out[0][..., :v], *out[1:]) if isinstance(out, tuple) else out[..., :v]
        return out


# zoo.generate's tables: the class load_model returns; no generate command (a BERT generates no text), so
# launch/generate.py gives these folders to the GPT's, which refuses them in one line.
PRETRAINED = {FAMILY: PretrainedBert, CLASSIFIER_FAMILY: PretrainedBert}
COMMANDS = {FAMILY: None, CLASSIFIER_FAMILY: None}
