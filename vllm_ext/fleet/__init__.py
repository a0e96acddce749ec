"""A local fleet for tests, benchmarks and examples: tiny model folders written offline, vLLM
servers and the fronts before them started as child processes on 127.0.0.1, and the HTTP calls
that watch them.

    from vllm_ext import fleet

    model = fleet.write_checkpoint(work / "model")          # a seeded random Llama (TINY)
    fleet.write_word_tokenizer(model)
    server = fleet.start_vllm("a", model, work, core="0", tokenizer=True)
    try:
        server.wait_healthy()
        status, body = fleet.post(server.url + "/v1/completions", {"model": "tiny", "prompt": "w5 w6"})
    finally:
        server.stop()

models.py     model folders: random Llamas, config-only folders, their tokenizers (tokenizers.py)
process.py    a child process in its own group, free ports, /health, POST and /metrics
servers.py    vLLM servers per kind of device (DEVICES), their environment and arguments
real_model.py the real test model (SmolLM2-135M-Instruct), fetched, checked and converted once

Importing it loads no torch, vLLM or aiohttp: a writer imports torch and transformers when it
runs, and servers run in their own processes.
"""

from .models import (
    LLAMA_7B,
    TINY,
    TINY_GPU,
    VOCAB_SIZE,
    write_7b_config,
    write_chat_model,
    write_config,
    write_random_llama,
    write_text_model,
    write_word_tokenizer,
)
from .process import REQUEST_TIMEOUT_S, STARTUP_TIMEOUT_S, Process, events, free_port, metrics, post, stop_all
from .real_model import RealModelError, real_model_folder
from .servers import (
    BLOCK_SIZE,
    CPU,
    DEVICES,
    SECRET,
    Device,
    start_front,
    start_proxy,
    start_router,
    start_vllm,
    vllm_env,
    write_checkpoint,
)

__all__ = [
    "BLOCK_SIZE", "CPU", "DEVICES", "LLAMA_7B", "REQUEST_TIMEOUT_S", "SECRET", "STARTUP_TIMEOUT_S", "TINY",
    "TINY_GPU", "VOCAB_SIZE", "Device", "Process", "RealModelError", "events", "free_port", "metrics", "post",
    "real_model_folder", "start_front", "start_proxy", "start_router", "start_vllm", "stop_all",
    "vllm_env", "write_7b_config", "write_chat_model", "write_checkpoint", "write_config", "write_random_llama",
    "write_text_model", "write_word_tokenizer",
]
