"""Data sets by name, matched to a model: ``shakespeare``, ``digits``, ``synthetic``.

| name        | what                                         | fits                                   |
| ----------- | -------------------------------------------- | -------------------------------------- |
| shakespeare | six plays, character level (``data.text``)   | GPT models with vocab 96 (gpt-tiny)    |
| digits      | 1,797 8x8 images, 10 classes (``data.digits``) | image models of input (1, 8, 8), 10 classes |
| synthetic   | random tensors of the model's shapes         | every model                            |

Example:
    >>> default_data("gpt-tiny"), default_data("gpt2-small")
    ('shakespeare', 'synthetic')
    >>> train, val = build_datasets("shakespeare", "gpt-tiny")
"""

from __future__ import annotations

from typing import Any

from hetrain.data.datasets import DatasetSplit, build_synthetic_dataset
from hetrain.data.digits import IMAGE_SHAPE, NUM_CLASSES, load_digits_dataset
from hetrain.data.text import VOCAB_SIZE, load_text_datasets
from hetrain.models.gpt import GPTConfig
from hetrain.models.registry import get_spec, input_shape

DATA_NAMES = ("shakespeare", "digits", "synthetic")


def _fit_error(data_name: str, model_name: str, **config: Any) -> str | None:
    """Why ``data_name`` cannot feed ``model_name``, or None when it can."""
    spec = get_spec(model_name, **config)
    c = spec.config
    if data_name == "shakespeare":
        if not isinstance(c, GPTConfig):
            return f"shakespeare is text for GPT models; {model_name!r} is a {spec.kind} model"
        if c.vocab != VOCAB_SIZE:
            return f"shakespeare needs a vocab of {VOCAB_SIZE} characters; {model_name!r} has vocab {c.vocab}"
    elif data_name == "digits":
        if isinstance(c, GPTConfig):
            return f"digits are images; {model_name!r} is a GPT model"
        shape = input_shape(model_name, **config)
        if shape != IMAGE_SHAPE or c.classes != NUM_CLASSES:
            return (f"digits are {IMAGE_SHAPE} images of {NUM_CLASSES} classes; "
                    f"{model_name!r} takes {shape} with {c.classes} classes")
    elif data_name != "synthetic":
        return f"unknown data set {data_name!r}; known: {', '.join(DATA_NAMES)}"
    return None


def default_data(model_name: str, **config: Any) -> str:
    """The real data set that fits ``model_name``, else ``"synthetic"``."""
    for name in DATA_NAMES:
        if _fit_error(name, model_name, **config) is None:
            return name
    return "synthetic"


def build_datasets(data_name: str, model_name: str, seed: int = 0, synthetic_samples: int = 1024,
                   **config: Any) -> DatasetSplit:
    """Training and validation sets of ``data_name`` shaped for ``model_name``.

    ``seed`` fixes the digits' split and the synthetic samples; the text split
    is fixed. Synthetic data has ``synthetic_samples`` training samples and a
    quarter as many validation samples.

    Raises:
        ValueError: unknown data set, or one that does not fit the model (the
            message says why, with the shapes).
    """
    error = _fit_error(data_name, model_name, **config)
    if error:
        raise ValueError(error)
    if data_name == "shakespeare":
        c = get_spec(model_name, **config).config
        assert isinstance(c, GPTConfig)
        return load_text_datasets(seq_len=c.seq_len)
    if data_name == "digits":
        return load_digits_dataset(seed=seed)
    n_val = max(1, synthetic_samples // 4)
    return DatasetSplit(build_synthetic_dataset(model_name, synthetic_samples, seed, **config),
                        build_synthetic_dataset(model_name, n_val, seed + 1_000_003, **config))
