"""Topic names: every table's changelog is created by us, with its source's partitions."""

from __future__ import annotations

from pipeline.worker.app import create_app
from pipeline.config import load_settings
from pipeline.worker.topics import changelog_specs, faust_specs, topic_specs


def test_changelog_specs_match_the_tables_faust_declares():
    s = load_settings(environ={}, overrides={"kafka": {"app_id": "fm-test", "partitions": 6, "decision_partitions": 1}})
    app = create_app(s)
    declared = {t.changelog_topic.get_topic_name(): t.partitions for t in app.tables.values()}
    specs = {spec.name: spec.partitions for spec in changelog_specs(s).values()}
    assert declared == specs
    assert all(spec.compacted for spec in changelog_specs(s).values())


def test_tables_are_co_partitioned_with_their_source_topics():
    s = load_settings(environ={}, overrides={"kafka": {"partitions": 6, "decision_partitions": 1}})
    topics = topic_specs(s)
    changelogs = changelog_specs(s)
    assert changelogs["changelog.node_to_health"].partitions == topics["anomalies"].partitions
    assert changelogs["changelog.job_to_history"].partitions == topics["telemetry.job"].partitions
    assert changelogs["changelog.breaker_state"].partitions == topics["verdicts"].partitions == 1


def test_every_topic_faust_would_declare_is_created_by_us_and_faust_declares_none():
    """The worker starts while a broker is down only if Faust sends no CreateTopics of its own."""
    s = load_settings(environ={}, overrides={"kafka": {"app_id": "fm-test", "partitions": 6, "decision_partitions": 1}})
    app = create_app(s)
    assert app.conf.topic_allow_declare is False
    ours = {spec.name for spec in {**topic_specs(s), **faust_specs(s)}.values()}
    declared = {app._leader_assignor._leader_topic_name}  # type: ignore[attr-defined]
    for agent in app.agents.values():  # every topic an agent subscribes to
        declared.update(agent.channel.topics)
    declared.update(t.changelog_topic.get_topic_name() for t in app.tables.values())
    assert declared <= ours, declared - ours
