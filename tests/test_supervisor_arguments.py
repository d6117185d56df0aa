"""Every setting is checked at construction, with a ValueError naming the argument."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tensorflow as tf

import asupervisor as asv
from asupervisor._cluster import Role
from asupervisor._supervisor import _check_is_chief
from asupervisor.hooks import LoggingHook, StopAtStepHook


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"save_model_secs": -1}, "save_model_secs"),
        ({"save_model_secs": float("inf")}, "save_model_secs"),
        ({"save_model_steps": 0}, "save_model_steps"),
        ({"save_model_steps": 2.5}, "save_model_steps"),
        ({"max_to_keep": 0}, "max_to_keep"),
        ({"keep_checkpoint_every_n_hours": 0}, "keep_checkpoint_every_n_hours"),
        ({"save_summaries_secs": -0.5}, "save_summaries_secs"),
        ({"stop_grace_secs": -1}, "stop_grace_secs"),
        ({"recovery_wait_secs": 0}, "recovery_wait_secs"),
        ({"max_recoveries": -1}, "max_recoveries"),
        ({"step_timeout_secs": 0}, "step_timeout_secs"),
        ({"is_chief": "yes"}, "is_chief"),
        ({"is_chief": None}, "is_chief=None takes the role from a MultiWorkerMirroredStrategy"),
        ({"strategy": "mwms"}, "strategy must be a tf.distribute.Strategy"),
        ({"async_checkpoint": 1}, "async_checkpoint"),
        ({"handle_signals": None}, "handle_signals"),
        ({"init_fn": 42}, "init_fn"),
        ({"summary_fn": "loss"}, "summary_fn"),
        ({"checkpoint_basename": ""}, "checkpoint_basename"),
        ({"checkpoint_basename": "a/b"}, "checkpoint_basename"),
        ({"recoverable_errors": (ValueError, 3)}, "recoverable_errors"),
        ({"hooks": [object()]}, "hooks"),
        ({"summary_writer": "yes"}, "summary_writer"),
        ({"checkpoint": 3}, "checkpoint"),
        ({"global_step": tf.Variable(1.5)}, "global_step"),
        ({"global_step": tf.Variable([1, 2])}, "global_step"),
        ({"global_step": 7}, "global_step"),
        # Found from outside (issue 21): each once accepted, or refused in other words.
        ({"global_step": tf.Variable(0, dtype=tf.int8)}, "global_step must be an int32 or int64"),
        ({"global_step": tf.Variable(0, dtype=tf.uint8)}, "global_step must be an int32 or int64"),
        ({"checkpoint_basename": ".."}, "checkpoint_basename must be a file name inside"),
        ({"checkpoint_basename": "model\x00ckpt"}, "checkpoint_basename must be printable"),
        ({"checkpoint_basename": "m[1]"}, "glob character"),
        ({"hooks": None}, "hooks must be a list"),
        ({"hooks": asv.Hook()}, "hooks must be a list"),
        (
            {"checkpoint": {"save_counter": tf.Variable(1)}},
            "checkpoint has an entry 'save_counter'",
        ),
        ({"checkpoint": {"data_position": tf.Variable(1)}}, "checkpoint has an entry 'data_posi"),
        ({"checkpoint": {"fit_state": tf.Variable(1)}}, "checkpoint has an entry 'fit_state'"),
        ({"checkpoint": {"global_step": tf.Variable(1)}}, "pass the step variable as global_st"),
        ({"checkpoint": {"w": 3.0}}, "checkpoint: .*trackable"),
    ],
)
def test_bad_setting_names_the_argument(logdir: str, kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        asv.Supervisor(logdir, **kwargs)


def test_numpy_and_config_numbers_are_numbers(logdir: str) -> None:
    np = pytest.importorskip("numpy")
    sv = asv.Supervisor(
        logdir,
        save_model_steps=np.int64(5),
        save_model_secs=np.float32(5),
        max_to_keep=np.int32(2),
        stop_grace_secs=np.float64(1.5),
        handle_signals=np.bool_(False),
    )
    assert sv.save_model_steps == 5 and type(sv.save_model_steps) is int
    assert sv.save_model_secs == 5.0 and type(sv.save_model_secs) is float
    assert sv.max_to_keep == 2 and sv.handle_signals is False
    assert StopAtStepHook(num_steps=np.int64(3))._num_steps == 3
    assert LoggingHook(every_n_secs=np.float32(0.5)) is not None


def test_a_nan_hook_takes_only_a_bool() -> None:
    from asupervisor.hooks import NanLossHook

    with pytest.raises(ValueError, match="fail_on_nan"):
        NanLossHook(fail_on_nan="no")  # type: ignore[arg-type]


def test_summary_fn_without_anywhere_to_write_is_refused() -> None:
    with pytest.raises(ValueError, match="summary_fn"):
        asv.Supervisor(None, summary_fn=lambda: {"x": 1.0})
    with pytest.raises(ValueError, match="summary_writer=None"):
        asv.Supervisor("unused", summary_fn=lambda: {"x": 1.0}, summary_writer=None)


def test_logdir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("not a directory")
    with pytest.raises(ValueError, match="logdir"):
        asv.Supervisor(str(path))


@pytest.mark.parametrize("logdir", ["runs/a\x00b", "gs://bucket/a\x00b"])
def test_a_logdir_with_a_nul_character_is_refused_at_construction(logdir: str) -> None:
    with pytest.raises(ValueError, match=r"logdir .*NUL"):
        asv.Supervisor(logdir)


def test_a_logdir_under_a_file_is_refused_at_construction(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    for logdir in (tmp_path / "file" / "run", tmp_path / "file" / "deeper" / "run"):
        with pytest.raises(ValueError, match=r"logdir .*'[^']*file' is a file"):
            asv.Supervisor(logdir)
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_exclusive_hook_arguments() -> None:
    with pytest.raises(ValueError, match="num_steps or last_step"):
        StopAtStepHook()
    with pytest.raises(ValueError, match="num_steps and last_step"):
        StopAtStepHook(num_steps=1, last_step=2)
    with pytest.raises(ValueError, match="every_n_steps and every_n_secs"):
        LoggingHook(every_n_steps=1, every_n_secs=1.0)


def test_service_policy_is_checked(logdir: str) -> None:
    sv = asv.Supervisor(logdir)

    async def svc(sess: asv.ManagedSession) -> None: ...

    with pytest.raises(ValueError, match="on_error"):
        sv.add_service(svc, on_error="ignore")
    with pytest.raises(ValueError, match="max_restarts"):
        sv.add_service(svc, max_restarts=-1)
    with pytest.raises(ValueError, match="coroutine function"):
        sv.add_service(lambda sess: None)
    with pytest.raises(ValueError, match="interval_secs"):
        sv.loop(-1, print)


def test_defaults_follow_the_contract(logdir: str) -> None:
    sv = asv.Supervisor(logdir)
    assert sv.save_model_secs == 600
    assert sv.save_summaries_secs == 120
    assert sv.stop_grace_secs == 120
    assert sv.recovery_wait_secs == 30
    assert sv.max_to_keep == 5
    assert sv.checkpoint_basename == "model.ckpt"
    assert sv.recoverable_errors == (tf.errors.AbortedError, tf.errors.UnavailableError)
    assert sv.is_chief and sv.handle_signals and not sv.async_checkpoint
    assert sv.global_step.dtype == tf.int64 and sv.global_step.name.startswith("global_step")
    assert isinstance(sv.coord, asv.Coordinator)


def test_mapping_becomes_a_checkpoint_the_step_is_saved_beside(logdir: str) -> None:
    v = tf.Variable(3.0)
    sv = asv.Supervisor(logdir, checkpoint={"v": v})
    assert isinstance(sv.checkpoint, tf.train.Checkpoint)
    assert sv.checkpoint.v is v and not hasattr(sv.checkpoint, "global_step")


def test_no_logdir_means_no_checkpoints_or_summaries() -> None:
    sv = asv.Supervisor(None)
    assert sv.summary_writer is None
    assert not sv.checkpointing


def test_is_chief_must_agree_with_the_role_tf_config_gives() -> None:
    strategy = tf.distribute.get_strategy()
    worker1 = Role("worker", 1, rank=1, num_workers=2)
    assert _check_is_chief(None, strategy, worker1) is False
    assert _check_is_chief(None, strategy, Role("chief", 0, rank=0, num_workers=3)) is True
    assert _check_is_chief(None, strategy, None) is True  # a strategy of one worker
    with pytest.raises(ValueError, match=r"is_chief=True contradicts TF_CONFIG.*worker:1"):
        _check_is_chief(True, strategy, worker1)


def test_a_strategy_of_one_process_keeps_the_single_process_behaviour(logdir: str) -> None:
    sv = asv.Supervisor(logdir, strategy=tf.distribute.get_strategy(), is_chief=None)
    assert sv.is_chief and sv.role is None and sv.checkpointing


@pytest.mark.parametrize("url", ["nosuchfs://bucket/run", "s3://bucket/run"])
def test_a_logdir_on_a_file_system_tf_lacks_is_refused_before_anything_is_written(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # TF 2.21 has no s3:// of its own (tensorflow-io has)
    with pytest.raises(ValueError, match=r"logdir .*TensorFlow has no file system for"):
        asv.Supervisor(url)
    assert list(tmp_path.iterdir()) == []  # no local directory named "s3:"


def test_an_object_store_logdir_is_accepted_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    sv = asv.Supervisor("ram://arguments/run/", handle_signals=False)
    assert sv.logdir == "ram://arguments/run"
    assert list(tmp_path.iterdir()) == []  # nothing local: no directory named "ram:"


@pytest.mark.parametrize("basename", ["m*", "model[1]", "ck?pt"])
def test_a_basename_with_glob_characters_is_refused(basename: str, logdir: str) -> None:
    with pytest.raises(ValueError, match=r"checkpoint_basename .*glob"):
        asv.Supervisor(logdir, checkpoint_basename=basename)
