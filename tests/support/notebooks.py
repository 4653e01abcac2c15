"""Notebook cells as tests write them (plain source strings), and the cells several test
modules write the same way.

A user brings a Hugging Face model, dataset and ``TrainingArguments`` built in one cell and
trains them in the taas cell; the kernel tests, the metrics tests and the GPU suite all start
from that same notebook cell.  Nothing here imports jupyter_client or IPython (the GPU machine
has neither): these are strings.
"""

from __future__ import annotations

import re
import textwrap

# No downloads: Hugging Face libraries in the kernel and its ranks (which inherit it) stay offline.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def cell(text: str) -> str:
    """A cell's source written indented inside a test."""
    return textwrap.dedent(text).strip("\n")


def plain(text: str) -> str:
    """``text`` without terminal colours (IPython colours tracebacks)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def tiny_bert_notebook(output_dir: str, **training_args: object) -> str:
    """A notebook cell that builds a tiny random BERT classifier (``model``), a 32-example
    synthetic dataset (``ds``) and ``TrainingArguments`` (``args``: 4 steps of 4 examples, no
    reports, no checkpoints; ``training_args`` add to or replace these), as a user writes it
    before a taas cell."""
    settings = dict(max_steps=4, per_device_train_batch_size=4, report_to=[], save_strategy="no")
    settings.update(training_args)
    given = "".join(f", {name}={value!r}" for name, value in settings.items())
    return textwrap.dedent("""\
        import torch
        from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
        torch.manual_seed(0)
        config = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32, max_position_embeddings=16, num_labels=2)
        model = BertForSequenceClassification(config)
        class Synthetic(torch.utils.data.Dataset):
            def __len__(self):
                return 32
            def __getitem__(self, i):
                g = torch.Generator().manual_seed(i)
                return {"input_ids": torch.randint(0, 32, (8,), generator=g), "labels": i % 2}
        ds = Synthetic()
        """) + f"args = TrainingArguments(output_dir={output_dir!r}{given})\n"
