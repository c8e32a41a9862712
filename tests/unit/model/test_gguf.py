"""A GGUF file as the model (model/gguf.py, loading.resolve_model). A tiny model of each family
that llama.cpp and transformers both know, written here as GGUF the way llama.cpp's converter
writes one (its tensor names, Llama's interleaved q/k rows, a byte-level BPE vocabulary), is
converted once into a cache folder named by the file's sha256 and computes transformers' logits
of the original; `decentrl train` runs from such a file, and its export's model card names it. An
architecture transformers cannot read, a family decentrl does not run, a mixture of experts
transformers would read as dense and a file that is not GGUF are refused by name, before
anything is converted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from decentrl.model import loading
from decentrl.model.gguf import CONVERTED_FROM, file_sha256, gguf_families
from decentrl.model.loading import base_origin, load_model, load_tokenizer, resolve_model
from decentrl.model.spec import UnsupportedModel
from decentrl.model.stages import StagePlan, build_stages
from decentrl.model.tiny import make_tiny_model
from decentrl.release.export import export_run
from tests.unit.cli.test_train_families import train_two_steps
from tests.unit.model.families.conformance import (
    TOLERANCE,
    chain_logits,
    padded_batch,
    relative_difference,
    transformers_logits,
)
from tests.unit.model.test_loading import train_refusal

# model_type -> (GGUF architecture, general.name, the tiny model's config): how llama.cpp writes
# each family (Qwen3's head_dim is the 128 that transformers assumes, as GGUF carries none).
WRITTEN = {
    "llama": ("llama", "tiny-llama", {"attention_bias": False}),
    "qwen2": ("qwen2", "tiny-qwen2", {}),
    "qwen3": ("qwen3", "tiny-qwen3", {"head_dim": 128, "tie_word_embeddings": False}),
}
# llama.cpp interleaves the rows of q and k of these architectures (transformers undoes it).
PERMUTED = ("llama",)
CONTROL, NORMAL = 3, 1  # llama.cpp's token types


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DECENTRL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def interleaved(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of q or k rows: each head's two rotary halves interleaved."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def finish(writer: Any, path: Path) -> Path:
    """Write out what a GGUFWriter was given, in the file's order."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gguf(folder: Path, path: Path, architecture: str, name: str,
               **extra: Any) -> Path:
    """The Hugging Face `folder`'s model and tokenizer as a GGUF file of F32 tensors; `extra`
    metadata under the architecture's prefix (expert_count=4, ...)."""
    from gguf import MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map

    config = json.loads((folder / "config.json").read_text())
    tokenizer = load_tokenizer(folder)
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == architecture)
    names = get_tensor_name_map(arch, layers)
    writer = GGUFWriter(path, architecture)
    writer.add_name(name)
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_rope_freq_base(float(config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    for key, value in extra.items():
        writer.add_uint32(f"{architecture}.{key}", value)
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if i in special else NORMAL for i in range(len(tokens))])
    writer.add_token_scores([0.0] * len(tokens))  # no merges: they are derived (none here)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_chat_template(tokenizer.chat_template)
    writer.add_license("mit")
    for hf_name, tensor in load_file(folder / "model.safetensors").items():
        base, suffix = hf_name.rsplit(".", 1)
        weight = tensor.float().numpy()
        if architecture in PERMUTED and base.endswith(("q_proj", "k_proj")):
            weight = interleaved(weight, heads if base.endswith("q_proj") else kv_heads)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", weight)
    return finish(writer, path)


def test_every_written_family_is_one_transformers_reads_from_gguf() -> None:
    assert set(WRITTEN) <= set(gguf_families())
    assert "mistral" not in gguf_families()  # see the refusal below


@pytest.mark.parametrize("model_type", WRITTEN)
def test_a_gguf_file_converts_once_to_the_original_logits(
        model_type: str, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    architecture, name, fields = WRITTEN[model_type]
    original = make_tiny_model(tmp_path / "original", seed=6, model_type=model_type,
                               **{"initializer_range": 0.2, **fields})
    path = write_gguf(original, tmp_path / "tiny.gguf", architecture, name)
    folder = resolve_model(str(path))
    sha256 = file_sha256(path)
    assert folder == cache / "models" / f"gguf-{sha256}"
    assert json.loads((folder / CONVERTED_FROM).read_text())["sha256"] == sha256
    model = load_model(str(path))
    assert model.spec.model_type == model_type
    ids, valid = padded_batch((9, 4), model.spec.vocab_size, seed=1)
    stages = build_stages(model.spec, StagePlan.even(model.spec.num_layers, 2), model.tensors,
                          torch.device("cpu"), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    expected = transformers_logits(hf, ids, valid)
    assert relative_difference(chain_logits(stages, ids, valid)[valid], expected[valid]) \
        <= TOLERANCE
    assert model.tokenizer.chat_template is not None
    origin = base_origin(str(path))
    assert (origin.license, origin.gguf.sha256, origin.gguf.distribution) == \
        ("mit", sha256, None)

    def convert_again(*args: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(loading, "convert_gguf", convert_again)
    assert resolve_model(str(path)) == folder


def metadata_only(path: Path, architecture: str, name: str = "tiny", **extra: int) -> Path:
    """A GGUF file of `architecture` with a few sizes and no tensors."""
    from gguf import GGUFWriter

    writer = GGUFWriter(path, architecture)
    writer.add_name(name)
    for key, value in {"block_count": 2, "embedding_length": 32, "feed_forward_length": 64,
                       "attention.head_count": 4, "attention.head_count_kv": 2, "vocab_size": 64,
                       **extra}.items():
        writer.add_uint32(f"{architecture}.{key}", value)
    return finish(writer, path)


@pytest.mark.parametrize(("architecture", "extra", "message"), [
    # llama.cpp writes Mistral as "llama" named "mistral": transformers reads its config as
    # Mistral's but gguf-py names no "mistral" tensors to load it with.
    ("llama", {"name": "mistral"}, r"transformers reads this GGUF file \(architecture 'llama'\) "
                                   r"as 'mistral' but cannot load its tensors"),
    ("olmo2", {}, r"transformers cannot read a GGUF file of architecture 'olmo2' .*decentrl "
                  r"runs GGUF files of: llama, qwen2"),
    ("falcon", {}, r"GGUF architecture 'falcon'\): model_type 'falcon' is not supported; the "
                   r"nearest supported family is"),
    ("llama", {"expert_count": 4}, r"a mixture of experts \(4 experts\) under GGUF architecture "
                                   r"'llama', which transformers reads as the dense 'llama'"),
])
def test_a_gguf_decentrl_cannot_run_is_refused_before_conversion(
        architecture: str, extra: dict[str, Any], message: str, tmp_path: Path,
        cache: Path) -> None:
    path = metadata_only(tmp_path / f"{architecture}.gguf", architecture, **extra)
    with pytest.raises(UnsupportedModel, match=message):
        resolve_model(str(path))
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())


def test_a_file_that_is_not_gguf_or_missing_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(UnsupportedModel, match=r"model.gguf is not a readable GGUF file"):
        resolve_model(str(path))
    with pytest.raises(FileNotFoundError, match=r"no such GGUF file"):
        resolve_model(str(tmp_path / "absent.gguf"))


@pytest.mark.usefixtures("restored_logging")  # decentrl train configures logging
def test_decentrl_train_runs_from_a_gguf_file_and_its_card_names_it(tmp_path: Path) -> None:
    original = make_tiny_model(tmp_path / "original", seed=6)
    path = write_gguf(original, tmp_path / "tiny.gguf", "llama", "tiny-llama")
    run = train_two_steps(path, tmp_path, "from-gguf")
    exported = export_run(run, tmp_path / "export")
    card = " ".join((exported / "README.md").read_text().split())
    assert f"from the GGUF file `tiny.gguf`, sha256 `{file_sha256(path)}`" in card
    assert 'license: "mit"' in card


@pytest.mark.usefixtures("restored_logging")  # decentrl train configures logging
def test_decentrl_train_names_a_gguf_it_cannot_run_in_one_line(tmp_path: Path) -> None:
    path = metadata_only(tmp_path / "falcon.gguf", "falcon")
    assert "GGUF architecture 'falcon'): model_type 'falcon' is not supported; the nearest " \
           "supported family is" in train_refusal(str(path), tmp_path)
