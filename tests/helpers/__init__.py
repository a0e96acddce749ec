"""Code the tests share: plain references of the ops (reference.py), cache specs (specs.py),
library variants built from csrc/ (buildutil.py), two-process migration workers
(migration_harness.py). The vLLM servers of the end-to-end tests come from vllm_ext.fleet."""
