"""Test-only faults of a producer. A saturated host: while the file named by
VLLM_EXT_TEST_SLOW_GRANT exists, each engine step whose worker grants leases ends that file's
number of seconds late (its worker's output, which tells the scheduler the blocks are served,
comes after a forward slowed down by other work on the host's cores). A load that fails: while
the file named by VLLM_EXT_TEST_SHORT_COUNT exists, each lease's kv_transfer_params name one
token less than the lease holds, so the decode side's acquire names a prefix the producer did not
lease and is refused (NotThisPrompt): the load fails, as any failed load, and the lease is freed.
Served by the end-to-end tests' bounded prefill server through kv_connector_module_path."""

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

    def request_finished(self, request, block_ids):
        delay_free, params = super().request_finished(request, block_ids)
        path = os.environ.get("VLLM_EXT_TEST_SHORT_COUNT", "")
        if params and path and os.path.exists(path) and isinstance(params.get("remote_num_tokens"), int):
            params = dict(params, remote_num_tokens=params["remote_num_tokens"] - 1)
        return delay_free, params
