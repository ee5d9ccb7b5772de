"""``hetrain train --config train.toml``: the file's values are the defaults, the command line wins."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

pytest.importorskip("torch")

from factories import make_cluster, make_plan, mlp_digits_profile
from hetrain.runtime.command import add_arguments, main
from hetrain.runtime.config_file import ConfigFileError, load_config_file, named_value, parse_with_config


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetrain train")
    add_arguments(p)
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
    ('steps = "4"\n', ('steps = "4"', "takes an integer, not a string")),
    ('lr = "0.1"\n', ('lr = "0.1"', "takes a number, not a string")),
    ("lr = [0.1]\n", ("lr = [0.1]", "takes a number, not an array")),
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


def test_an_error_names_where_each_value_came_from_the_file_and_key_or_the_flag(tmp_path: Path) -> None:
    (tmp_path / "t.toml").write_text('plan = "plan.json"\nmodel = "gpt-tiny"\nlr = 0.01\nmin_lr = 0.5\nset = ["a=1"]\n')
    args = parse_with_config(parser(), ["--config", str(tmp_path / "t.toml"), "--lr", "0.1", "--set", "b=2"])
    assert named_value(args, "min_lr", "--min-lr") == f"{tmp_path / 't.toml'}: min_lr = 0.5"
    assert named_value(args, "lr", "--lr") == "--lr 0.1"  # the command line overrode the file
    assert named_value(args, "steps", "--steps") == "--steps 100"  # in neither: the default, by its flag
    assert args.model_config == ["a=1", "b=2"]  # --set appends to the file's list, as before
    plain = parse_with_config(parser(), ["--plan", "p.json", "--model", "m", "--min-lr", "0.5"])
    assert named_value(plain, "min_lr", "--min-lr") == "--min-lr 0.5"


def write_plan(path: Path) -> None:
    """mlp-digits on one CPU device, SGD (default learning rate 0.05)."""
    make_plan(make_cluster({"n0": 1}, name="cpu"), mlp_digits_profile(), [(["n0:0"], [0, 3], 8, 2)]).save(path)


@pytest.mark.parametrize("toml, argv, needle", [
    ("min_lr = 1.0\n", [], "{file}: min_lr = 1.0: the minimum learning rate, where the decay ends, must be at most "
                           "the learning rate (sgd's default 0.05)"),
    ("lr = 0.01\nmin_lr = 0.1\n", [], "{file}: min_lr = 0.1: the minimum learning rate, where the decay ends, "
                                       "must be at most the learning rate ({file}: lr = 0.01)"),
    ("lr = 0.01\n", ["--min-lr", "0.1"], "--min-lr 0.1: the minimum learning rate, where the decay ends, must be "
                                          "at most the learning rate ({file}: lr = 0.01)"),
    ("min_lr = 0.5\n", ["--min-lr", "0.6", "--lr", "0.2"], "--min-lr 0.6: the minimum learning rate, where the "
                                                           "decay ends, must be at most the learning rate (--lr 0.2)"),
    ("clip_grad_norm = 1.0\n", [], "{file}: clip_grad_norm = 1.0: gradient clipping by the global norm needs"),
])
def test_a_check_of_two_options_names_the_file_and_key_or_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch, toml: str,
                                                                   argv: list[str], needle: str) -> None:
    write_plan(tmp_path / "plan.json")
    if "clip" in toml:  # clipping needs bsp: make the plan's sync mode another
        text = (tmp_path / "plan.json").read_text().replace('"mode": "bsp"', '"mode": "local-sgd"')
        (tmp_path / "plan.json").write_text(text)
    file = tmp_path / "t.toml"
    file.write_text(f'plan = "{tmp_path / "plan.json"}"\nmodel = "mlp-digits"\n{toml}')
    monkeypatch.delenv("RANK", raising=False)
    assert main(["--config", str(file), *argv]) == 2  # refused before any process group
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and needle.format(file=file) in err, err
