"""Test-only fault: a producer on a saturated host. While the file named by
VLLM_EXT_TEST_SLOW_GRANT exists, each engine step whose worker grants leases ends that file's
number of seconds late (its worker's output, which tells the scheduler the blocks are served,
comes after a forward slowed down by other work on the host's cores). Served by the end-to-end
tests' bounded prefill server through kv_connector_module_path."""

import os
import time

from vllm_ext.connector.connector import VllmExtConnector


class BusyProducerConnector(VllmExtConnector):
    def build_connector_worker_meta(self):
        meta = super().build_connector_worker_meta()
        path = os.environ.get("VLLM_EXT_TEST_SLOW_GRANT", "")
        if meta is not None and meta.granted and path:
            try:
                with open(path) as f:
                    delay = float(f.read() or "0")
            except OSError:  # not there (any more): a step of normal length
                delay = 0.0
            time.sleep(delay)
        return meta
