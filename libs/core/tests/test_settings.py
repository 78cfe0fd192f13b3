from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import Field

from goodput_core.settings import ServiceSettings, load_settings, service_config


class DemoSettings(ServiceSettings):
    model_config = service_config("GOODPUT_DEMO_")
    grpc_port: int = 50099
    max_queue: int = Field(10, ge=0)


def test_env_prefix_is_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOODPUT_DEMO_MAX_QUEUE", "42")
    monkeypatch.setenv("GOODPUT_DEMO_LOG_LEVEL", "DEBUG")
    s = load_settings(DemoSettings)
    assert s.max_queue == 42 and s.log_level == "DEBUG" and s.grpc_port == 50099


def test_bad_value_fails_fast_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GOODPUT_DEMO_MAX_QUEUE", "-1")
    with pytest.raises(SystemExit) as exc:
        load_settings(DemoSettings)
    assert exc.value.code == 2
    assert "GOODPUT_DEMO_MAX_QUEUE" in capsys.readouterr().err


def test_a_service_refuses_to_start_on_a_bad_setting() -> None:
    env = {"GOODPUT_SCHEDULER_HEALTH_INTERVAL_S": "soon", "PATH": ""}
    proc = subprocess.run([sys.executable, "-m", "goodput_scheduler"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "GOODPUT_SCHEDULER_HEALTH_INTERVAL_S" in proc.stderr
