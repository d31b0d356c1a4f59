import pytest

from meshscope.config import ConfigError, load_config


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('nproc = 2\n[train]\nsteps = 7\ncompression = "fp16"\n')
    cfg = load_config(path, {"train": {"steps": 9}})
    assert (cfg.nproc, cfg.train.steps, cfg.train.compression) == (2, 9, "fp16")


@pytest.mark.parametrize(
    "text, field",
    [
        ("[train]\nsteps = 0\n", "train.steps"),
        ('[train]\ncompression = "zip"\n', "train.compression"),
        ("[model]\nexperts = 2\ntop_k = 3\n", "model.top_k"),
        ("[model]\nd_model = 30\nheads = 4\n", "model.heads"),
        ("[model]\nlayerz = 3\n", "model.layerz"),
        ("metrics_port = 70000\n", "metrics_port"),
    ],
)
def test_bad_value_names_the_field(tmp_path, text, field):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(path)


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_hierarchical_takes_only_compressions_of_its_inter_node_hop():
    import pytest
    from pydantic import ValidationError

    from meshscope.trainer.config import TrainerConfig

    TrainerConfig(train={"hierarchical": True, "compression": "fp16"})
    with pytest.raises(ValidationError, match="hierarchical: compresses the inter-node hop"):
        TrainerConfig(train={"hierarchical": True, "compression": "powersgd"})


def test_a_stream_hang_needs_a_device_with_a_stream():
    import pytest
    from pydantic import ValidationError

    from meshscope.trainer.config import TrainerConfig

    TrainerConfig(device="sim", inject=["stream_hang@step=3,rank=1"])
    with pytest.raises(ValidationError, match="needs --device sim"):
        TrainerConfig(device="cpu", inject=["stream_hang@step=3,rank=1"])
