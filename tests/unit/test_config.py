"""Config validation: unknown fields, inconsistent parallelism, SFT without data, YAML errors name the source."""

import pytest

from rlpipe.config import PipelineConfig, load_config, parse_override
from rlpipe.errors import ConfigError


def test_defaults_validate_and_round_trip_json():
    cfg = PipelineConfig()
    assert PipelineConfig.model_validate_json(cfg.model_dump_json()) == cfg


def test_unknown_field_is_rejected_with_its_path(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 0.1\n  learning_rat: 3\n")
    with pytest.raises(ConfigError, match=r"c\.yaml.*train\.learning_rat"):
        load_config(path)


def test_prompts_per_step_must_split_over_the_ranks():
    with pytest.raises(ConfigError, match="multiple of the data-parallel size"):
        load_config(overrides={"train.world_size": 3})


def test_sft_enabled_without_any_data():
    with pytest.raises(ConfigError, match="sft.enabled needs"):
        load_config(overrides={"sft.enabled": True, "data.task": None, "data.path": "x.parquet"})


def test_grpo_with_group_of_one():
    with pytest.raises(ConfigError, match="rollout.n >= 2"):
        load_config(overrides={"rollout.n": 1})


def test_negative_learning_rate():
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(overrides={"train.lr": -1e-3})


def test_bad_yaml_names_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml is not valid YAML"):
        load_config(path)


def test_top_level_must_be_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)


def test_overrides_parse_yaml_values():
    assert parse_override("train.lr=1e-4") == ("train.lr", 1e-4)
    assert parse_override("sft.enabled=true") == ("sft.enabled", True)
    cfg = load_config(overrides=dict([parse_override("rollout.n=4"), parse_override("experiment=x")]))
    assert cfg.rollout.n == 4 and cfg.experiment == "x"
    with pytest.raises(ConfigError):
        parse_override("no-equals-sign")


def test_unsynced_openai_server_must_be_declared_off_policy():
    with pytest.raises(ConfigError, match=r"off-policy.*algo\.rollout_is\.enabled"):
        load_config(overrides={"rollout.engine": "openai", "rollout.server_url": "http://x:8000"})
    cfg = load_config(
        overrides={"rollout.engine": "openai", "rollout.server_url": "http://x:8000", "algo.rollout_is.enabled": True}
    )
    assert cfg.rollout.engine == "openai"


def test_server_engines_validate_their_settings():
    with pytest.raises(ConfigError, match="engine=sglang needs rollout.server_url"):
        load_config(overrides={"rollout.engine": "sglang"})
    with pytest.raises(ConfigError, match="nccl is vLLM's"):
        load_config(
            overrides={
                "rollout.engine": "sglang",
                "rollout.server_url": "http://x",
                "rollout.weight_sync.method": "nccl",
            }
        )
    with pytest.raises(ConfigError, match="max_model_len=16 is shorter"):
        load_config(overrides={"rollout.engine": "vllm", "rollout.vllm.max_model_len": 16})
    assert load_config(overrides={"rollout.engine": "vllm"}).rollout.weight_sync.method == "disk"


def test_engine_replicas_are_managed_or_listed_never_both():
    vllm = {"rollout.engine": "vllm"}
    with pytest.raises(ConfigError, match="either server_url or server_urls"):
        load_config(overrides={**vllm, "rollout.server_url": "http://a", "rollout.server_urls": ["http://b"]})
    with pytest.raises(ConfigError, match="replicas > 1 starts managed"):
        load_config(overrides={**vllm, "rollout.vllm.replicas": 2, "rollout.server_urls": ["http://a", "http://b"]})
    with pytest.raises(ConfigError, match="server_urls is for synced engines"):
        load_config(overrides={"rollout.engine": "openai", "rollout.server_url": "http://a",
                               "rollout.server_urls": ["http://b"], "algo.rollout_is.enabled": True})  # fmt: skip
    with pytest.raises(ConfigError, match="managed replicas need a GPU each"):
        load_config(overrides={**vllm, "rollout.vllm.replicas": 2, "rollout.weight_sync.method": "nccl"})
    on_gpus = {**vllm, "rollout.vllm.replicas": 2, "rollout.vllm.resources": {"GPU": 1}, "rollout.weight_sync.method":
               "nccl"}  # fmt: skip
    assert load_config(overrides=on_gpus).rollout.weight_sync.method == "nccl"  # one group for both replicas
    two_urls = load_config(overrides={**vllm, "rollout.server_urls": ["http://a", "http://b"],
                                      "rollout.weight_sync.method": "nccl"})  # fmt: skip
    assert two_urls.rollout.server_urls == ["http://a", "http://b"]
    sglang = load_config(overrides={"rollout.engine": "sglang", "rollout.server_urls": ["http://a", "http://b"]})
    assert sglang.rollout.server_urls == ["http://a", "http://b"]
    managed = load_config(overrides={**vllm, "rollout.vllm.replicas": 2, "rollout.vllm.resources": {"GPU": 1}})
    assert managed.rollout.vllm.replicas == 2


def test_trainer_placement_defaults_and_resources():
    """pack is the default (the placement before train.placement existed); train.resources takes custom Ray
    resources only, with positive amounts (the controller adds them to every trainer bundle)."""
    train = load_config().train
    assert (train.placement, train.resources, train.placement_timeout_s) == ("pack", {}, 300.0)
    spread = load_config(overrides={"train.placement": "spread", "train.resources": {"trainer": 1}}).train
    assert (spread.placement, spread.resources) == ("spread", {"trainer": 1.0})
    with pytest.raises(ConfigError, match=r"train\.placement"):
        load_config(overrides={"train.placement": "strict_spread"})
    with pytest.raises(ConfigError, match=r"train\.resources\.GPU: rlpipe sets CPU/GPU"):
        load_config(overrides={"train.resources": {"GPU": 1}})
    with pytest.raises(ConfigError, match=r"train\.resources\.trainer=0"):
        load_config(overrides={"train.resources": {"trainer": 0}})
    with pytest.raises(ConfigError, match=r"train\.placement_timeout_s"):
        load_config(overrides={"train.placement_timeout_s": 0})


def test_sp_size_splits_the_world_into_dp_groups_and_needs_packed_sdpa(tmp_path):
    cfg = load_config(overrides={"train.world_size": 4, "train.sp_size": 2, "rollout.prompts_per_step": 4})
    assert cfg.dp_size == 2
    with pytest.raises(ConfigError, match=r"train.world_size=3 must be a multiple of train.sp_size=2"):
        load_config(overrides={"train.world_size": 3, "train.sp_size": 2})
    with pytest.raises(ConfigError, match=r"model.attn_implementation=sdpa .*packed_attention=true"):
        load_config(overrides={"train.sp_size": 2, "train.packed_attention": False})
    with pytest.raises(ConfigError, match=r"train.sp_size=4 .* num_attention_heads=2 and num_key_value_heads=1"):
        load_config(overrides={"train.world_size": 4, "train.sp_size": 4})  # the tiny default has 2 heads
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"num_attention_heads": 9, "num_key_value_heads": 3}')
    load_config(overrides={"model.path": str(model), "train.sp_size": 2})  # 9 heads over 2 ranks: 5 + 4
    with pytest.raises(ConfigError, match=rf"{model} has num_attention_heads=9 and num_key_value_heads=3"):
        load_config(overrides={"model.path": str(model), "train.world_size": 10, "train.sp_size": 10,
                               "rollout.prompts_per_step": 8})  # fmt: skip
