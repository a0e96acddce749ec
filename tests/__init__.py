"""vllm-ext's tests, by area (ops/, migration/, connector/, e2e/, ...). A package, so that a
test imports the shared code as `tests.helpers.<module>` and the end-to-end tests' servers load
the test-only connectors as `tests.e2e.<module>`, with no path set by hand: pytest puts the
folder holding tests/ first on sys.path."""
