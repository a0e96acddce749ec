"""Random cache specs for the migration tests (a spec is a dict make_cache understands)."""

LAYOUT_PAIRS = [("flash", "flash"), ("flash", "flashinfer"), ("flashinfer", "flash"),
                ("mla", "mla")]
DTYPES = ["bfloat16", "float16", "float32", "uint8"]
# A small cache for tests in one process.
SMALL_SPEC = {"num_layers": 2, "num_blocks": 16, "block_size": 4, "num_kv_heads": 2, "head_size": 16,
              "dtype": "bfloat16", "layout": "flash", "seed": 1}


def random_spec(rng, layout, seed, num_blocks=None):
    mla = layout == "mla"
    return {
        "num_layers": rng.choice([1, 2, 5]),
        "num_blocks": num_blocks or rng.choice([17, 64, 130]),
        "block_size": rng.choice([1, 8, 16]),
        "num_kv_heads": 1 if mla else rng.choice([1, 2, 4]),
        "head_size": rng.choice([16, 64, 80]),
        "dtype": rng.choice(DTYPES),
        "layout": layout,
        "seed": seed,
    }


def same_geometry(spec, layout, seed, num_blocks):
    return dict(spec, layout=layout, seed=seed, num_blocks=num_blocks)

