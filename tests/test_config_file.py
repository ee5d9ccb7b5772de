"""``hetrain train --config train.toml``: the file's values are the defaults, the command line wins."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

pytest.importorskip("torch")

from factories import make_cluster, make_plan, mlp_digits_profile
from hetrain.options import ConfigFileError, load_options_file
from hetrain.runtime.command import add_arguments, main
from hetrain.runtime.config import OptimConfig, TrainConfig, train_config_from_args


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetrain train")
    add_arguments(p)
    return p


def parse(argv: list[str]) -> TrainConfig:
    return train_config_from_args(parser().parse_args(argv))


def load_config_file(path: str) -> dict[str, object]:
    return dict(load_options_file(path, TrainConfig, "hetrain train").values)


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
    c = parse(["--config", str(tmp_path / "train.toml"), "--steps", "10", "--lr", "0.01"])
    assert (c.plan, c.model, c.data.data) == ("plan.json", "gpt-tiny", "tokens:train.bin")
    assert c.steps == 10 and c.optim.lr == 0.01  # the command line wins
    assert c.optim.lr_schedule == "cosine" and c.optim.warmup_steps == 100  # `-` and `_` both name the option
    assert c.logging.progress is False and c.model_config == ("n_blocks=2",)
    alone = parse(["--config", str(tmp_path / "train.toml")])
    assert alone.steps == 2000 and alone.optim.lr == 3e-4
    flag = parse(["--config", str(tmp_path / "train.toml"), "--progress"])
    assert flag.logging.progress is True


def test_without_a_config_file_the_required_options_stay_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "gpt-tiny"]) == 2
    err = capsys.readouterr().err
    assert "required: --plan" in err and err.count("\n") == 1, err


def test_every_option_is_one_field_flag_key_and_help() -> None:
    """The flags, the file's keys and the help all come from TrainConfig's fields: each field has a flag with
    help text, and a value refused on the command line is refused in Python with the key named."""
    from hetrain.options import leaves

    help_text = parser().format_help()
    for leaf in leaves(TrainConfig):
        assert leaf.flag in help_text and leaf.help, leaf.key
    assert "--min-lr" in help_text and "--set" in help_text and "--no-progress" in help_text
    with pytest.raises(ValueError, match=r"TrainConfig: steps = -1: expected an integer >= 0"):
        TrainConfig(steps=-1)
    with pytest.raises(ValueError, match=r"OptimConfig: lr = '0.1': takes float, not str"):
        OptimConfig(lr="0.1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"model settings are KEY=VALUE, got 'n_blocks'"):
        TrainConfig(model_config=("n_blocks",))
    assert TrainConfig(model_config=("n_blocks=2", "act=gelu")).model_settings() == {"n_blocks": 2, "act": "gelu"}


def test_a_file_in_sections_gives_the_same_config_as_a_flat_one(tmp_path: Path) -> None:
    """``[optim]`` / ``[logging]`` tables name the same options as flat keys; an option of another section, or
    one given twice, is refused naming it."""
    (tmp_path / "flat.toml").write_text(CONFIG)
    (tmp_path / "tree.toml").write_text('plan = "plan.json"\nmodel = "gpt-tiny"\nsteps = 2000\nset = ["n_blocks=2"]\n'
                                        '[data]\ndata = "tokens:train.bin"\n'
                                        '[optim]\nlr = 3e-4\nlr-schedule = "cosine"\nwarmup_steps = 100\n'
                                        '[logging]\nprogress = false\n')
    flat, tree = parse(["--config", str(tmp_path / "flat.toml")]), parse(["--config", str(tmp_path / "tree.toml")])
    assert flat == tree and tree.optim.lr == 3e-4 and tree.data.data == "tokens:train.bin"
    (tmp_path / "bad.toml").write_text("[optim]\nlog_every = 5\n")
    with pytest.raises(ConfigFileError, match=r"unknown key 'optim\.log_every'"):
        load_config_file(str(tmp_path / "bad.toml"))
    (tmp_path / "twice.toml").write_text("lr = 0.1\n[optim]\nlr = 0.2\n")
    with pytest.raises(ConfigFileError, match=r"optim\.lr = 0\.2: lr is given twice"):
        load_config_file(str(tmp_path / "twice.toml"))


def test_a_config_written_for_the_old_reader_still_loads(tmp_path: Path) -> None:
    """Every key the old reader took (each long option name) is a key of the new one, with the same value."""
    old_keys = ("plan", "model", "data", "val_data", "tokenizer", "seq_len", "steps", "checkpoint_dir",
                "checkpoint_every", "timeline_out", "metrics_out", "tensorboard_dir", "log_every", "timeout_s", "lr",
                "lr_schedule", "warmup_steps", "min_lr", "clip_grad_norm", "weight_decay", "precision", "replan",
                "drift_threshold", "drift_window", "replan_cooldown", "force_drift", "seed", "data_seed", "set",
                "eval_every", "eval_batches", "progress")
    from hetrain.options import leaves

    assert sorted(leaf.key for leaf in leaves(TrainConfig)) == sorted(old_keys)


def test_a_table_of_model_settings_is_set_items(tmp_path: Path) -> None:
    (tmp_path / "t.toml").write_text('set = {n_blocks = 2, hidden = 64}\n')
    assert load_config_file(str(tmp_path / "t.toml")) == {"set": ("n_blocks=2", "hidden=64")}


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
        load_config_file(str(tmp_path / "t.toml"))
    message = str(err.value)
    assert str(tmp_path / "t.toml") in message and "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_an_error_names_where_each_value_came_from_the_file_and_key_or_the_flag(tmp_path: Path) -> None:
    (tmp_path / "t.toml").write_text('plan = "plan.json"\nmodel = "gpt-tiny"\nlr = 0.01\nmin_lr = 0.5\nset = ["a=1"]\n')
    c = parse(["--config", str(tmp_path / "t.toml"), "--lr", "0.1", "--set", "b=2"])
    assert c.name_of("min_lr", c.optim.min_lr) == f"{tmp_path / 't.toml'}: min_lr = 0.5"
    assert c.name_of("lr", c.optim.lr) == "--lr 0.1"  # the command line overrode the file
    assert c.name_of("steps", c.steps) == "--steps 100"  # in neither: the default, by its flag
    assert c.model_config == ("a=1", "b=2")  # --set appends to the file's list, as before
    plain = parse(["--plan", "p.json", "--model", "m", "--min-lr", "0.5"])
    assert plain.name_of("min_lr", plain.optim.min_lr) == "--min-lr 0.5"


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
