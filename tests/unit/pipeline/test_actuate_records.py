"""The records that actuation derives from an action's outcome: the checkpoint request
announced on ``telemetry.job``, and the alert for an action that failed for good."""

from __future__ import annotations

from pipeline.actuate.core import Work, checkpoint_request, failure_alert
from schemas import ActionName, ActionRecord, FaultClass, JobEventKind, Outcome


def test_a_checkpoint_action_that_reached_its_scheduler_is_announced_on_telemetry_job() -> None:
    verdict = {"id": "v-1", "ts": 1_700_000_000.0, "actions": [
        {"action": "checkpoint", "target": "ns/train", "params": {"deadline": 1_700_000_600.0, "node": "gpu-7",
                                                                  "scheduler": "kubernetes", "attempt": 2}}]}
    work = Work(key="v-1:checkpoint:ns/train", verdict=verdict, index=0, target="ns/train")

    def record(action: str, outcome: Outcome) -> ActionRecord:
        return ActionRecord(ts=1.0, key=work.key, verdict_id="v-1", action=action, target="ns/train",
                            backend="kubernetes", outcome=outcome)

    asked = checkpoint_request(work, record("checkpoint", Outcome.applied))
    assert asked is not None
    assert (asked.job, asked.event, asked.scheduler, asked.attempt) == (
        "ns/train", JobEventKind.checkpoint_requested, "kubernetes", 2)
    assert asked.checkpoint_deadline == 1_700_000_600.0 and asked.ts == 1_700_000_000.0
    assert "gpu-7" in (asked.reason or "")
    # not announced when it did not reach the job, nor for other actions
    assert checkpoint_request(work, record("checkpoint", Outcome.dry_run)) is None
    assert checkpoint_request(work, record("checkpoint", Outcome.already_so)) is None  # announced the first time
    assert checkpoint_request(work, record("checkpoint", Outcome.failed)) is None
    assert checkpoint_request(work, record("requeue", Outcome.applied)) is None


def test_an_action_that_failed_for_good_becomes_an_alert_naming_what_failed() -> None:
    verdict = {"id": "v-9", "ts": 100.0, "incident": "inc-79", "scope": "job", "subject": "ml/train",
               "fault_class": "gpu_hardware", "confidence": 0.95, "job": "ml/train", "nodes": ["gpu-3"],
               "actions": [{"action": "requeue", "target": "ml/train", "params": {"exclude": ["gpu-3"]}}]}
    work = Work(key="v-9:requeue:ml/train", verdict=verdict, index=0, target="ml/train")
    detail = "permanent: job ml/train is owned by JobSet train (jobset.x-k8s.io/v1alpha2), a kind fleetmedic cannot"
    failed = ActionRecord(ts=130.0, key=work.key, verdict_id="v-9", action="requeue", target="ml/train",
                          backend="kubernetes", outcome=Outcome.failed, detail=detail)
    alert = failure_alert(work, failed)
    assert alert is not None
    assert (alert.subject, alert.incident, alert.fault_class, alert.ts) == (
        "ml/train", "inc-79", FaultClass.gpu_hardware, 130.0)
    assert [a.action for a in alert.actions] == [ActionName.escalate]
    assert "JobSet" in alert.actions[0].params["reason"] and alert.evidence["action_failed"] == "requeue"
    assert alert.id != "v-9"  # its own id: the verdict's alert is not deduplicated away
    ok = failed.model_copy(update={"outcome": Outcome.applied})
    assert failure_alert(work, ok) is None
    esc = failed.model_copy(update={"action": ActionName.escalate})
    assert failure_alert(work, esc) is None
