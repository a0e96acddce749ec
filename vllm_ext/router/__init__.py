"""The router in front of vLLM instances: holds the client streams, moves running requests
between instances (live migration), drains and balances (app.py; `python -m vllm_ext.router
--help`). openai.py and legs.py are what it does to the streams, without I/O."""
