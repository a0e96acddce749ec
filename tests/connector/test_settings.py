"""kv_connector_extra_config is checked when the connector is built: every key the connector
reads is parsed in settings.py, an unknown key is refused with the closest known one, a value
of the wrong type or out of range with the key and what it should be. Through vLLM's own config
classes (KVTransferConfig, VllmConfig) and the connector's constructor, then once through a
real vLLM server that must exit with the message."""

import dataclasses
import json
import os
import random
import time

import pytest

if os.environ.get("VLLM_EXT_REQUIRE_VLLM") == "1":  # make test-connector: a missing vllm is a failure
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vllm is not installed here (make test-connector installs it)")

from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from vllm_ext.connector import register  # noqa: E402
from vllm_ext.connector.settings import KNOWN_KEYS, ConnectorSettings  # noqa: E402

register()

ROLES = (KVConnectorRole.WORKER, KVConnectorRole.SCHEDULER)

# (a mistyped key, the key it should have been)
TYPOS = [("lease_prot", "lease_port"), ("conect_to", "connect_to"), ("pull_timeout", "pull_timeout_s"),
         ("verify_kvs", "verify_kv"), ("allowed_producer", "allowed_producers"), ("leas_s", "lease_s"),
         ("backend_option", "backend_options"), ("load_whole_block", "load_whole_blocks"), ("laod", "load"),
         ("sync_load_timeout", "sync_load_timeout_s")]

# (key, a wrong value, what the message says a value should be)
WRONG = [
    ("lease_port", "abc", "an integer port 0-65535"),
    ("lease_port", "8101", "an integer port 0-65535"),
    ("lease_port", 70000, "an integer port 0-65535"),
    ("lease_port", -1, "an integer port 0-65535"),
    ("lease_port", 8101.5, "an integer port 0-65535"),
    ("lease_port", True, "an integer port 0-65535"),
    ("lease_s", 0, "seconds in (0, 3600]"),
    ("lease_s", "30", "seconds in (0, 3600]"),
    ("lease_s", 7200, "seconds in (0, 3600]"),
    ("pull_timeout_s", -1, "seconds in (0, 600]"),
    ("pull_timeout_s", None, "seconds in (0, 600]"),
    ("max_leased_fraction", 1.5, "a fraction of the KV cache in (0, 1]"),
    ("max_leased_fraction", 0, "a fraction of the KV cache in (0, 1]"),
    ("verify_kv", "false", "true or false"),
    ("verify_kv", 0, "true or false"),
    ("load_whole_blocks", "yes", "true or false"),
    ("connect_to", "127.0.0.1:8101", "a list of 'host:port' (port 1-65535)"),
    ("connect_to", ["127.0.0.1"], "a list of 'host:port' (port 1-65535)"),
    ("connect_to", ["http://127.0.0.1:8101"], "a list of 'host:port' (port 1-65535)"),
    ("allowed_producers", ["127.0.0.1:0"], "a list of 'host:port' (port 1-65535)"),
    ("endpoint_host", "", "a host name or IP address"),
    ("lease_host", "http://prefill", "a host name or IP address"),
    ("lease_host", 8101, "a host name or IP address"),
    ("backend", "glo", 'one of "ipc", "nccl", "gloo"'),
    ("backend_options", ["stripes", 2], "an object of the backend's options"),
    ("load", "fast", 'one of "auto", "sync", "async"'),
    ("load", True, 'one of "auto", "sync", "async"'),
    ("load", "SYNC", 'one of "auto", "sync", "async"'),
    ("sync_load_timeout_s", 0, "seconds in (0, 600]"),
    ("sync_load_timeout_s", "2", "seconds in (0, 600]"),
]


def vllm_config(extra, role="kv_both"):
    """vLLM's config of an instance whose --kv-transfer-config is this JSON (a CPU instance)."""
    cli = json.dumps({"kv_connector": "VllmExtConnector", "kv_role": role, "kv_connector_extra_config": extra})
    return VllmConfig(kv_transfer_config=KVTransferConfig(**json.loads(cli)), device_config=DeviceConfig("cpu"))


def refusal(extra, role=KVConnectorRole.WORKER) -> str:
    """The message the connector's constructor refuses `extra` with."""
    from vllm_ext.connector.connector import VllmExtConnector

    with pytest.raises(ValueError) as e:
        VllmExtConnector(vllm_config(extra), role)
    return str(e.value)


@pytest.mark.parametrize("typo,meant", TYPOS)
def test_an_unknown_key_is_refused_with_the_closest_known_one(typo, meant):
    for role in ROLES:  # the worker's connector is built before the model loads: it says so first
        message = refusal({typo: 1}, role)
        assert f'unknown key "{typo}" (did you mean "{meant}"?)' in message, message
        assert message.startswith("VllmExtConnector: kv_connector_extra_config"), message


def test_an_unknown_key_with_no_close_one_lists_the_known_keys():
    name = "".join(random.choice("qxzjvw") for _ in range(12))
    message = refusal({name: 1})
    assert f'unknown key "{name}" (known: ' in message and all(key in message for key in KNOWN_KEYS), message


@pytest.mark.parametrize("key,value,expected", WRONG)
def test_a_wrong_value_is_refused_naming_the_key_and_the_type(key, value, expected):
    message = refusal({key: value})
    assert f"kv_connector_extra_config.{key}: expected {expected}" in message, message
    assert message.endswith(f"got {value!r}"), message


def test_every_problem_is_named_at_once():
    message = refusal({"lease_prot": 8101, "lease_port": "abc", "verify_kv": "no"})
    assert message.startswith("VllmExtConnector: 3 problems in kv_connector_extra_config:"), message
    for part in ('"lease_prot" (did you mean "lease_port"?)', "lease_port: expected an integer port",
                 "verify_kv: expected true or false"):
        assert part in message, message


@pytest.mark.parametrize("backend,option,meant", [("gloo", "stripe", "stripes"), ("gloo", "chunk_byte", "chunk_bytes"),
                                                  ("nccl", "lane", "lanes"), (None, "stripess", "stripes")])
def test_a_backend_option_is_checked_against_that_backend(backend, option, meant):
    extra = {"backend_options": {option: 2}, **({"backend": backend} if backend else {})}
    message = refusal(extra)
    shown = backend or "gloo"  # a CPU instance's default
    assert (f'kv_connector_extra_config.backend_options: unknown {shown} backend option "{option}" '
            f'(did you mean "{meant}"?)') in message, message


def test_the_settings_read_are_the_ones_given():
    rng = random.Random()
    port = rng.randrange(1, 65536)
    producers = [f"10.0.{rng.randrange(256)}.{rng.randrange(256)}:{rng.randrange(1, 65536)}" for _ in range(3)]
    extra = {"backend": "gloo", "backend_options": {"stripes": 2}, "endpoint_host": "10.1.2.3", "lease_host": "prefill",
             "lease_port": port, "lease_s": 12.5, "max_leased_fraction": 0.25, "pull_timeout_s": 3,
             "connect_to": producers, "verify_kv": False, "load_whole_blocks": False, "load": "sync",
             "sync_load_timeout_s": 0.75}
    config = vllm_config(extra).kv_transfer_config
    s = ConnectorSettings.parse(config.kv_connector_extra_config, device_type="cpu")
    assert (s.backend, dict(s.backend_options), s.endpoint_host, s.lease_host, s.lease_port) == \
        ("gloo", {"stripes": 2}, "10.1.2.3", "prefill", port)
    assert (s.lease_s, s.max_leased_fraction, s.pull_timeout_s, s.verify_kv, s.load_whole_blocks) == \
        (12.5, 0.25, 3.0, False, False)
    assert (s.load, s.sync_load_timeout_s) == ("sync", 0.75)
    assert s.connect_to == s.allowed_producers == tuple(producers)  # allowed_producers defaults to connect_to
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.lease_port = 1


def test_defaults_follow_the_device():
    cpu, gpu = ConnectorSettings.parse(None, device_type="cpu"), ConnectorSettings.parse({}, device_type="cuda")
    assert cpu.load_whole_blocks and not gpu.load_whole_blocks
    assert (cpu.backend, cpu.lease_port, cpu.lease_s, cpu.pull_timeout_s, cpu.max_leased_fraction, cpu.verify_kv) == \
        (None, 0, 30.0, 10.0, 0.5, True)
    assert ConnectorSettings.parse({"connect_to": ["a:1"], "allowed_producers": []}).allowed_producers == ()
    # a sync load holds D's whole step: on a GPU its own, shorter deadline; on CPU the pull's
    assert (cpu.load, gpu.load, cpu.sync_load_timeout_s, gpu.sync_load_timeout_s) == ("auto", "auto", 10.0, 2.0)
    assert ConnectorSettings.parse({"pull_timeout_s": 0.5}, device_type="cuda").sync_load_timeout_s == 0.5
    assert ConnectorSettings.parse({"pull_timeout_s": 30}, device_type="cpu").sync_load_timeout_s == 30.0


@pytest.mark.serves
def test_a_real_server_with_a_typo_exits_naming_it(tmp_path):
    """A vLLM CPU server whose kv_connector_extra_config has a typo exits with the message (vLLM
    0.32 builds the worker's connector once the model is loaded, before the compile warm-up):
    no healthy server on a random lease port. Deadline: the server's start-up allowance."""
    from vllm_ext import fleet

    model = fleet.write_checkpoint(tmp_path / "model")
    server = fleet.start_vllm("typo", model, tmp_path, core="0",
                              kv_config={"kv_connector": "VllmExtConnector", "kv_role": "kv_producer",
                                         "kv_connector_extra_config": {"lease_prot": fleet.free_port()}})
    try:
        deadline = time.monotonic() + fleet.STARTUP_TIMEOUT_S
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1.0)
        assert server.proc.poll() not in (None, 0), "the server did not exit:\n" + server.log_tail()
        log = server.log_path.read_text(errors="replace")
        assert 'kv_connector_extra_config: unknown key "lease_prot" (did you mean "lease_port"?)' in log, \
            server.log_tail()
    finally:
        server.stop()
