"""kv_params' prompt hash, which producer and consumer compare (runs without vllm)."""

import hashlib
import random
import struct

from vllm_ext.lease.kv_params import prompt_hash


def test_prompt_hash_is_sha256_of_the_ids_as_little_endian_int64():
    rng = random.Random()
    ids = [rng.randrange(1 << 40) for _ in range(rng.randint(1, 3000))]
    assert prompt_hash(ids) == hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()
    assert prompt_hash(range(5)) == prompt_hash((0, 1, 2, 3, 4)) != prompt_hash([0, 1, 2, 3, 5])
    assert prompt_hash([]) == hashlib.sha256(b"").hexdigest()
