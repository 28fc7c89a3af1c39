"""Unit tests of the Flyte layer pieces that need no Ray: RayJobConfig, images, types, decks, errors, artifacts."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Annotated

import pandas as pd
import pytest

from tasks.artifacts import CheckpointArtifact

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    from flytekit.core.local_cache import LocalTaskCache

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    LocalTaskCache._initialized = False
    yield
    LocalTaskCache._initialized = False


# ----------------------------------------------------------------------------------------------- ray config


def test_gpu_ray_job_config_matches_deploy_constants():
    from images.deploy import GPU_HEAD, GPU_ROLLOUT, GPU_WORKER, HEAD_RESOURCES
    from tasks.ray_config import ray_job_config

    cfg = ray_job_config("gpu")
    assert cfg.shutdown_after_job_finishes is True and cfg.ttl_seconds_after_finished > 0
    # the head runs only the driver: no GPU requested, and Ray advertises no CPU and no GPU there
    assert cfg.head_node_config.ray_start_params["num-cpus"] == cfg.head_node_config.ray_start_params["num-gpus"] == "0"
    head = cfg.head_node_config.requests
    assert (head.cpu, head.mem, head.gpu) == (GPU_HEAD.cpu, GPU_HEAD.memory, None)
    assert cfg.head_node_config.limits.gpu is None
    assert ray_job_config("cpu").head_node_config.requests.gpu is None
    assert ray_job_config("cpu").head_node_config.requests.cpu == HEAD_RESOURCES.cpu
    group, rollout = cfg.worker_node_config  # trainers, then the rollout engines beside them
    assert group.group_name == "gpu-workers" and group.replicas == GPU_WORKER.replicas
    assert group.requests == group.limits
    assert (group.limits.cpu, group.limits.mem, group.limits.gpu) == (GPU_WORKER.cpu, GPU_WORKER.memory, "1")
    assert group.ray_start_params == {"resources": '"{\\"trainer\\": 1}"'}
    assert rollout.group_name == "rollout-workers" and rollout.replicas == GPU_ROLLOUT.replicas
    assert rollout.limits.gpu == "1" and rollout.ray_start_params == {"resources": '"{\\"rollout_engine\\": 1}"'}
    (cpu_group,) = ray_job_config("cpu", replicas=5).worker_node_config  # the colocated HF engine: no rollout group
    assert cpu_group.replicas == 5 and cpu_group.ray_start_params is None
    assert ray_job_config("gpu", replicas=3).worker_node_config[1].replicas == GPU_ROLLOUT.replicas  # trainers only


def test_gpu_worker_resources_serialize_as_nvidia_gpu():
    from flytekit.core.resources import pod_spec_from_resources

    from tasks.ray_config import ray_job_config

    group = ray_job_config("gpu").worker_node_config[0]
    pod = pod_spec_from_resources("ray-worker", requests=group.requests, limits=group.limits)
    assert pod.containers[0].resources.limits["nvidia.com/gpu"] == "1"


def test_unknown_kind_is_a_config_error():
    from rlpipe.errors import ConfigError
    from tasks.ray_config import ray_job_config

    with pytest.raises(ConfigError, match="unknown deployment kind"):
        ray_job_config("tpu")


# ----------------------------------------------------------------------------------------------- images


def test_image_specs_pin_exactly_the_pyproject_dependencies():
    from images.specs import CPU_IMAGE_SPEC, GPU_IMAGE_SPEC, PINNED_PACKAGES

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert PINNED_PACKAGES == deps
    for spec in (CPU_IMAGE_SPEC, GPU_IMAGE_SPEC):
        assert spec.packages == deps
    assert "cuda" in GPU_IMAGE_SPEC.base_image and "cu12" in GPU_IMAGE_SPEC.pip_extra_index_url[0]
    assert CPU_IMAGE_SPEC.pip_extra_index_url == ["https://download.pytorch.org/whl/cpu"]


def test_image_names_are_the_deploy_images():
    from images.deploy import CPU_IMAGE, GPU_IMAGE
    from images.specs import CPU_IMAGE_SPEC, GPU_IMAGE_SPEC, image_spec

    assert CPU_IMAGE_SPEC.image_name() == CPU_IMAGE and GPU_IMAGE_SPEC.image_name() == GPU_IMAGE
    with pytest.raises(ValueError):
        image_spec("arm")


# ----------------------------------------------------------------------------------------------- types


def _batch(rows: int = 3, with_old: bool = False) -> pd.DataFrame:
    data = {
        "group_id": list(range(rows)),
        "sample_index": [0] * rows,
        "prompt_index": list(range(rows)),
        "data_source": ["count"] * rows,
        "ground_truth": ["3"] * rows,
        "prompt_ids": [[1, 2, 3][: i + 1] for i in range(rows)],
        "response_ids": [[7, 8] for _ in range(rows)],
        "rollout_logprobs": [[-0.1, -1 / 3] for _ in range(rows)],
        "finish_reason": ["stop"] * rows,
        "response_text": ["ab"] * rows,
        "reward": [1.0, 0.0, 0.5][:rows],
        "advantage": [0.7, -0.7, 0.0][:rows],
    }
    if with_old:
        data["old_logprobs"] = [[-0.2, -0.3] for _ in range(rows)]
    return pd.DataFrame(data)


def test_rollout_batch_roundtrips_through_parquet_with_the_documented_types(tmp_path):
    import pyarrow as pa
    from flytekit import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    from tasks.types import (
        ROLLOUT_ARROW_SCHEMA,
        AnyRolloutBatch,
        ScoredRolloutBatch,
        batch_to_arrow,
        open_rollout_batch,
        rollout_dataset,
    )

    table = batch_to_arrow(_batch(with_old=True))
    assert table.schema.field("rollout_logprobs").type == pa.list_(pa.float32())
    assert table.schema.field("old_logprobs").type == pa.list_(pa.float32())
    assert table.schema.names[: len(ROLLOUT_ARROW_SCHEMA)] == ROLLOUT_ARROW_SCHEMA.names

    ctx = FlyteContextManager.current_context()
    lt = TypeEngine.to_literal_type(ScoredRolloutBatch)
    lit = TypeEngine.to_literal(ctx, rollout_dataset(_batch(with_old=True)), ScoredRolloutBatch, lt)
    back = open_rollout_batch(TypeEngine.to_python_value(ctx, lit, AnyRolloutBatch))
    assert back["prompt_ids"].tolist() == [[1], [1, 2], [1, 2, 3]]
    assert back["old_logprobs"].tolist() == [[pytest.approx(-0.2), pytest.approx(-0.3)]] * 3
    # float32 storage: what the trainer uses anyway (packing makes float32 tensors)
    assert (
        back["rollout_logprobs"][0][1] == pytest.approx(-1 / 3, rel=1e-7) and back["rollout_logprobs"][0][1] != -1 / 3
    )


def test_checkpoint_transformer_is_the_stock_dataclass_one_built_once(tmp_path, monkeypatch):
    from flytekit import FlyteContextManager
    from flytekit.core.type_engine import DataclassTransformer, TypeEngine
    from flytekit.types.directory import FlyteDirectory

    from tasks.types import Checkpoint, CheckpointTransformer, SamplerState

    transformer = TypeEngine.get_transformer(Annotated[Checkpoint, CheckpointArtifact()])
    assert isinstance(transformer, CheckpointTransformer)
    # the registered literal type is exactly what flytekit's own transformer builds (interfaces do not change)
    stock = DataclassTransformer().get_literal_type(Checkpoint)
    fresh = CheckpointTransformer()
    assert fresh.get_literal_type(Annotated[Checkpoint, CheckpointArtifact()]) == stock
    TypeEngine.to_literal_type(Checkpoint)  # the registered instance builds it on first use
    builds = []
    monkeypatch.setattr(DataclassTransformer, "get_literal_type", lambda self, t: builds.append(t) or stock)
    for t in (Checkpoint, Annotated[Checkpoint, CheckpointArtifact()], Checkpoint | None):
        TypeEngine.to_literal_type(t)
    assert builds == []  # cached
    assert fresh.get_literal_type(SamplerState) is stock and builds == [SamplerState]  # other dataclasses: stock
    monkeypatch.undo()

    ckpt_dir = tmp_path / "step-000003"
    ckpt_dir.mkdir()
    value = Checkpoint(path=FlyteDirectory(str(ckpt_dir)), uri="s3://b/e/step-000003", experiment="e", step=3,
                       iteration=3, sampler=SamplerState(epoch=1, total_consumed=24), sft_sampler=SamplerState())  # fmt: skip
    ctx = FlyteContextManager.current_context()
    lit = TypeEngine.to_literal(ctx, value, Checkpoint | None, TypeEngine.to_literal_type(Checkpoint | None))
    back = TypeEngine.to_python_value(ctx, lit, Checkpoint | None)
    assert (back.uri, back.step, back.sampler, back.sft_sampler) == (value.uri, 3, value.sampler, SamplerState())
    none = TypeEngine.to_literal(ctx, None, Checkpoint | None, TypeEngine.to_literal_type(Checkpoint | None))
    assert TypeEngine.to_python_value(ctx, none, Checkpoint | None) is None


def test_missing_declared_column_is_an_error():
    from tasks.types import batch_to_arrow

    with pytest.raises(KeyError):
        batch_to_arrow(_batch().drop(columns=["advantage"]))


def test_metrics_table_merges_rows_and_tables_of_one_iteration():
    from flytekit.types.structured import StructuredDataset  # noqa: F401 - registers encoders

    from tasks.phases import metrics_table
    from tasks.types import metrics_dataset

    config = '{"experiment": "x"}'
    # granular: one row per phase task; iteration 1 has a train row and an sft row
    rows = [{"iteration": 2.0, "loss": 0.5}, {"iteration": 1.0, "loss": 1.0}, {"iteration": 1.0, "sft/loss": 3.0}]
    frame = metrics_table(config=config, rows=rows).open(pd.DataFrame).all()
    assert frame["iteration"].tolist() == [1.0, 2.0]
    assert frame["loss"].tolist() == [1.0, 0.5]
    assert frame["sft/loss"].iloc[0] == 3.0 and math.isnan(frame["sft/loss"].iloc[1])
    assert list(metrics_dataset([{"b": 1.0, "iteration": 1.0, "a": 2.0}]).dataframe.columns) == ["iteration", "a", "b"]
    # segments: one table each (the empty one: a segment that had nothing left to run); a table's NaN cell (a
    # metric its row lacked) never overwrites a value, and a NaN metric with no other value stays NaN
    segment_a = metrics_dataset([{"iteration": 1.0, "loss": 1.0}, {"iteration": 2.0, "sft/loss": 3.0}])
    segment_b = metrics_dataset([{"iteration": 2.0, "loss": 0.5, "grad_norm": float("nan")}])
    tables = [segment_b, metrics_dataset([]), segment_a]
    frame = metrics_table(config=config, tables=tables).open(pd.DataFrame).all()
    assert frame["iteration"].tolist() == [1.0, 2.0]
    assert frame["loss"].tolist() == [1.0, 0.5]
    assert math.isnan(frame["sft/loss"].iloc[0]) and frame["sft/loss"].iloc[1] == 3.0
    assert frame["grad_norm"].isna().all()


# ----------------------------------------------------------------------------------------------- decks


def test_curves_and_table_html_show_every_panel_and_value():
    from tasks.decks import PANELS, curves_html, table_html

    rows = [{"iteration": 1.0, "reward_mean": 0.125, "kl": 0.5}, {"iteration": 2.0, "reward_mean": 0.25}]
    page = curves_html(rows)
    for title in PANELS:
        assert title in page
    assert "reward_mean" in page and '"kl"' in page
    table = table_html(rows)
    assert "0.125" in table and "0.25" in table and "<th>iteration</th>" in table
    assert "<script>" not in table_html([{"iteration": 1.0, "<script>": 1.0}])


def test_training_decks_publish_outside_a_task_is_a_noop():
    from tasks.decks import TrainingDecks

    decks = TrainingDecks("t", publish_every_s=1e9)
    decks.add({"iteration": 1.0, "loss": 1.0})
    assert decks.publish() is False and len(decks.rows) == 1


def test_decks_are_published_while_a_task_runs(tmp_path):
    import flytekit
    from flytekit import task

    from tasks.decks import CURVES_DECK, TABLE_DECK, TrainingDecks

    seen = {}

    @task(enable_deck=True)
    def fake_train() -> int:
        decks = TrainingDecks("run", publish_every_s=0.0)
        decks.add({"iteration": 1.0, "loss": 2.0})
        decks.add({"iteration": 2.0, "loss": 1.0})
        seen["names"] = [d.name for d in flytekit.current_context().decks]
        return len(decks.rows)

    assert fake_train() == 2
    assert seen["names"].count(CURVES_DECK) == 1 and seen["names"].count(TABLE_DECK) == 1


def test_training_decks_first_publish_waits_for_the_interval(monkeypatch):
    """A segment's first iteration must not render the decks (a page per segment start)."""
    from tasks import decks as decks_mod

    clock = [100.0]
    monkeypatch.setattr(decks_mod.time, "monotonic", lambda: clock[0])
    published = []
    decks = decks_mod.TrainingDecks("t", publish_every_s=60.0)
    monkeypatch.setattr(decks, "publish", lambda: published.append(len(decks.rows)) or True)
    decks.add({"iteration": 1.0})
    clock[0] += 59.0
    decks.add({"iteration": 2.0})
    assert published == []
    clock[0] += 1.0
    decks.add({"iteration": 3.0})
    assert published == [3]


# ----------------------------------------------------------------------------------------------- ray tasks


def test_ray_tasks_drop_the_dependencies_deck_and_keep_the_ray_job():
    from flytekit.deck import DeckField

    from tasks.common import RlpipeRayTask
    from tasks.segment import rl_segment

    assert isinstance(rl_segment, RlpipeRayTask) and rl_segment.task_type == "ray"
    assert DeckField.DEPENDENCIES not in rl_segment.deck_fields and DeckField.TIMELINE in rl_segment.deck_fields
    assert rl_segment.task_config.head_node_config.ray_start_params["num-cpus"] == "0"


@pytest.mark.parametrize("local", [True, False])
def test_local_ray_tasks_start_rlpipes_ray_before_the_plugins(monkeypatch, local):
    """Locally our ray (no dashboard, worker env) must be up before the plugin's ray.init(ignore_reinit_error)."""
    import ray
    from flytekit import FlyteContextManager
    from flytekit.core.context_manager import ExecutionState

    import tasks.common as common
    from tasks.segment import rl_segment

    calls = []
    monkeypatch.setattr(common, "ensure_ray", lambda: calls.append("rlpipe"))
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(("plugin", kw.get("ignore_reinit_error"))))
    ctx = FlyteContextManager.current_context()
    mode = ExecutionState.Mode.LOCAL_TASK_EXECUTION if local else ExecutionState.Mode.TASK_EXECUTION
    with FlyteContextManager.with_context(ctx.with_execution_state(ctx.execution_state.with_params(mode=mode))):
        rl_segment.pre_execute(ctx.user_space_params)
    assert calls == (["rlpipe", ("plugin", True)] if local else [("plugin", None)])


# ----------------------------------------------------------------------------------------------- errors, artifacts


@pytest.mark.parametrize("make", ["recoverable", "actor_died", "node_died", "actor_error"])
def test_lost_workers_become_recoverable(make):
    import ray.exceptions as rex
    from flytekit.exceptions.user import FlyteRecoverableException

    from rlpipe.errors import RecoverableError
    from tasks.errors import retry_on_lost_workers

    exc = {
        "recoverable": lambda: RecoverableError("worker lost"),
        "actor_died": rex.ActorDiedError,
        "node_died": lambda: rex.NodeDiedError("node gone"),
        "actor_error": rex.RayActorError,
    }[make]()
    with pytest.raises(FlyteRecoverableException) as info, retry_on_lost_workers("train"):
        raise exc
    assert info.value.__cause__ is exc and "train" in str(info.value)


def test_user_errors_stay_non_recoverable():
    from flytekit.exceptions.user import FlyteRecoverableException

    from rlpipe.errors import ConfigError
    from tasks.errors import retry_on_lost_workers

    with pytest.raises(ConfigError), retry_on_lost_workers("train"):
        raise ConfigError("bad")
    assert not issubclass(ConfigError, FlyteRecoverableException)


def test_artifact_partitions_are_attached_to_the_output_literal():
    from flytekit import FlyteContextManager, task
    from flytekit.core.context_manager import ExecutionState, OutputMetadataTracker
    from flytekit.models.literals import LiteralMap

    from tasks.artifacts import tag

    @task
    def make() -> Annotated[int, CheckpointArtifact()]:
        return tag(CheckpointArtifact, 7, "exp-a", 42)

    ctx = FlyteContextManager.current_context()
    with FlyteContextManager.with_context(
        ctx.with_execution_state(
            ctx.execution_state.with_params(mode=ExecutionState.Mode.TASK_EXECUTION)
        ).with_output_metadata_tracker(OutputMetadataTracker())
    ) as exec_ctx:
        out = make.dispatch_execute(exec_ctx, LiteralMap({}))
    from base64 import b64decode

    from flyteidl.core import artifact_id_pb2

    meta = out.literals["o0"].metadata
    art = artifact_id_pb2.ArtifactID()
    art.ParseFromString(b64decode(meta["_uap"]))
    assert {k: v.static_value for k, v in art.partitions.value.items()} == {"experiment": "exp-a", "step": "42"}


def test_served_weights_appear_in_the_deck():
    """The Deck names the server and the weight versions it served (from the manifest's `served` entries)."""
    from tasks.decks import TrainingDecks

    decks = TrainingDecks("t")
    decks.served = [
        {"iterations": "1-3", "engine": "vllm http://127.0.0.1:8123", "weight_versions": [0, 1, 2]},
        {"iterations": "4", "engine": "openai http://10.0.0.2:8000", "weight_versions": [-1]},
    ]
    page = decks.render()["Metrics table"]
    assert "vllm http://127.0.0.1:8123" in page and "0..2 (3 iterations)" in page
    assert "never synced (off-policy)" in page
    assert "Rollout engine" not in TrainingDecks("hf run").render()["Metrics table"]


def test_resolve_config_engine_input_sets_rollout_engine():
    import json

    from rlpipe.errors import ConfigError
    from tasks.phases import resolve_config

    assert json.loads(resolve_config(engine="vllm"))["rollout"]["engine"] == "vllm"
    assert json.loads(resolve_config())["rollout"]["engine"] == "hf"
    with pytest.raises(ConfigError, match="rollout_is"):  # a server nobody syncs is off-policy: IS must be on
        resolve_config(engine="openai", overrides=["rollout.server_url=http://127.0.0.1:9"])


def test_resolve_config_applies_overrides_and_validates(tmp_path):
    import json

    from rlpipe.errors import ConfigError
    from tasks.phases import resolve_config

    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("iterations: 7\nrollout:\n  n: 4\n")
    cfg = json.loads(resolve_config(config_file=str(yaml_file), overrides=["train.lr=1e-4"]))
    assert cfg["iterations"] == 7 and cfg["rollout"]["n"] == 4 and cfg["train"]["lr"] == 1e-4
    assert json.loads(resolve_config())["experiment"] == "grpo-sum"
    with pytest.raises(ConfigError):
        resolve_config(overrides=["train.nope=1"])


def test_base_model_is_rebuilt_when_its_directory_is_gone(tmp_path):
    """A second local run must not get the first run's model path back from Flyte's cache after it was deleted
    (or from another checkout): the README command run twice in a fresh clone hit exactly that."""
    import json
    import shutil

    from rlpipe.config import load_config
    from tasks.phases import base_model
    from tests.conftest import tiny_overrides

    cfg = load_config(overrides=tiny_overrides(tmp_path, **{"model.warmup_sft_steps": 2}))
    config = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    first = Path(base_model(config=config).path)
    assert (first / "config.json").is_file()
    shutil.rmtree(tmp_path / "out")
    second = Path(base_model(config=config).path)
    assert (second / "config.json").is_file()


def test_export_hf_output_exists_on_every_run(tmp_path, monkeypatch):
    """export_hf returns a fresh temp dir; while it was Flyte-cached, a second run with the same inputs got the first
    run's path back from the local cache even after that dir was gone (no Ray: the export itself is stubbed)."""
    import json
    import shutil

    import ray
    from flytekit.types.directory import FlyteDirectory

    import tasks.common as common
    import tasks.phases as phases
    from rlpipe.config import load_config
    from tasks.types import Checkpoint
    from tests.conftest import tiny_overrides

    def fake_export(cfg, checkpoint, out_dir):
        (Path(out_dir) / "config.json").write_text("{}")
        return out_dir

    monkeypatch.setattr(common, "ensure_ray", lambda: None)
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(phases.phases, "export_hf", fake_export)
    for name in ("model", "ckpt"):
        (tmp_path / name).mkdir()
    config = json.dumps(load_config(overrides=tiny_overrides(tmp_path)).model_dump(mode="json"), sort_keys=True)
    ckpt = Checkpoint(path=FlyteDirectory(str(tmp_path / "ckpt")), uri=str(tmp_path / "ckpt"), experiment="e",
                      step=1, iteration=1)  # fmt: skip
    kwargs = dict(config=config, base_model=FlyteDirectory(str(tmp_path / "model")), checkpoint=ckpt)
    first = Path(phases.export_hf(**kwargs).path)
    assert (first / "config.json").is_file()
    shutil.rmtree(first)
    second = Path(phases.export_hf(**kwargs).path)
    assert (second / "config.json").is_file()
