"""Settings: defaults < TOML file < environment; a bad value names its field."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import ConfigError, PolicySettings, load_settings


def test_defaults_load_without_a_file_or_environment() -> None:
    s = load_settings(environ={})
    assert s.safety.max_fraction == 0.1
    assert s.topic("verdicts") == "fleetmedic.verdicts"


def test_an_environment_variable_overrides_its_key() -> None:
    s = load_settings(environ={"FLEETMEDIC_SAFETY__MAX_FRACTION": "0.05", "FLEETMEDIC_SAFETY__DRY_RUN": "true"})
    assert s.safety.max_fraction == 0.05
    assert s.safety.dry_run is True


def test_a_bad_value_fails_naming_the_field() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(environ={"FLEETMEDIC_SAFETY__MAX_FRACTION": "2"})
    assert "safety.max_fraction" in str(err.value)
    assert err.value.code == 2


def test_an_unknown_key_is_rejected_naming_it() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(environ={"FLEETMEDIC_SAFETY__MAX_FRACTON": "0.05"})
    assert "safety.max_fracton" in str(err.value)


def test_a_toml_file_is_loaded_and_the_environment_wins_over_it(tmp_path: Path) -> None:
    path = tmp_path / "fleetmedic.toml"
    path.write_text('[kafka]\nbootstrap = "kafka-0:9092"\n\n[safety]\nmax_fraction = 0.2\nmax_absolute = 7\n')
    s = load_settings(path, environ={"FLEETMEDIC_SAFETY__MAX_FRACTION": "0.05"})
    assert s.kafka.bootstrap == "kafka-0:9092"
    assert s.safety.max_absolute == 7
    assert s.safety.max_fraction == 0.05


def test_the_config_file_can_be_named_in_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "fleetmedic.toml"
    path.write_text("[policy]\nlemon_returns = 5\n")
    s = load_settings(environ={"FLEETMEDIC_CONFIG": str(path)})
    assert s.policy.lemon_returns == 5


def test_a_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as err:
        load_settings(missing, environ={})
    assert str(err.value) == f"config file not found: {missing}"


def test_a_config_file_that_is_not_toml_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[safety\nmax_fraction = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(path, environ={})


def test_a_recent_part_longer_than_half_the_detection_window_is_rejected() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(environ={"FLEETMEDIC_DETECTORS__WINDOW_S": "600", "FLEETMEDIC_DETECTORS__RECENT_S": "301"})
    assert "detectors" in str(err.value) and "recent_s (301) must be at most half of window_s (600)" in str(err.value)


def test_the_sample_counted_window_settings_say_what_replaced_them() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(environ={"FLEETMEDIC_DETECTORS__WINDOW": "120"})
    assert "window (samples) is now window_s (event-time seconds)" in str(err.value)


def test_a_window_of_too_many_buckets_is_rejected() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(environ={"FLEETMEDIC_DETECTORS__WINDOW_S": "86400", "FLEETMEDIC_DETECTORS__BUCKET_S": "10"})
    assert "8640 buckets" in str(err.value)


def test_policy_settings_refuse_unknown_overrides() -> None:
    assert PolicySettings(transient_retries=0).transient_retries == 0
    with pytest.raises(ValueError, match="transient_retry"):
        PolicySettings(transient_retry=1)  # type: ignore[call-arg]


def test_faust_data_lives_under_the_state_dir_never_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    from pipeline.worker.app import create_app, data_dir

    monkeypatch.setenv("FLEETMEDIC_STATE", str(tmp_path / "state"))
    s = load_settings(environ={"FLEETMEDIC_KAFKA__APP_ID": "fm-dd"})
    assert data_dir(s) == tmp_path / "state" / "faust"
    app = create_app(s)
    assert Path(app.conf.datadir) == tmp_path / "state" / "faust" / "fm-dd-data"
    assert (tmp_path / "state" / "faust").is_dir()  # Faust itself makes only the last level
    explicit = load_settings(environ={"FLEETMEDIC_WORKER__DATA_DIR": str(tmp_path / "elsewhere")})
    assert data_dir(explicit) == tmp_path / "elsewhere"


def test_alert_settings_refuse_an_unknown_fault_class_and_twin_receivers(tmp_path: Path) -> None:
    path = tmp_path / "fleetmedic.toml"
    path.write_text('[alerts]\nexclude_classes = ["transient_software", "cosmic_rays"]\n')
    with pytest.raises(ConfigError) as err:
        load_settings(path, environ={})
    assert "alerts.exclude_classes" in str(err.value) and "cosmic_rays" in str(err.value)
    path.write_text('[[alerts.webhooks]]\nname = "a"\nurl = "http://127.0.0.1:1/"\n\n'
                    '[[alerts.webhooks]]\nname = "a"\nurl = "http://127.0.0.1:2/"\n')
    with pytest.raises(ConfigError, match="unique"):
        load_settings(path, environ={})
    path.write_text('[alerts]\nexclude_classes = ["user_error"]\n')
    assert load_settings(path, environ={}).alerts.exclude_classes == ["user_error"]
    path.write_text('[[alerts.webhooks]]\nname = "am"\nurl = "http://127.0.0.1:9093"\nformat = "alertmanager-api"\n'
                    'hold_s = 86400\n')
    hook = load_settings(path, environ={}).alerts.webhooks[0]
    assert (hook.format, hook.hold_s, hook.event_s) == ("alertmanager-api", 86400.0, 3600.0)
    path.write_text('[[alerts.webhooks]]\nname = "am"\nurl = "http://127.0.0.1:9093"\nformat = "alertmanager-api"\n'
                    'hold_s = 0\n')
    with pytest.raises(ConfigError, match="hold_s"):
        load_settings(path, environ={})


@pytest.mark.parametrize("field, value", [
    ("FLEETMEDIC_ACTUATORS__WEBHOOK_URL", "ftp://alerts.example/hook"),
    ("FLEETMEDIC_ACTUATORS__WEBHOOK_URL", "https://user:pw@alerts.example/hook"),
    ("FLEETMEDIC_ACTUATORS__WEBHOOK_URL", "https:///nohost"),
    ("FLEETMEDIC_ACTUATORS__WEBHOOK_URL", "https://alerts.example:99999/"),
    ("FLEETMEDIC_ACTUATORS__SIM_URL", "not a url"),
])
def test_a_bad_webhook_url_fails_at_start_naming_the_field(field, value) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(environ={field: value})
    assert field.split("__")[1].lower() in str(e.value)


def test_allowed_hosts_from_the_environment_are_comma_separated() -> None:
    s = load_settings(environ={"FLEETMEDIC_WORKER__ALLOWED_HOSTS": "svc.fleetmedic, ingress.example"})
    assert s.worker.allowed_hosts == ["svc.fleetmedic", "ingress.example"]


def test_the_sign_in_settings_reach_the_authenticator_and_bad_ones_name_their_field() -> None:
    from pipeline.worker.build import build_auth

    s = load_settings(environ={"FLEETMEDIC_AUTH__ENABLED": "true", "FLEETMEDIC_AUTH__ISSUER": "https://kc/realms/gpu",
                               "FLEETMEDIC_AUTH__AUDIENCE": "fleetmedic", "FLEETMEDIC_AUTH__JWKS_CACHE_S": "45",
                               "FLEETMEDIC_AUTH__DASHBOARD_CLIENT": "fleetmedic-dashboard"})
    a = build_auth(s)
    assert a.keys.max_ttl_s == 45 and a.keys.max_stale_s == 3600
    assert a.describe()["sign_in"] == {
        "client_id": "fleetmedic-dashboard",
        "authorization_endpoint": "https://kc/realms/gpu/protocol/openid-connect/auth",
        "token_endpoint": "https://kc/realms/gpu/protocol/openid-connect/token",
        "end_session_endpoint": "https://kc/realms/gpu/protocol/openid-connect/logout"}
    assert build_auth(load_settings(environ={"FLEETMEDIC_AUTH__ENABLED": "true", "FLEETMEDIC_AUTH__ISSUER": "https://kc/r",
                                             "FLEETMEDIC_AUTH__AUDIENCE": "a"})).describe()["sign_in"] is None
    with pytest.raises(ConfigError) as err:
        load_settings(environ={"FLEETMEDIC_AUTH__JWKS_CACHE_S": "5"})
    assert "auth.jwks_cache_s" in str(err.value)


def test_a_json_config_file_is_read_as_json_and_a_bad_one_is_a_clear_error(tmp_path: Path) -> None:
    f = tmp_path / "fleetmedic.json"
    f.write_text('{"kafka": {"partitions": 12}, "safety": {"dry_run": true}}')
    s = load_settings(environ={"FLEETMEDIC_CONFIG": str(f)})
    assert s.kafka.partitions == 12 and s.safety.dry_run is True
    f.write_text('{"kafka": ')
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_settings(environ={"FLEETMEDIC_CONFIG": str(f)})
    f.write_text('[1, 2]')
    with pytest.raises(ConfigError, match="JSON object"):
        load_settings(environ={"FLEETMEDIC_CONFIG": str(f)})
