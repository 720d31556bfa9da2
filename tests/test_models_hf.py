"""Parity of the JAX decoder with Hugging Face transformers (PyTorch, float32), and export."""

import numpy as np
import pytest
import torch

import oppo_jax
from oppo_jax.models.hf_io import CheckpointError
from tests.hf_fixtures import padded_batch, save_tiny_hf_model

FAMILIES = [("qwen2", {}), ("llama", {}), ("qwen2", {"tie_word_embeddings": True})]


@pytest.mark.parametrize("model_type,changes", FAMILIES)
def test_causal_lm_logits_match_transformers(tmp_path, model_type, changes):
    torch_model = save_tiny_hf_model(tmp_path, model_type, "ForCausalLM", **changes)
    ids, mask = padded_batch(np.random.default_rng(0), [7, 3, 9], width=9)
    with torch.no_grad():
        expected = torch_model(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    model = oppo_jax.load_hf_model(tmp_path)
    got = np.asarray(model.logits(ids, mask))
    assert got.shape == expected.shape
    valid = mask.astype(bool)
    assert np.max(np.abs(got[valid] - expected[valid])) <= 1e-4


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_sequence_classification_scores_match_transformers(tmp_path, model_type):
    torch_model = save_tiny_hf_model(tmp_path, model_type, "ForSequenceClassification")
    ids, mask = padded_batch(np.random.default_rng(1), [5, 9, 2, 6], width=9)
    with torch.no_grad():
        expected = torch_model(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    expected = expected[:, 0].numpy()
    got = np.asarray(oppo_jax.load_hf_model(tmp_path).score(ids, mask))
    assert got.shape == (4,)
    assert np.max(np.abs(got - expected)) <= 1e-4
    assert np.std(expected) > 1e-3  # the scores differ per row, so the check has teeth


@pytest.mark.parametrize(
    "model_type,suffix", [("qwen2", "ForCausalLM"), ("llama", "ForSequenceClassification")]
)
def test_export_roundtrip_through_transformers(tmp_path, model_type, suffix):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    save_tiny_hf_model(tmp_path / "src", model_type, suffix, seed=3)
    model = oppo_jax.load_hf_model(tmp_path / "src")
    oppo_jax.export_hf(model.params, model.config, tmp_path / "out")
    cls = AutoModelForCausalLM if suffix == "ForCausalLM" else AutoModelForSequenceClassification
    reloaded = cls.from_pretrained(tmp_path / "out").float().eval()
    ids, mask = padded_batch(np.random.default_rng(2), [6, 4], width=6)
    with torch.no_grad():
        torch_out = reloaded(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    if suffix == "ForCausalLM":
        jax_out = np.asarray(model.logits(ids, mask))
        assert np.max(np.abs(jax_out[mask == 1] - torch_out[mask == 1])) <= 1e-4
    else:
        assert np.max(np.abs(np.asarray(model.score(ids, mask)) - torch_out[:, 0])) <= 1e-4


def test_unsupported_model_type_is_named(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="gpt2"):
        oppo_jax.load_hf_model(tmp_path)


def test_missing_and_misshaped_tensors_are_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    save_tiny_hf_model(tmp_path, "qwen2", "ForCausalLM")
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name][:, :-1]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"up_proj.weight has shape \(64, 31\)"):
        oppo_jax.load_hf_model(tmp_path)
    del tensors[name]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing tensors.*up_proj"):
        oppo_jax.load_hf_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        oppo_jax.load_hf_model(tmp_path)


def test_sharded_checkpoint_with_index_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    save_tiny_hf_model(tmp_path / "one", "llama", "ForCausalLM")
    torch_model = AutoModelForCausalLM.from_pretrained(tmp_path / "one")
    torch_model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ids, mask = padded_batch(np.random.default_rng(4), [5], width=5)
    a = np.asarray(oppo_jax.load_hf_model(tmp_path / "one").logits(ids, mask))
    b = np.asarray(oppo_jax.load_hf_model(tmp_path / "sharded").logits(ids, mask))
    np.testing.assert_array_equal(a, b)


def test_bfloat16_params_and_activations_stay_close_to_float32(tmp_path):
    save_tiny_hf_model(tmp_path, "qwen2", "ForCausalLM", seed=7)
    ids, mask = padded_batch(np.random.default_rng(5), [6, 4], width=6)
    f32 = oppo_jax.load_hf_model(tmp_path)
    bf16 = oppo_jax.load_hf_model(tmp_path, dtype="bfloat16")
    assert str(bf16.params["layers"]["mlp"]["up_proj"]["kernel"].dtype) == "bfloat16"
    a, b = np.asarray(f32.logits(ids, mask)), np.asarray(bf16.logits(ids, mask))
    assert b.dtype == np.float32  # log-softmax inputs are upcast
    valid = mask == 1
    assert 0 < np.max(np.abs(a[valid] - b[valid])) <= 0.05 * np.max(np.abs(a[valid]))


def test_tokenizer_larger_than_the_vocabulary_is_named(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    save_tiny_hf_model(tmp_path, "qwen2", "ForCausalLM")
    vocab = {f"w{i}": i for i in range(200)}  # the model has 96 rows
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path)
    with pytest.raises(
        CheckpointError, match="tokenizer has 200 tokens but the model's vocab_size is 96"
    ):
        oppo_jax.load_hf_model(tmp_path)


def test_loading_places_every_tensor_on_its_sharding(tmp_path):
    """With a placement, each tensor goes straight to its param_shardings over the mesh (no
    device holds the whole model first); the values are those of a plain load."""
    import jax

    from oppo_jax.parallel.sharding import make_mesh, param_shardings, placed_on

    save_tiny_hf_model(tmp_path, "qwen2", "ForCausalLM")
    mesh = make_mesh(1, 2, 2, jax.devices()[:4])
    placed = oppo_jax.load_hf_model(tmp_path, placement=placed_on(mesh))
    plain = oppo_jax.load_hf_model(tmp_path)
    want = jax.tree.leaves(param_shardings(placed.config, mesh))
    got = jax.tree.leaves(placed.params)
    assert len(got) == len(want) > 0
    for array, sharding in zip(got, want, strict=True):
        assert array.sharding == sharding
    sharded = [a for a in got if not a.sharding.is_fully_replicated]
    assert sharded  # the fsdp/tensor axes really split some tensors
    for a, b in zip(got, jax.tree.leaves(plain.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
