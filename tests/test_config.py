"""Typed, strict configuration: presets, overrides, round trip, validation messages."""

import pytest

from shardtrain import config
from shardtrain.config import ConfigError


def test_presets_load_and_validate():
    for name in ("default", "tiny"):
        cfg = config.load(name)
        cfg.validate(1)
        cfg.validate(2)
    for name in ("gpt3-175b", "llama3-8b", "llama3-70b", "llama3-405b"):
        config.load(name).model.validate()


def test_presets_are_package_data_listed_in_help_and_errors(capsys):
    """The presets ship inside the package (read through importlib.resources), so a
    non-editable install finds them (.ci/wheel_check installs a wheel and trains with one)."""
    from importlib import resources

    from shardtrain.cli import main

    names = config.preset_names()
    assert {"default", "tiny", "finetune", "gpt3-175b", "llama3-8b"} <= set(names)
    assert (resources.files("shardtrain") / "configs" / "tiny.toml").is_file()
    with pytest.raises(ConfigError, match="one of the presets: " + ", ".join(names)):
        config.load("tinyy")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert ", ".join(names) in " ".join(capsys.readouterr().out.split())


def test_overrides_are_typed():
    cfg = config.load("tiny", ["--train.steps", "7", "--train.lr=0.5", "--train.progress", "true",
                               "--model.style", "gpt2"])
    assert (cfg.train.steps, cfg.train.lr, cfg.train.progress, cfg.model.style) == (7, 0.5, True, "gpt2")


@pytest.mark.parametrize("args, needle", [
    (["--train.stepz", "3"], "unknown field in [train] 'stepz'; did you mean 'steps'"),
    (["--trian.steps", "3"], "unknown config section 'trian'"),
    (["--train.steps", "x"], "train.steps='x' is not a valid int"),
    (["--train.steps", "2.5"], "train.steps='2.5' is not a valid int"),
    (["--train.precision", "fp8"], "train.precision='fp8' is not one of fp32, bf16"),
    (["--train.progress", "maybe"], "train.progress='maybe' is not a boolean"),
    (["--train.steps"], "override --train.steps has no value"),
    (["steps"], "unexpected argument 'steps'"),
])
def test_bad_overrides_name_the_field(args, needle):
    with pytest.raises(ConfigError, match=None) as e:
        config.load("tiny", args)
    assert needle in str(e.value)


def test_unknown_key_in_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model]\ndimm = 3\n")
    with pytest.raises(ConfigError, match="unknown field in \\[model\\] 'dimm'; did you mean 'dim'"):
        config.load(path)
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "missing.toml")


def test_round_trip_through_toml():
    cfg = config.load("tiny", ["--train.sample_prompt", 'say "hi"\n', "--optim.name", "sgd"])
    assert config.loads(config.to_toml(cfg)) == cfg


@pytest.mark.parametrize("args, world, needle", [
    (["--parallel.dp", "3"], 2, "dp=3 x tp=1 x pp=1 x cp=1 = 3 does not equal the world size 2"),
    (["--model.n_kv_heads", "3"], 1, "model.n_heads=4 is not divisible by model.n_kv_heads=3"),
    (["--train.global_batch", "7"], 2, "train.global_batch=7 is not divisible by train.micro_batch=2 x dp=2"),
    (["--parallel.ep", "2"], 2, "parallel.ep=2 splits a mixture of experts, but model.n_experts=0"),
    (["--parallel.tp", "3"], 3, "model.n_heads=4 is not divisible by parallel.tp=3"),
    (["--parallel.tp", "4", "--model.n_heads", "12", "--model.n_kv_heads", "6",
      "--model.dim", "96"], 4, "model.n_kv_heads=6 does not fit parallel.tp=4"),
    (["--parallel.tp", "4", "--model.n_heads", "12", "--model.n_kv_heads", "3",
      "--model.dim", "96"], 4, "model.n_kv_heads=3 does not fit parallel.tp=4"),
    (["--parallel.sp", "true"], 2, "parallel.sp=true needs parallel.tp > 1"),
    (["--parallel.tp", "2", "--parallel.sp", "true", "--train.seq_len", "31"], 2,
     "train.seq_len=31 is not divisible by parallel.tp=2"),
    (["--parallel.tp", "2", "--model.n_experts", "4", "--parallel.ep", "2"], 2,
     "parallel.ep=2 must divide dp x cp = 1"),
    (["--train.seq_len", "1000"], 1, "train.seq_len=1000 exceeds model.max_seq_len=64"),
    (["--model.vocab_size", "100"], 1, "model.vocab_size=100 is below 256"),
])
def test_validate_names_field_and_fix(args, world, needle):
    with pytest.raises(ConfigError) as e:
        config.load("tiny", args).validate(world)
    assert needle in str(e.value)


def test_tensor_parallel_layouts_validate():
    for args in (["--parallel.tp", "2", "--parallel.sp", "true"],  # kv heads split
                 ["--parallel.tp", "4"]):  # 2 kv heads for 4 ranks: each shared by 2
        config.load("tiny", args).validate(4)


def test_tp_wider_than_a_node_warns_with_the_reason():
    cfg = config.load("tiny", ["--parallel.tp", "4", "--parallel.node_size", "2"])
    with pytest.warns(UserWarning, match="parallel.tp=4 is larger than parallel.node_size=2: "
                      "tensor-parallel groups then span nodes"):
        cfg.validate(4)

