"""Training progress end to end: a trainer's ReportStageTimings carries the loss (and
the eval metric); the daemon keeps the latest per job; GetJob, ListJobs and the
``hetpilot job|jobs|watch`` commands show it, NaN included."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hetpilot.daemon.records import JobProgress, TimingsRecord
from hetpilot.v1 import agent_pb2_grpc, job_pb2, job_pb2_grpc, trainer_pb2, trainer_pb2_grpc

from hetpilot.channel import metadata
from hetpilot.cli import main

from .conftest import CLUSTER_MD, OWNER_MD, OWNER_TOKEN, RunningDaemon
from .helpers import register_request, report, submit_request

pytestmark = pytest.mark.timeout(60)
T = 5.0


def _report(job_id: str, rank: int, step: int, loss: float | None = None,
            eval_metric: float | None = None) -> trainer_pb2.StageTimingsReport:
    req = trainer_pb2.StageTimingsReport(
        job_id=job_id, rank=rank, plan_version=1, iteration=step,
        stages=[trainer_pb2.StageTiming(stage_index=rank, device_id=f"a:{rank}", fwd_s=0.1,
                                        bwd_s=0.2, comm_s=0.01, samples_per_s=100.0)])
    if loss is not None:
        req.loss = loss
    if eval_metric is not None:
        req.eval_metric = eval_metric
    return req


def _trainer_md(daemon: RunningDaemon, job_id: str) -> tuple[tuple[str, str], ...]:
    """Bearer metadata of the job's trainers (the token its owner is given)."""
    info = job_pb2_grpc.JobServiceStub(daemon.channel()).GetJob(
        job_pb2.GetJobRequest(job_id=job_id), metadata=OWNER_MD, timeout=T)
    return metadata(info.trainer_token)


def _job_with_plan(daemon: RunningDaemon) -> str:
    ch = daemon.channel()
    reg = agent_pb2_grpc.AgentServiceStub(ch).Register(register_request("a", 2),
                                                       metadata=CLUSTER_MD, timeout=T)
    list(agent_pb2_grpc.AgentServiceStub(ch).Report(iter([report("a", 1, 2, registration=reg.registration)]),
                                                    metadata=CLUSTER_MD, timeout=T))
    jobs = job_pb2_grpc.JobServiceStub(ch)
    job_id = jobs.SubmitJob(submit_request(), metadata=OWNER_MD, timeout=T).job_id
    deadline = time.monotonic() + 20
    while jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), metadata=OWNER_MD,
                      timeout=T).plan_version < 1:
        assert time.monotonic() < deadline, "no plan"
        time.sleep(0.1)
    return str(job_id)


def _cli(daemon: RunningDaemon, capsys: pytest.CaptureFixture[str],
         monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    monkeypatch.setenv("HETPILOT_ADDRESS", daemon.address)
    monkeypatch.setenv("HETPILOT_TOKEN", OWNER_TOKEN)
    monkeypatch.setenv("COLUMNS", "200")
    capsys.readouterr()
    assert main(list(args)) == 0
    return capsys.readouterr().out


def test_reported_loss_reaches_job_jobs_and_watch(
        daemon: RunningDaemon, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = _job_with_plan(daemon)
    ch = daemon.channel()
    trainer = trainer_pb2_grpc.TrainerServiceStub(ch)
    jobs = job_pb2_grpc.JobServiceStub(ch)

    def get() -> job_pb2.JobInfo:
        return jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), metadata=OWNER_MD, timeout=T)

    assert not get().HasField("loss") and not get().HasField("eval_metric")
    text = _cli(daemon, capsys, monkeypatch, "watch", job_id, "--count", "1")
    assert "loss: none reported yet" in text
    assert "plan v1  slot" in text  # not a terminal: plain lines as they come (issue 16)
    out = json.loads(_cli(daemon, capsys, monkeypatch, "job", job_id, "--json"))
    assert "loss" not in out and out["loss_step"] == 0

    # epoch end: every rank reports the same loss and the eval metric
    for rank in (0, 1):
        trainer.ReportStageTimings(_report(job_id, rank, 8, loss=0.6931, eval_metric=0.875),
                                   metadata=_trainer_md(daemon, job_id), timeout=T)
    # a partial epoch: a newer loss, no eval metric (the last one stays)
    trainer.ReportStageTimings(_report(job_id, 0, 10, loss=0.5), metadata=_trainer_md(daemon, job_id),
                               timeout=T)
    # a report without a loss changes nothing
    trainer.ReportStageTimings(_report(job_id, 1, 11), metadata=_trainer_md(daemon, job_id), timeout=T)
    info = get()
    assert info.loss == 0.5 and info.loss_step == 10 and info.loss_unix_ms > 0
    assert info.eval_metric == 0.875 and info.eval_step == 8

    out = json.loads(_cli(daemon, capsys, monkeypatch, "job", job_id, "--json"))
    assert (out["loss"], out["loss_step"], out["eval_metric"], out["eval_step"]) == (
        0.5, 10, 0.875, 8)
    text = _cli(daemon, capsys, monkeypatch, "job", job_id)
    assert "0.5 (step 10)" in text and "eval metric" in text and "0.875 (step 8)" in text
    listing = _cli(daemon, capsys, monkeypatch, "jobs")
    assert "loss" in listing and "0.5" in listing
    listed = json.loads(_cli(daemon, capsys, monkeypatch, "jobs", "--json"))
    assert [(j["job_id"], j["loss"]) for j in listed] == [(job_id, 0.5)]

    # watch --json: a progress line (no "version"), then one line per plan version
    lines = [json.loads(line) for line in _cli(daemon, capsys, monkeypatch, "watch", job_id,
                                               "--json", "--count", "1").splitlines()]
    assert lines[0] == {"job_id": job_id, "progress": {
        "loss": 0.5, "loss_step": 10, "loss_unix_ms": info.loss_unix_ms, "eval_metric": 0.875,
        "eval_step": 8}}
    assert [line["version"] for line in lines[1:]] == [1]
    text = _cli(daemon, capsys, monkeypatch, "watch", job_id, "--count", "1")
    assert "loss 0.5 at step 10, eval metric 0.875 at step 8" in text

    # a diverged run is shown, not refused: "nan" in tables, "NaN" in JSON
    trainer.ReportStageTimings(_report(job_id, 0, 12, loss=math.nan), metadata=_trainer_md(daemon, job_id),
                               timeout=T)
    info = get()
    assert math.isnan(info.loss) and info.loss_step == 12
    assert "nan (step 12)" in _cli(daemon, capsys, monkeypatch, "job", job_id)
    assert json.loads(_cli(daemon, capsys, monkeypatch, "job", job_id, "--json"))["loss"] == "NaN"


def test_an_ended_job_refuses_stage_timings_and_keeps_its_final_loss(
        daemon: RunningDaemon) -> None:
    import grpc

    job_id = _job_with_plan(daemon)
    ch = daemon.channel()
    trainer = trainer_pb2_grpc.TrainerServiceStub(ch)
    md = _trainer_md(daemon, job_id)
    trainer.ReportStageTimings(_report(job_id, 0, 100, loss=0.25), metadata=md, timeout=T)
    trainer.FinishJob(trainer_pb2.FinishJobRequest(
        job_id=job_id, outcome=trainer_pb2.JOB_OUTCOME_SUCCEEDED), metadata=md, timeout=T)
    with pytest.raises(grpc.RpcError) as err:
        trainer.ReportStageTimings(_report(job_id, 0, 7, loss=math.nan), metadata=md, timeout=T)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "has ended (succeeded)" in (err.value.details() or "").lower()
    info = job_pb2_grpc.JobServiceStub(ch).GetJob(job_pb2.GetJobRequest(job_id=job_id),
                                                  metadata=OWNER_MD, timeout=T)
    assert info.loss == 0.25 and info.loss_step == 100


def test_progress_survives_a_daemon_restart(tmp_path: Path) -> None:
    from .conftest import start_daemon

    d = start_daemon(tmp_path / "state")
    try:
        job_id = _job_with_plan(d)
        trainer_pb2_grpc.TrainerServiceStub(d.channel()).ReportStageTimings(
            _report(job_id, 0, 4, loss=1.25, eval_metric=-3.5), metadata=_trainer_md(d, job_id), timeout=T)
    finally:
        d.stop()
    d = start_daemon(tmp_path / "state")
    try:
        info = job_pb2_grpc.JobServiceStub(d.channel()).GetJob(
            job_pb2.GetJobRequest(job_id=job_id), metadata=OWNER_MD, timeout=T)
        assert (info.loss, info.loss_step, info.eval_metric, info.eval_step) == (1.25, 4, -3.5, 4)
    finally:
        d.stop()


@pytest.mark.slow
def test_watch_shows_a_loss_reported_while_it_runs(daemon: RunningDaemon,
                                                   tmp_path: Path) -> None:
    """``watch`` fetches the progress between plan versions and once more when the job ends."""
    job_id = _job_with_plan(daemon)
    env = {**os.environ, "HETPILOT_ADDRESS": daemon.address, "HETPILOT_TOKEN": OWNER_TOKEN}
    out = tmp_path / "watch.out"
    with out.open("w") as sink:
        watcher = subprocess.Popen(
            [sys.executable, "-m", "hetpilot", "watch", job_id, "--json", "--interval", "0.2"],
            env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 30
            while '"version"' not in out.read_text():  # the watcher is up
                assert time.monotonic() < deadline and watcher.poll() is None, out.read_text()
                time.sleep(0.1)
            ch = daemon.channel()
            trainer_pb2_grpc.TrainerServiceStub(ch).ReportStageTimings(
                _report(job_id, 0, 3, loss=2.5), metadata=_trainer_md(daemon, job_id), timeout=T)
            while '"progress"' not in out.read_text():
                assert time.monotonic() < deadline and watcher.poll() is None, out.read_text()
                time.sleep(0.1)
            trainer_pb2_grpc.TrainerServiceStub(ch).ReportStageTimings(
                _report(job_id, 0, 6, loss=2.0, eval_metric=0.5), metadata=_trainer_md(daemon, job_id),
                timeout=T)
            job_pb2_grpc.JobServiceStub(ch).CancelJob(job_pb2.CancelJobRequest(job_id=job_id),
                                                      metadata=OWNER_MD, timeout=T)
            assert watcher.wait(timeout=20) == 0, out.read_text()
        finally:
            if watcher.poll() is None:
                watcher.kill()
                watcher.wait(10)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    progress = [line["progress"] for line in lines if "progress" in line]
    assert progress[0]["loss"] == 2.5 and progress[0]["loss_step"] == 3
    assert progress[-1]["loss"] == 2.0 and progress[-1]["eval_metric"] == 0.5
    versions = [line["version"] for line in lines if "version" in line]
    assert versions == list(range(1, len(versions) + 1))


def _timings(step: int, loss: float | None = None, eval_metric: float | None = None,
             unix_ms: int = 0) -> TimingsRecord:
    return TimingsRecord(job_id="j", rank=0, plan_version=1, iteration=step, stages=(),
                         unix_ms=unix_ms, loss=loss, eval_metric=eval_metric)


def test_progress_update_rules() -> None:
    p0 = JobProgress()
    assert p0.updated(_timings(3)) is p0  # nothing to take
    p1 = p0.updated(_timings(8, loss=0.7, eval_metric=0.9, unix_ms=100))
    assert p1 == JobProgress(loss=0.7, loss_step=8, loss_unix_ms=100, eval_metric=0.9,
                             eval_step=8)
    # another rank, same step and values: unchanged (first report's time kept)
    assert p1.updated(_timings(8, loss=0.7, eval_metric=0.9, unix_ms=105)) is p1
    # a newer loss without an eval metric keeps the eval metric
    p2 = p1.updated(_timings(10, loss=0.5, unix_ms=200))
    assert (p2.loss, p2.loss_step, p2.eval_metric, p2.eval_step) == (0.5, 10, 0.9, 8)
    # the latest report wins, also a smaller step (a trainer restarted from scratch)
    p3 = p2.updated(_timings(2, loss=1.5, unix_ms=300))
    assert (p3.loss, p3.loss_step, p3.loss_unix_ms) == (1.5, 2, 300)
    # NaN is kept, and a second rank's NaN at the same step changes nothing
    p4 = p3.updated(_timings(4, loss=math.nan, unix_ms=400))
    assert math.isnan(p4.loss or 0.0) and p4.loss_step == 4
    assert p4.updated(_timings(4, loss=math.nan, unix_ms=401)) is p4
