"""A Megatron rank's shard filled from slices only (``rl_models.megatron.loading``).

The reference is the whole-model path: ``shard_megatron(hf_to_megatron(full HF state dict))``.
Each rank's pieces must equal it bit for bit, while the bytes read from the safetensors files
(counted by the loader) are exactly the rank's slices, never the whole model.
"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rl_models.megatron.convert import GPTLayout, hf_to_megatron, shard_megatron
from rl_models.megatron.loading import load_from_fresh_init, load_from_safetensors, shard_plan

from .conftest import TINY_LLAMA, initial_model

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def _hf_config(**overrides):
    hf = {**TINY_LLAMA, **overrides}
    return AutoConfig.for_model(hf.pop("model_type"), **hf)


def _expected(state, layout, tp, tp_rank, pp, pp_rank):
    full = hf_to_megatron(state, layout)
    return shard_megatron(full, layout, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank)


def _plan(config, layout, tp, tp_rank, pp, pp_rank):
    return shard_plan(
        layout,
        vocab_size=config.vocab_size,
        tp=tp,
        tp_rank=tp_rank,
        pp=pp,
        pp_rank=pp_rank,
    )


# A vocabulary that tp=2 must pad (127 -> 128), tied and untied embeddings, Qwen2 biases.
MODELS = {
    "llama": {},
    "llama-odd-vocab-tied": {"vocab_size": 127, "tie_word_embeddings": True},
    "qwen2": {"model_type": "qwen2", "num_key_value_heads": 2},
}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
def test_safetensors_shard_reads_only_its_slices(tmp_path, model, tp, pp):
    config = _hf_config(**MODELS[model])
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    hf.save_pretrained(tmp_path)
    state = hf.state_dict()
    layout = GPTLayout.from_hf_config(config)
    stored = {
        k: v for k, v in state.items() if not (layout.tied_embeddings and k == "lm_head.weight")
    }
    full_bytes = sum(t.numel() * t.element_size() for t in stored.values())
    total_read = 0
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            expected = _expected(state, layout, tp, tp_rank, pp, pp_rank)
            got: dict[str, torch.Tensor] = {}
            stats = load_from_safetensors(
                str(tmp_path),
                _plan(config, layout, tp, tp_rank, pp, pp_rank),
                layout,
                tp,
                torch.float64,
                got.__setitem__,
            )
            assert set(got) == set(expected)
            for name, tensor in expected.items():
                assert torch.equal(got[name], tensor), name
            # Exactly the rank's rows/columns were read: everything it holds except the zero
            # rows padding the vocabulary.
            padding = sum(
                int((t == 0).all(dim=1).sum()) * t.shape[1] * t.element_size()
                for n, t in expected.items()
                if n in ("embedding.word_embeddings.weight", "output_layer.weight")
            )
            held = sum(t.numel() * t.element_size() for t in expected.values())
            assert stats.bytes_read == held - padding
            if tp * pp > 1:
                assert stats.bytes_read < 0.8 * full_bytes
            total_read += stats.bytes_read
    # Together the ranks read the model once, plus what several ranks hold: the replicated
    # norm weights (every tensor-parallel rank) and the tied embedding's last-stage copy.
    norm_bytes = sum(t.numel() * 8 for n, t in state.items() if "norm" in n)
    tied_copy = layout.tied_embeddings and pp > 1
    embed_bytes = state["model.embed_tokens.weight"].numel() * 8
    assert total_read == full_bytes + (tp - 1) * norm_bytes + (embed_bytes if tied_copy else 0)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
def test_fresh_init_shard_equals_the_initial_model(tp, pp, tied):
    extra = {"tie_word_embeddings": True} if tied else {}
    reference = initial_model(seed=3, **({"hf_config": {**TINY_LLAMA, **extra}} if tied else {}))
    config = reference.config
    layout = GPTLayout.from_hf_config(config)
    state = reference.state_dict()
    largest = max(t.numel() * t.element_size() for t in state.values())
    model_bytes = sum(t.numel() * t.element_size() for t in reference.parameters())
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            with torch.device("meta"):
                meta = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
            meta.tie_weights()
            got: dict[str, torch.Tensor] = {}
            stats = load_from_fresh_init(
                meta,
                3,
                _plan(config, layout, tp, tp_rank, pp, pp_rank),
                layout,
                tp,
                got.__setitem__,
            )
            expected = _expected(state, layout, tp, tp_rank, pp, pp_rank)
            assert set(got) == set(expected)
            for name, tensor in expected.items():
                assert torch.equal(got[name], tensor), name
            # The loader held whole tensors only briefly: at most two at once (up_proj while
            # gate_proj's part waits for it), never the whole model (~11 of the largest
            # tensors here); every tensor was materialised whole once, so at least the largest.
            assert largest <= stats.peak_full_bytes <= 2 * largest < model_bytes / 4
            assert not any(p.device.type != "meta" for p in meta.parameters())
