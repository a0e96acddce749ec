"""Test-only faults for the live-migration tests (served through kv_connector_module_path):
the P/D tests' corruption of leased blocks (VLLM_EXT_TEST_CORRUPT), and, while the file named
by VLLM_EXT_TEST_PULL_DELAY exists, a consumer that waits that file's number of seconds before
each pull (a slow destination: its source's lease expires meanwhile)."""

import os
import time

from fault_connector import FaultInjectingConnector


class LiveFaultConnector(FaultInjectingConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        worker = self._worker
        if worker is None:
            return
        receive = worker._receive

        def slow_receive(job, deadline):
            path = os.environ.get("VLLM_EXT_TEST_PULL_DELAY", "")
            if path and os.path.exists(path):
                time.sleep(float(open(path).read() or "0"))
                deadline += float(open(path).read() or "0")
            receive(job, deadline)

        worker._receive = slow_receive
