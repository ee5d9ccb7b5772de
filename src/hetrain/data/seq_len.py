"""The sequence length of a token model: decided once, when it is profiled, and kept by training.

A token model (a reference gpt model, an ``hf:DIR`` model; ``ModelSource.tokens``) or token data
(``--data tokens:FILE`` / ``text:FILE``) runs at ``T`` tokens per sample. Activation bytes and
layer times grow with ``T``, so the plan's memory and time predictions hold only at the ``T``
the profile was measured at::

    hetrain profile --seq-len T  ──► profile.json {"seq_len": T}  ──► plan.json  ──► hetrain train (at T)

- ``hetrain profile``: ``T`` is ``--seq-len``, else the model's default (a gpt model's
  ``seq_len``; an ``hf:DIR`` model has none: its maximum, 1024 or more, is far too long to
  default to), else a user data set's sample length; at most the model's maximum positions.
  The profile records the ``T`` its inputs had (``measured_seq_len``).
- ``hetrain train``: ``T`` is the plan's profile's (``train_seq_len``); a different
  ``--seq-len``, or a user data set of other sample lengths, is refused: re-profile and re-plan.
  A profile that does not say (written before, or by hand) leaves ``T`` to ``--seq-len`` as before.

Example:
    >>> source = resolve_model("gpt-tiny")                   # doctest: +SKIP
    >>> choose_seq_len(source, None), choose_seq_len(source, 16)   # doctest: +SKIP
    (64, 16)
    >>> train_seq_len(128, 256)                               # doctest: +SKIP
    Traceback (most recent call last):
    hetrain.models.spec.SpecError: --seq-len 256 differs from the plan's profile (measured at 128); ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hetrain.data.tokens import is_token_spec
from hetrain.models.spec import SpecError
from hetrain.models.user import ModelSource


def is_token_run(model: ModelSource, data: str | None) -> bool:
    """Whether ``model`` on ``data`` takes token ids ``(B, T)``: a token model, or token data."""
    return model.tokens is not None or is_token_spec(data)


def refuse_seq_len(model: ModelSource, data: str | None, seq_len: int | None) -> None:
    """Refuse ``--seq-len`` for a run that has no sequence length (neither a token model nor token data)."""
    if seq_len is not None and not is_token_run(model, data):
        given = f"--data {data} is not token data" if data else "no token data is given"
        raise SpecError(f"--seq-len {seq_len}: model {model.name} is not a token model (a gpt model or hf:DIR) and "
                        f"{given} (--data tokens:FILE or text:FILE); it has no sequence length")


def choose_seq_len(model: ModelSource, seq_len: int | None) -> int:
    """The tokens per sample ``model`` runs at: ``seq_len`` if given, else its default; checked against its maximum.

    A model that is not a token model (a user's own, on token data) has no default: ``seq_len`` must be given.

    Raises:
        SpecError: no length given where there is no default, or one longer than the model's maximum
            positions (naming its config field and value).
    """
    limits = model.tokens
    if limits is None:
        if seq_len is None:
            raise SpecError(f"model {model.name} is your own: give --seq-len T, the tokens per sample it takes, to "
                            "cut token data into windows")
        return seq_len
    if seq_len is None:
        if limits.default_seq_len is None:
            raise SpecError(f"model {model.name}: give --seq-len T, the tokens per sample to run it at (at most its "
                            f"{limits.field} {limits.max_positions})")
        return limits.default_seq_len
    if seq_len > limits.max_positions:
        hint = f" (--set seq_len={seq_len})" if model.preset is not None else ""
        raise SpecError(f"--seq-len {seq_len} is longer than model {model.name}'s {limits.field} "
                        f"{limits.max_positions}{hint}")
    return seq_len


def random_token_inputs(model: ModelSource, seq_len: int | None, seed: int = 0) -> Callable[[int], torch.Tensor]:
    """``b -> (b, T)`` random token ids below the model's vocabulary (profiling a token model without data)."""
    assert model.tokens is not None, "a token model"
    t, vocab = choose_seq_len(model, seq_len), model.tokens.vocab
    generator = torch.Generator().manual_seed(seed)
    return lambda b: torch.randint(0, vocab, (b, t), generator=generator)  # (b, T)


def sample_length(data_name: str, train: Any) -> int:
    """Tokens per sample of a user's data set fed to a token model: ``T`` of its inputs ``(B, T)``.

    Raises:
        SpecError: inputs that are not ``(B, T)`` token ids.
    """
    x = train.take(torch.arange(1))[0]  # (1, T)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise SpecError(f"--data {data_name}: a token model takes token ids (B, T); a batch of one sample is {shape}")
    return int(x.shape[1])


def check_sample_length(model: ModelSource, data_name: str, train: Any, seq_len: int | None,
                        from_profile: bool) -> None:
    """Refuse a user's data set whose samples are not ``seq_len`` tokens long, for a token model.

    ``from_profile``: ``seq_len`` is the plan's profile's (else ``--seq-len``). Nothing is checked for
    a model that is not a token model, or where ``seq_len`` is None.
    """
    if model.tokens is None or seq_len is None:
        return
    got = sample_length(data_name, train)
    if got == seq_len:
        return
    if from_profile:
        raise SpecError(f"--data {data_name}: samples of {got} tokens, but the plan's profile was measured at "
                        f"{seq_len}; re-profile with hetrain profile --data {data_name} and re-plan")
    raise SpecError(f"--data {data_name}: samples of {got} tokens, not --seq-len {seq_len}")


def measured_seq_len(model: ModelSource, data: str | None, inputs: Callable[[int], Any]) -> int | None:
    """The tokens per sample of the inputs a token run is profiled on (``T`` of ``inputs(1)``); None for other runs."""
    if not is_token_run(model, data):
        return None
    x = inputs(1)  # (1, T)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise SpecError(f"model {model.name}: a token model takes token ids (B, T); its input for one sample is "
                        f"{shape}")
    return int(x.shape[1])


def train_seq_len(profile_seq_len: int | None, given: int | None) -> int | None:
    """The tokens per sample to train at: the plan's profile's, which ``--seq-len`` (``given``) may only repeat.

    Raises:
        SpecError: ``given`` differs from a length the profile recorded.
    """
    if given is not None and profile_seq_len is not None and given != profile_seq_len:
        raise SpecError(f"--seq-len {given} differs from the plan's profile (measured at {profile_seq_len}); "
                        f"re-profile with hetrain profile --seq-len {given} and re-plan")
    return given if given is not None else profile_seq_len


__all__ = ["check_sample_length", "choose_seq_len", "is_token_run", "measured_seq_len",
           "random_token_inputs", "refuse_seq_len", "sample_length", "train_seq_len"]
