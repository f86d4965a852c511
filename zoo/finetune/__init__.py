"""Fine-tuning: the training run (``zoo.training.trainer.Trainer``) started from a model folder, one module per family.

``gpt.py`` supervised fine-tuning on instruction data (exported as zoo and HF folders), ``bert.py`` sequence
classification (zoo and ``BertForSequenceClassification`` folders), ``unet.py`` segmentation on image/mask folders.
``launch/finetune.py`` picks the module from the ``--init`` folder's family (``zoo.dispatch``). Each command is
``zoo.training.run.command(args, plan, run)``, as launch/train.py is; what the three share among themselves (their
common flags and the run config built from them) is in ``common.py``.

``COMMANDS`` (``zoo.models.registry.Registry``) maps each family to the ``main`` of its fine-tune command, or None
where it has none; each module here declares the families it fine-tunes.
"""

from __future__ import annotations

from zoo.models.registry import Registry

# one line per module declaring families
COMMANDS = Registry("fine-tune command of family", ("zoo.finetune.gpt", "zoo.finetune.bert", "zoo.finetune.unet"),
                    "COMMANDS")


def command_of(family: str | None):
    """The ``main`` of ``launch/finetune.py`` for an ``--init`` folder of ``family`` (None: not told): the family's
    own command, else the GPT's instruction tuning, which reads any HF causal LM and refuses other families in one
    line."""
    from zoo.models.gpt import FAMILY as DEFAULT

    return COMMANDS.get(family) or COMMANDS[DEFAULT]
