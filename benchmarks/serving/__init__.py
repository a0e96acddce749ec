"""The serving benchmark: real vLLM OpenAI servers in several topologies, the same load from
vLLM's own load generator against each, Llumnix's latency table and vLLM's figures side by side.

    python -m benchmarks.serving                 # this machine's preset (gpu, or cpu without one)
    python -m benchmarks.serving --preset ci     # a few dozen short requests, checked

The model folder (config.json of a shape, a BPE tokenizer trained offline) and the processes
come from vllm_ext.fleet.

dataset.py   the ShareGPT-format requests, lengths drawn from stated distributions
servers.py   the instances, router and proxy of each topology
load.py      vLLM's load generator (`vllm bench serve`) in a child process
figures.py   Llumnix's table from vLLM's per-request data, and the completeness checks
report.py    Markdown, JSON and PNG
"""
