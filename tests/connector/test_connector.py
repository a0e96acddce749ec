"""connector.py and the package's release check, against vLLM 0.32: the releases it supports,
and the output limits it reads from vLLM's model config for lease.describe."""

import os

import pytest

if os.environ.get("VLLM_EXT_REQUIRE_VLLM") == "1":  # make test-connector: a missing vllm is a failure
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vllm is not installed here (make test-connector installs it)")

from vllm_ext.connector import check_vllm_version  # noqa: E402


@pytest.mark.parametrize("version", ["0.26.0", "0.32.0", "0.32.0+cpu", "0.33.1", "0.34.0"])
def test_supported_releases(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.25.2", "0.35.0", "1.0.0", "dev"])
def test_unsupported_release_is_refused_with_the_range(version):
    with pytest.raises(RuntimeError, match=rf"supports vLLM 0\.26 to 0\.34; this is vLLM {version}"):
        check_vllm_version(version)


def test_an_unsupported_release_is_named_before_any_import_fails():
    """Each module that imports release-specific vLLM symbols checks the release first (one
    subprocess: importing vLLM takes a while)."""
    import subprocess
    import sys

    code = ("import sys, vllm\nvllm.__version__ = '0.40.0'\n"
            "for m in ('connector', 'metadata', 'stats'):\n"
            "    for k in [k for k in sys.modules if k.startswith('vllm_ext.connector.')]:\n"
            "        del sys.modules[k]\n"
            "    try:\n        __import__('vllm_ext.connector.' + m)\n"
            "    except RuntimeError as e:\n        print(m, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    for m in ("connector", "metadata", "stats"):
        assert f"{m} vllm-ext's VllmExtConnector supports vLLM 0.26 to 0.34; this is vLLM 0.40.0" in out.stdout, \
            out.stdout + out.stderr


def test_the_output_limits_are_read_as_vllms_openai_server_reads_them():
    """(default, cap) from the model config, as vLLM's serving classes derive them; 0: none."""
    from types import SimpleNamespace

    from vllm_ext.connector.connector import max_tokens_limits

    def model(generation_config="auto", diff=None, override=None, fails=False):
        def diff_params():
            if fails:
                raise OSError("generation_config.json: unreadable")
            return dict(diff or {})
        return SimpleNamespace(generation_config=generation_config, get_diff_sampling_param=diff_params,
                               override_generation_config=dict(override or {}))

    assert max_tokens_limits(model()) == (0, 0)
    assert max_tokens_limits(model(diff={"max_tokens": 300})) == (300, 0)  # the model's generation config
    assert max_tokens_limits(model(diff={"max_tokens": 200}, override={"max_new_tokens": 200})) == (200, 200)
    assert max_tokens_limits(model("vllm", override={"max_new_tokens": 50})) == (0, 50)
    assert max_tokens_limits(model("/a/folder", diff={"max_tokens": 400})) == (400, 400)
    assert max_tokens_limits(model(diff={"max_tokens": True}, override={"max_new_tokens": 0})) == (0, 0)
    assert max_tokens_limits(model(fails=True)) == (0, 0)
