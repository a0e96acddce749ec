"""The built artefact: its build-info record, what it links, and that it loads anywhere."""

import json
import re
import shutil
import subprocess
import sys

import pytest

import vllm_ext
from tests.helpers.buildutil import build_variant, run_python
from vllm_ext import _lib

ALLOWED_NEEDED = re.compile(r"^(libc|libm|libstdc\+\+|libgcc_s|ld-linux[-\w]*|libdl|librt|libpthread)\.so")


def test_build_info_record():
    info = vllm_ext.build_info()
    assert set(info) >= {"version", "git_revision", "cuda_version", "arch_list", "target_device"}
    assert info["version"].startswith(vllm_ext.__version__ + "+")
    assert info["target_device"] in ("cuda", "cpu")
    assert _lib.built_with_cuda() == (info["target_device"] == "cuda")
    if info["target_device"] == "cuda":
        assert info["version"].endswith("+cu" + info["cuda_version"].replace(".", ""))
        assert info["arch_list"], "a CUDA build records its arch list"
        # The library's own record of its archs agrees with the build info.
        assert _lib.lib().vllm_ext_cuda_archs().decode().split() == info["cuda_archs"]
    else:
        assert info["version"].endswith("+cpu") and info["arch_list"] == []


def test_info_command_prints_the_record():
    out = subprocess.run([sys.executable, "-m", "vllm_ext.info"], capture_output=True, text=True,
                         check=True).stdout
    assert vllm_ext.build_info()["version"] in out
    assert "GPU" in out
    data = json.loads(subprocess.run([sys.executable, "-m", "vllm_ext.info", "--json"],
                                     capture_output=True, text=True, check=True).stdout)
    assert data["build"] == vllm_ext.build_info()


def test_import_and_build_info_need_no_torch():
    code = ("import sys, vllm_ext; vllm_ext.build_info(); from vllm_ext import _lib; _lib.lib(); "
            "assert 'torch' not in sys.modules, 'torch was imported'; print('ok')")
    result = run_python(code, {})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_loads_and_copies_without_a_visible_gpu():
    """With no GPU visible the library still loads and the CPU ops run (what CI relies on)."""
    code = ("import torch; from vllm_ext import KVCache, ops, _lib; "
            "assert _lib.device_count() == 0; "
            "c = KVCache.allocate(2, 4, 2, 1, 8, dtype=torch.float16, device='cpu'); "
            "[t.copy_(torch.randn_like(t)) for t in c.layers]; "
            "b = ops.gather_blocks(c, [3, 1]); ops.scatter_blocks(b, c, [0, 2]); "
            "assert torch.equal(ops.gather_blocks(c, [0, 2]), b); print('ok')")
    result = run_python(code, {"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf not found")
def test_library_links_only_the_c_runtime():
    out = subprocess.run(["readelf", "-d", str(_lib.LIBRARY_PATH)], capture_output=True, text=True,
                         check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    assert needed, out
    extra = [n for n in needed if not ALLOWED_NEEDED.match(n)]
    assert not extra, f"unexpected dynamic dependencies: {extra} (no libtorch, no libcudart)"


def test_library_exports_only_the_c_abi():
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not found")
    out = subprocess.run([nm, "-D", "--defined-only", str(_lib.LIBRARY_PATH)], capture_output=True,
                         text=True, check=True).stdout
    symbols = [line.split()[-1] for line in out.splitlines() if line.split()[1:2] == ["T"]]
    assert symbols and all(s.startswith("vllm_ext_") for s in symbols), symbols
    assert set(_lib._FUNCTIONS) <= set(symbols)


def test_cpu_only_build_refuses_cuda_clearly(tmp_path):
    lib = build_variant(tmp_path, "cpu")
    code = ("import torch; from vllm_ext import _lib, KVCache, ops\n"
            "assert not _lib.built_with_cuda()\n"
            "try:\n    _lib.ensure_device(0)\nexcept ValueError as e:\n    print('refused:', e)\n"
            "c = KVCache.allocate(2, 4, 2, 1, 8, dtype=torch.float16, device='cpu')\n"
            "[t.copy_(torch.randn_like(t)) for t in c.layers]\n"
            "b = ops.gather_blocks(c, [2]); ops.scatter_blocks(b, c, [3])\n"
            "assert torch.equal(ops.gather_blocks(c, [3]), b); print('cpu ops ok')\n")
    result = run_python(code, {"VLLM_EXT_LIBRARY": str(lib)})
    assert result.returncode == 0, result.stderr
    assert "refused: vllm-ext was built without CUDA" in result.stdout
    assert "cpu ops ok" in result.stdout


def test_pipeline_entry_points_refuse_bad_arguments_before_any_gpu_work():
    """The staged transfer and the inline launch check their arguments before touching a GPU
    (so this runs anywhere): a CUDA build says which argument, a CPU-only build says no CUDA."""
    import array
    import ctypes

    expected = _lib.ERR_INVALID_ARGUMENT if _lib.built_with_cuda() else _lib.ERR_NO_CUDA
    cache = _lib.Side(layer_ptrs=None, base=1 << 20, layer_stride=4096, block_stride=1024,
                      component_stride=512, num_blocks=8, block_ids=None)
    ids = array.array("q", [0, 1, 2, 3])
    some_function = ctypes.cast(ctypes.CDLL(None).abs, ctypes.c_void_p).value  # never called

    def staged(direction=_lib.STAGE_SEND, transfer=some_function, bounds=(0, 2), slot_blocks=2,
               alignment=16, events=(1, 2, 3, 4, 5), lanes=2, second=None):
        # never used: every call fails its checks
        def lane(**changes):
            fields = dict(direction=direction, slots=(ctypes.c_uint64 * 2)(1 << 21, 1 << 22),
                          slot_blocks=slot_blocks, transfer=transfer,
                          copied=(ctypes.c_void_p * 2)(*events[:2]),
                          moved=(ctypes.c_void_p * 2)(*events[2:4]), tail=events[4])
            fields.update(changes)
            return _lib.Staging(**fields)

        staging = (_lib.Staging * lanes)(*[lane(**(second or {}) if i else {}) for i in range(lanes)])
        b = array.array("q", bounds)
        with pytest.raises(_lib.VllmExtError) as info:
            _lib.staged_transfer(cache, staging, ids.buffer_info()[0], b.buffer_info()[0], 0,
                                 len(bounds) - 1, 2, 2, 512, alignment, 0)
        assert info.value.status == expected, info.value
        return str(info.value)

    assert ctypes.sizeof(_lib.Staging) == 112  # the C side static_asserts the same size
    if expected == _lib.ERR_NO_CUDA:
        assert "without CUDA" in staged()
        return
    assert "a NULL transfer function (lane 0)" in staged(transfer=None)
    assert "a NULL transfer function (lane 1)" in staged(second={"transfer": None})
    assert "a NULL event" in staged(events=(1, 2, 3, None, 5))
    assert "a NULL event" in staged(second={"tail": None})
    assert "bad lane count" in staged(lanes=_lib.MAX_LANES + 1)
    assert "bad direction or slots (lane 1)" in staged(second={"direction": _lib.STAGE_RECV})
    assert "bad direction or slots (lane 1)" in staged(second={"slot_blocks": 3})
    assert "bad direction" in staged(direction=7)
    assert "bad direction" in staged(slot_blocks=0)
    assert "holds 3 blocks, a slot 2" in staged(bounds=(0, 1, 4))
    assert "holds -1 blocks" in staged(bounds=(2, 1))
    assert "alignment 3 is not a power of two" in staged(alignment=3)
    with_ids = _lib.Side(layer_ptrs=None, base=1 << 20, layer_stride=4096, block_stride=1024,
                         component_stride=512, num_blocks=8, block_ids=ids.buffer_info()[0])
    with pytest.raises(_lib.VllmExtError, match="block_ids must be NULL") as info:
        _lib.copy_blocks_cuda_inline(with_ids, cache, None, None, 2, 2, 2, 512, 16, 0, None)
    assert info.value.status == expected
    with pytest.raises(_lib.VllmExtError, match="alignment 3 is not a power of two"):
        _lib.copy_blocks_cuda_inline(cache, cache, None, None, 2, 2, 2, 512, 3, 0, None)
