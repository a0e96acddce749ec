"""`python -m vllm_ext.proxy`: the P/D proxy, which lives in vllm_ext/router/pd.py."""
from .router.pd import Backend, Pool, Proxy, build_app, main  # noqa: F401

if __name__ == "__main__":
    main()
