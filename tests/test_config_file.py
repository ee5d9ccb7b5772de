"""``hetrain train --config train.toml``: the file's values are the defaults, the command line wins."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hetrain.runtime.command import add_train_arguments
from hetrain.runtime.config_file import ConfigFileError, load_config_file, parse_with_config


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetrain train")
    add_train_arguments(p)
    return p


CONFIG = """
plan = "plan.json"
model = "gpt-tiny"
data = "tokens:train.bin"
steps = 2000
lr = 3e-4
lr-schedule = "cosine"
warmup_steps = 100
progress = false
set = ["n_blocks=2"]
"""


def test_the_file_gives_every_option_and_the_command_line_overrides_it(tmp_path: Path) -> None:
    (tmp_path / "train.toml").write_text(CONFIG)
    args = parse_with_config(parser(), ["--config", str(tmp_path / "train.toml"), "--steps", "10", "--lr", "0.01"])
    assert (args.plan, args.model, args.data) == ("plan.json", "gpt-tiny", "tokens:train.bin")
    assert args.steps == 10 and args.lr == 0.01  # the command line wins
    assert args.lr_schedule == "cosine" and args.warmup_steps == 100  # `-` and `_` both name the option
    assert args.progress is False and args.model_config == ["n_blocks=2"]
    alone = parse_with_config(parser(), ["--config", str(tmp_path / "train.toml")])
    assert alone.steps == 2000 and alone.lr == 3e-4
    flag = parse_with_config(parser(), ["--config", str(tmp_path / "train.toml"), "--progress"])
    assert flag.progress is True


def test_without_a_config_file_the_required_options_stay_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_with_config(parser(), ["--model", "gpt-tiny"])
    assert "--plan" in capsys.readouterr().err


def test_a_table_of_model_settings_is_set_items(tmp_path: Path) -> None:
    (tmp_path / "t.toml").write_text('set = {n_blocks = 2, hidden = 64}\n')
    assert load_config_file(str(tmp_path / "t.toml"), parser()) == {"model_config": ["n_blocks=2", "hidden=64"]}


@pytest.mark.parametrize("text, needles", [
    ("steps = -1\n", ("steps = -1",)),
    ("steps = 1.5\n", ("steps = 1.5",)),
    ("eval_every = true\n", ("eval_every = true",)),
    ("model = 3\n", ("model = 3", "string")),
    ("no_such_option = 1\n", ("unknown key 'no_such_option'",)),
    ("config = 'other.toml'\n", ("unknown key 'config'",)),
    ("clip_grad_norm = [1]\n", ("clip_grad_norm = [1]",)),
])
def test_a_bad_key_or_value_names_the_file_key_and_value(tmp_path: Path, text: str, needles: tuple[str, ...]) -> None:
    (tmp_path / "t.toml").write_text(text)
    with pytest.raises(ConfigFileError) as err:
        load_config_file(str(tmp_path / "t.toml"), parser())
    message = str(err.value)
    assert str(tmp_path / "t.toml") in message and "\n" not in message
    for needle in needles:
        assert needle in message, message
