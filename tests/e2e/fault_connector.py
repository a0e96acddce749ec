"""Test-only fault: a VllmExtConnector whose worker, while the file named by
VLLM_EXT_TEST_CORRUPT exists, overwrites the blocks leased in each step with noise, then writes
their ids to that path + ".done". Served by the end-to-end tests' prefill server (through
kv_connector_module_path) to show that the decode side attends over the KV it pulled.

The noise is drawn on the CPU (the same on every device) and written into the cache where it
lives; on a GPU the marker is written only once the writes are done, so a consumer's pull that
starts after it reads the noise."""

import os

import torch

from vllm_ext.connector.connector import VllmExtConnector


class FaultInjectingConnector(VllmExtConnector):
    def start_load_kv(self, forward_context, **kwargs):
        super().start_load_kv(forward_context, **kwargs)
        meta = self._meta()
        path = os.environ.get("VLLM_EXT_TEST_CORRUPT", "")
        if meta is None or not meta.new_leases or not path or not os.path.exists(path):
            return
        g = torch.Generator().manual_seed(1234)
        layers = self._worker.cache.layers
        for blocks in meta.new_leases.values():
            for layer in layers:
                noise = torch.randn((len(blocks), *layer.shape[1:]), generator=g) * 3
                layer[blocks] = noise.to(device=layer.device, dtype=layer.dtype)
        if layers[0].is_cuda:
            torch.cuda.synchronize(layers[0].device)
        corrupted = [str(b) for blocks in meta.new_leases.values() for b in blocks]
        with open(path + ".done.tmp", "w") as f:
            f.write(" ".join(corrupted))
        os.replace(path + ".done.tmp", path + ".done")


class OverrunConnector(VllmExtConnector):
    """A decode server that sends past max_tokens: while the file named by VLLM_EXT_TEST_OVERRUN
    exists, each new request's output limit in the scheduler is raised by that file's number of
    tokens (the API server, which knows the request's max_tokens, is not told), so its answer
    goes on past what the client asked for."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        path = os.environ.get("VLLM_EXT_TEST_OVERRUN", "")
        if path and request.max_tokens == request.sampling_params.max_tokens:
            try:
                with open(path) as f:
                    request.max_tokens += int(f.read() or "0")
            except OSError:  # not there (any more): the request's own limit
                pass
        return super().get_num_new_matched_tokens(request, num_computed_tokens)
