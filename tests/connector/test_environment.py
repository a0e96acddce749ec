"""vllm-ext's own environment variables are declared to vLLM once its plugin is registered, so
vLLM does not call them unknown (a warning that reads as if the deployment secret were ignored;
with VLLM's hard-fail setting, a refusal to start)."""

import os

import pytest

if os.environ.get("VLLM_EXT_REQUIRE_VLLM") == "1":  # make test-connector: a missing vllm is a failure
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vllm is not installed here (make test-connector installs it)")

from vllm.platforms import current_platform  # noqa: E402

from vllm_ext.connector import register  # noqa: E402


def test_vllm_knows_the_projects_variables_once_registered(monkeypatch):
    monkeypatch.setenv("VLLM_EXT_AUTH_SECRET", "a-secret-of-the-environment-test")
    monkeypatch.setenv("VLLM_EXT_ROUTER_TOKEN", "token")
    register()
    current_platform.validate_environ(hard_fail=True)  # ValueError naming an unknown VLLM_* variable


def test_other_unknown_variables_are_still_reported(monkeypatch):
    monkeypatch.setenv("VLLM_NOT_A_REAL_SETTING_OF_ANYONE", "1")
    register()
    with pytest.raises(ValueError, match="VLLM_NOT_A_REAL_SETTING_OF_ANYONE"):
        current_platform.validate_environ(hard_fail=True)
