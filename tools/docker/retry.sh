#!/bin/sh
# retry.sh CMD [ARGS...]: runs CMD up to $RETRIES times (default 3), waiting longer each time,
# because package mirrors and indexes fail transiently. Used inside Docker builds.
# When the build passed a CA bundle as the BuildKit secret `ca-bundle`, pip and uv use it
# (behind a TLS-inspecting proxy pip otherwise finds no versions at all).
if [ -s /run/secrets/ca-bundle ]; then
  export PIP_CERT=/run/secrets/ca-bundle SSL_CERT_FILE=/run/secrets/ca-bundle
fi
tries=${RETRIES:-3}
n=1
until "$@"; do
  status=$?
  if [ "$n" -ge "$tries" ]; then
    echo "retry: '$*' failed $n times (last exit status $status)" >&2
    exit "$status"
  fi
  echo "retry: '$*' failed (exit status $status), attempt $((n + 1)) of $tries in $((n * 15))s" >&2
  sleep $((n * 15))
  n=$((n + 1))
done
