"""A real two-worker MultiWorkerMirroredStrategy job on loopback, run as two processes
of examples/multiworker.py: training, chief-only files, resume, SIGTERM, SIGKILL."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import asupervisor as asv
from examples.multiworker import local_tf_configs
from tests import forked

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "multiworker.py"
STOPPED = re.compile(r"stopped at step (\d+) \((\w+)\)")

pytestmark = pytest.mark.slow


class Worker:
    """One worker process of the job, with its output (stdout and stderr) collected."""

    def __init__(self, tf_config: str, logdir: Path, tmp: Path, *args: str) -> None:
        env = {
            **os.environ,
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "TF_CONFIG": tf_config,
            "TMPDIR": str(tmp),  # where a non-chief's scratch saves go
        }
        self.proc = forked.Popen(
            [sys.executable, str(EXAMPLE), "--logdir", str(logdir), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip())
                self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        """The first output line matching ``pattern``, waiting for it if need be."""
        wanted = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if found := wanted.search(line):
                        return found
                exited = self.proc.poll() is not None
                if time.monotonic() > deadline or (exited and not self._changed.wait(0.5)):
                    raise AssertionError(f"no line matches {pattern!r}:\n{self.output[-3000:]}")
                self._changed.wait(0.5)

    def wait(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        time.sleep(0.2)  # let the reader thread take the last lines
        return code

    def stopped_at(self) -> tuple[int, str]:
        found = STOPPED.search(self.output)
        assert found, self.output[-3000:]
        return int(found[1]), found[2]


def start_job(logdir: Path, tmp: Path, *args: str) -> list[Worker]:
    return [Worker(config, logdir, tmp, *args) for config in local_tf_configs(2)]


def finish(job: list[Worker], timeout: float = 120) -> list[int]:
    try:
        return [worker.wait(timeout) for worker in job]
    finally:
        for worker in job:
            if worker.proc.poll() is None:
                worker.proc.kill()


def checkpoint_steps(logdir: Path) -> list[int]:
    indexes = logdir.glob("model.ckpt-*.index")
    return sorted(int(p.name.removeprefix("model.ckpt-").removesuffix(".index")) for p in indexes)


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    path = tmp_path / "scratch"
    path.mkdir()
    return path


def test_two_workers_train_only_the_chief_writes_the_logdir_and_a_restart_resumes(
    tmp_path: Path, scratch: Path
) -> None:
    logdir = tmp_path / "run"
    job = start_job(
        logdir, scratch, "--steps", "120", "--save-secs", "0.3", "--summary-secs", "0.5"
    )
    assert finish(job) == [0, 0], job[1].output[-3000:]
    assert [w.stopped_at() for w in job] == [(120, "step_limit")] * 2
    # Every timed save was agreed and taken by both workers at the same step.
    for worker in job:
        assert "kind=save" in worker.output
    saved_by_worker1 = re.findall(r"checkpoint.saved .*path=(\S+)", job[1].output)
    assert saved_by_worker1 and all(p.startswith(str(scratch)) for p in saved_by_worker1)
    assert list(scratch.iterdir()) == []  # the non-chief's scratch saves were removed

    # The logdir holds the chief's files only: its checkpoints and one events file of its own.
    steps = checkpoint_steps(logdir)
    assert steps[-1] == 120
    names = {p.name for p in logdir.iterdir()}
    events = [n for n in names if n.startswith("events.out.tfevents")]
    assert len(events) == 1 and f".{job[0].proc.pid}." in events[0]
    own = {
        "checkpoint",
        ".asupervisor.lock",
        ".asupervisor.history",
        ".asupervisor.history.backup",
        ".asupervisor.heartbeat",
        "asupervisor-ledger.jsonl",
    }  # state, lock, history, presence
    assert names - set(events) - own == {
        f"model.ckpt-{s}.{ext}" for s in steps for ext in ("index", "data-00000-of-00001")
    }
    reader = EventAccumulator(str(logdir / events[0]))
    reader.Reload()
    assert {"loss", "global_step/sec"} <= set(reader.Tags()["tensors"])
    assert reader.Tensors("loss")[-1].step > 0

    # Both restarted: both restore the chief's newest checkpoint and go on from it.
    again = start_job(logdir, scratch, "--steps", "130", "--save-secs", "30")
    assert finish(again) == [0, 0], again[1].output[-3000:]
    for worker in again:
        worker.wait_for(r"starting at step 120 \(.*model\.ckpt-120\)", timeout=1)
    assert [w.stopped_at() for w in again] == [(130, "step_limit")] * 2
    assert checkpoint_steps(logdir)[-1] == 130
    assert tf.train.latest_checkpoint(str(logdir)).endswith("model.ckpt-130")


def test_sigterm_to_the_non_chief_stops_both_at_one_step_with_a_final_checkpoint(
    tmp_path: Path, scratch: Path
) -> None:
    logdir = tmp_path / "run"
    job = start_job(logdir, scratch, "--steps", "1000000", "--save-secs", "0.3")
    try:
        saved = job[0].wait_for(r"checkpoint.saved .*step=(\d{2,})", timeout=90)
        job[1].proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        codes = finish(job, timeout=60)
        both_exited = time.monotonic() - sent
    finally:
        finish(job, timeout=1)
    assert codes == [42, 42], job[0].output[-3000:]  # both preempted: saved, not done
    (step0, reason0), (step1, reason1) = (w.stopped_at() for w in job)
    assert reason0 == reason1 == "signal"
    assert step0 == step1 > int(saved[1])
    assert checkpoint_steps(logdir)[-1] == step0  # one final checkpoint, at that step
    job[0].wait_for(rf"kind=stop proposed_by=1 reason=signal step={step0}", timeout=1)
    print(f"SIGTERM to the non-chief -> both exited in {both_exited:.2f} s (stopped at {step0})")
    assert both_exited < 30


def test_a_stop_asked_on_the_chief_alone_stops_every_worker_after_one_step(
    tmp_path: Path, scratch: Path
) -> None:
    """An after_save hook runs on the chief only; its stop request is agreed by both."""
    logdir = tmp_path / "run"
    job = start_job(
        logdir, scratch, "--steps", "1000000", "--save-secs", "0.5", "--stop-after-first-save"
    )
    codes = finish(job, timeout=120)
    assert codes == [0, 0], job[1].output[-3000:]
    (step0, reason0), (step1, reason1) = (w.stopped_at() for w in job)
    assert reason0 == reason1 == "requested" and step0 == step1
    assert checkpoint_steps(logdir)[-1] == step0


@pytest.mark.parametrize("victim", [1, 0], ids=["non-chief killed", "chief killed"])
def test_sigkill_of_a_worker_ends_the_other_cleanly_and_the_job_resumes(
    tmp_path: Path, scratch: Path, victim: int
) -> None:
    logdir = tmp_path / "run"
    job = start_job(logdir, scratch, "--steps", "1000000", "--save-secs", "0.2")
    survivor = job[1 - victim]
    try:
        job[0].wait_for(r"checkpoint.saved .*step=\d\d", timeout=90)
        job[victim].proc.kill()
        code = survivor.wait(timeout=60)
    finally:
        finish(job, timeout=1)
    assert code == asv.Outcome.LOST_PEER.exit_status, survivor.output[-3000:]
    survivor.wait_for(r"cluster.step_failed|cluster.lost", timeout=1)
    survivor.wait_for(r"a worker of this job was lost", timeout=1)
    assert "stopped at step" not in survivor.output  # no final save without every worker
    last = checkpoint_steps(logdir)[-1]
    assert last > 0

    again = start_job(logdir, scratch, "--steps", str(last + 10), "--save-secs", "30")
    assert finish(again) == [0, 0], again[0].output[-3000:]
    for worker in again:
        worker.wait_for(rf"starting at step {last} \(", timeout=1)
    assert [w.stopped_at() for w in again] == [(last + 10, "step_limit")] * 2


FIT_IN_A_JOB = """
import sys
import textwrap

import anyio
import keras
import tensorflow as tf

import asupervisor as asv

strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
data = tf.data.Dataset.from_tensor_slices((tf.zeros((8, 4)), tf.zeros((8, 1)))).batch(4)


async def main() -> None:
    sv = asv.Supervisor(
        sys.argv[1], checkpoint={"model": model}, strategy=strategy, is_chief=None,
        handle_signals=False,
    )
    async with sv.session() as sess:
        try:
            await sess.fit(model, data, epochs=1)
        except ValueError as exc:
            print(f"refused at step {sess.global_step}: {exc}", flush=True)


anyio.run(main)
"""


def test_fit_in_a_multi_worker_job_is_refused_before_any_batch(
    tmp_path: Path, scratch: Path
) -> None:
    # Keras 3's own model.fit fails under a two-worker MultiWorkerMirroredStrategy (with
    # a PerReplica conversion error deep in the first batch): say so at the call instead.
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TMPDIR": str(scratch)}
    job = [
        forked.Popen(
            [sys.executable, "-c", FIT_IN_A_JOB, str(tmp_path / "run")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "TF_CONFIG": config},
        )
        for config in local_tf_configs(2)
    ]
    try:
        outputs = [proc.communicate(timeout=120)[0] for proc in job]
    finally:
        for proc in job:
            proc.kill()
    for proc, output in zip(job, outputs, strict=True):
        assert proc.returncode == 0, output[-3000:]
        assert "refused at step 0: sess.fit cannot run in a multi-worker job" in output
        assert "keras-team/keras#20585" in output and "sess.train" in output


STEP_BY_TWO = """
import sys
import textwrap

import anyio
import tensorflow as tf

import asupervisor as asv

strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():  # MEAN: each update is an all-reduce, so the workers go in lockstep
    w = tf.Variable(0.0, aggregation=tf.VariableAggregation.MEAN)
step_var = tf.Variable(0, dtype=tf.int64)  # the user's step: 2 per step, as with 2 micro-batches


@tf.function
def step():
    strategy.run(lambda: w.assign_add(1.0))
    step_var.assign_add(2)


async def main() -> None:
    sv = asv.Supervisor(
        sys.argv[1], checkpoint={"w": w}, global_step=step_var, strategy=strategy,
        is_chief=None, save_model_secs=0, save_model_steps=1000, save_summaries_secs=0,
        handle_signals=False,
    )
    worker = sv.role.rank
    async with sv.session() as sess:
        while not sess.should_stop():
            await sess.run(step)
            if worker == 1 and sess.global_step == 20:
                sess.request_stop(reason="eval:done")  # a reason with the old separator in it
    print(f"stopped at step {sess.global_step} ({sess.stop_reason}) {sess.outcome.name}")


anyio.run(main)
"""


def test_an_agreed_stop_with_any_reason_is_taken_by_steps_that_advance_by_two(
    tmp_path: Path, scratch: Path
) -> None:
    logdir = tmp_path / "run"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TMPDIR": str(scratch)}
    job = [
        forked.Popen(
            [sys.executable, "-c", STEP_BY_TWO, str(logdir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "TF_CONFIG": config},
        )
        for config in local_tf_configs(2)
    ]
    try:
        outputs = [proc.communicate(timeout=180)[0] for proc in job]
    finally:
        for proc in job:
            proc.kill()
    stops = [re.search(r"stopped at step (\d+) \((.+)\) (\w+)", out) for out in outputs]
    assert all(stops), outputs[0][-3000:] + outputs[1][-3000:]
    steps = {int(s[1]) for s in stops if s}
    assert [proc.returncode for proc in job] == [0, 0]
    assert len(steps) == 1 and steps.pop() == 22  # both after the same step: the next one
    assert all(s[2] == "eval:done" and s[3] == "DONE" for s in stops if s)
    assert "cluster.decision_missed" not in outputs[0] + outputs[1]
    assert checkpoint_steps(logdir)[-1] == 22  # one final checkpoint, at that step


PROPOSAL_TO_A_DEAD_WORKER = """
import sys
import textwrap
import time

import tensorflow as tf

from asupervisor._cluster import Agreement, DecisionKind, multi_worker_role

strategy = tf.distribute.MultiWorkerMirroredStrategy()
role = multi_worker_role(strategy)
agreement = Agreement(role, on_lost=lambda exc: None)
print("ready", flush=True)
if role.rank == 1:
    time.sleep(600)  # never acknowledges: its watcher is not started; then it is killed
agreement.start()  # the chief acknowledges its own proposal
try:
    agreement.propose(DecisionKind.SAVE, "timer", 5)
except tf.errors.UnavailableError as exc:
    print(f"proposal failed: {exc.message}", flush=True)
"""


def test_a_proposal_waiting_for_a_worker_that_dies_fails_once_the_service_sees_it_dead(
    tmp_path: Path, scratch: Path
) -> None:
    # Found by the SIGKILL test taking 45 s: a worker killed while the chief waited for
    # its acknowledgement held the chief for the whole acknowledgement timeout.
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TMPDIR": str(scratch)}
    chief, other = (
        Popen(PROPOSAL_TO_A_DEAD_WORKER, env={**env, "TF_CONFIG": config})
        for config in local_tf_configs(2)
    )
    try:
        for proc in (chief, other):
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        other.kill()
        output = chief.communicate(timeout=120)[0]
    finally:
        chief.kill()
        other.kill()
    assert "proposal failed: worker 1 was lost while the job waited for it" in output, output
    assert "heartbeat" in output  # the coordination service's own words, passed on


def Popen(script: str, env: dict[str, str]) -> forked.Popen:
    return forked.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )


# Two workers under `asupervisor run --workers 2 --local-dir`: local saves every 5 steps
# (and at step 0), every 2nd copied to the logdir (0 no, 5 yes, 10 no). The chief SIGKILLs
# itself, twice, once its local tier holds step 10 and the logdir does not. In attempt 2
# worker 1 is given a local tier of its own, as a worker on another host has.
LOCAL_TIER_JOB = """
    import json, os, signal, sys, time
    import anyio, tensorflow as tf
    import asupervisor as asv
    from asupervisor._logdir.catalog import Catalog
    from asupervisor._logdir.store import Store
    from asupervisor.hooks import StopAtStepHook

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():  # MEAN: each update is an all-reduce, so the workers go in lockstep
        w = tf.Variable(0.0, aggregation=tf.VariableAggregation.MEAN)

    @tf.function
    def step():
        strategy.run(lambda: w.assign_add(1.0))

    logdir, attempt = sys.argv[1], int(os.environ["ASUPERVISOR_ATTEMPT"])
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    chiefs = asv.LocalTier(os.environ["ASUPERVISOR_LOCAL_DIR"])
    own = chiefs.path + ("-another-host" if attempt == 2 and rank == 1 else "")
    tier = asv.LocalTier(own, save_secs=None, save_steps=5, mirror_every=2)

    def head(directory):
        catalog = Catalog(Store(directory), "model.ckpt", writer=False)
        catalog.load()
        commit = catalog.history.head_commit()
        return -1 if commit is None else commit.step

    def kill_when_only_local(step):
        # The chief, once its local tier's head is `step` and the logdir's is older (the
        # lockstep holds worker 1 meanwhile).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            local, logged = head(tier.tier_dir(logdir)), head(logdir)
            if local == step and 0 <= logged < step:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.05)
        say(f"not killed: local {local} logdir {logged}")

    def say(line):  # one write: the two workers share the pipe
        os.write(1, (line + "\\n").encode())

    async def main() -> None:
        sv = asv.Supervisor(
            logdir, checkpoint={"w": w}, strategy=strategy, is_chief=None, local_tier=tier,
            save_summaries_secs=0, heartbeat_secs=0.2, stop_grace_secs=30,
            hooks=[StopAtStepHook(last_step=30)],
        )
        async with sv.session() as sess:
            report = sess.restore_report
            say(f"attempt {attempt} worker {rank} restored {report.step} tier {report.tier} "
                f"w {float(w.numpy()):.0f}")
            while not sess.should_stop():
                await sess.run(step)
                if rank == 0 and attempt < 3 and sess.global_step == 11:
                    await anyio.to_thread.run_sync(kill_when_only_local, 10)
        say(f"worker {rank} stopped {sess.global_step} {sess.stop_reason}")

    sys.exit(asv.run(main))
"""


def test_a_local_commit_counts_for_the_agreed_restore_only_where_every_worker_reads_it(
    tmp_path: Path, scratch: Path
) -> None:
    from asupervisor._checkpointing.tiers import tier_name
    from asupervisor._logdir import ledger as _ledger
    from asupervisor._logdir.catalog import Catalog
    from asupervisor._logdir.store import Store

    logdir, local = tmp_path / "run", tmp_path / "local"
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(LOCAL_TIER_JOB))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TMPDIR": str(scratch),
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "asupervisor", "run", "--workers", "2",
         "--backoff", "0", "--logdir", str(logdir), "--local-dir", str(local), "--",
         *forked.runner_child(script, str(logdir))],
        capture_output=True, text=True, timeout=400, env=env,
    )  # fmt: skip
    output = done.stdout + done.stderr[-4000:]
    assert done.returncode == 0, output
    starts = re.findall(r"attempt (\d) worker (\d) restored (\d+) tier (\w+) w (\d+)", done.stdout)
    by_attempt: dict[int, set[tuple[int, str, int]]] = {}
    for attempt, _, step, tier, w in starts:
        by_attempt.setdefault(int(attempt), set()).add((int(step), tier, int(w)))
    # Every worker restores one checkpoint at every start (the same step, the same values).
    assert sorted(by_attempt) == [1, 2, 3] and len(starts) == 6, output
    assert all(len(found) == 1 for found in by_attempt.values()), by_attempt
    ((first,), (second,), (third,)) = (by_attempt[a] for a in (1, 2, 3))
    assert first == (0, "None", 0)
    # Attempt 2: the chief's host held step 10 (local only), worker 1 another local tier:
    # both restored the logdir's newest copy, 5.
    assert second == (5, "store", 5), by_attempt
    # Attempt 3: both read the chief's local tier: its newest commit, 10 (local only).
    assert third == (10, "local", 10), by_attempt
    stops = set(re.findall(r"worker \d stopped (\d+) (\w+)", done.stdout))
    assert stops == {("30", "step_limit")}, output

    tier = Catalog(Store(str(local / tier_name(str(logdir)))), "model.ckpt", writer=False)
    tier.load()
    # The local 10 of attempt 1 was set aside (abandoned) in attempt 2, never copied; the
    # local 10 of attempt 2, restored by both in attempt 3, was.
    (set_aside,) = tier.history.rollbacks
    assert "not every worker" in set_aside.reason
    abandoned = {c.name for c in tier.history.abandoned()}
    logged = Catalog(Store(str(logdir)), "model.ckpt", writer=False)
    logged.load()
    copies = {c.name: c.step for c in logged.history.committed()}
    assert len(abandoned) == 1 and not abandoned & set(copies), (abandoned, copies)
    assert sorted(copies.values())[:2] == [5, 10] and max(copies.values()) == 30, copies
    sessions = _ledger.sessions(_ledger.read(Store(str(logdir))))
    assert [(s.restored_step, s.restored_tier) for s in sessions] == [
        (0, None), (5, "store"), (10, "local"),
    ], sessions  # fmt: skip
