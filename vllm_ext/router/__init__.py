"""The HTTP fronts in front of vLLM instances. The router (`python -m vllm_ext.router`; app.py
wires its parts) holds the client streams, moves running requests between instances (live
migration), drains and balances; openai.py and legs.py are what it does to the streams, without
I/O. The P/D proxy (`python -m vllm_ext.proxy`) is pd.py. Neither imports torch or vLLM."""
