"""Fine-tuning: the training run (``zoo.training.train``) started from a model folder, one module per family.

``gpt.py`` supervised fine-tuning on instruction data (exported as zoo and HF folders), ``bert.py`` sequence
classification (zoo and ``BertForSequenceClassification`` folders), ``unet.py`` segmentation on image/mask folders.
``launch/finetune.py`` picks the module from the ``--init`` folder's family (``zoo.dispatch``). Each command is
``zoo.training.run.command(args, plan, run)``, as launch/train.py is; what the three share among themselves (their
common flags and the run config built from them) is in ``common.py``.
"""
