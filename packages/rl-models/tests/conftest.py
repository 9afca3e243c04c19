import os
import subprocess
import sys

import pytest
import ray
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.virtual_cluster import init_ray
from rl_models.policy.config import PolicyConfig
from rl_models.weight_transfer.channels import free_port

# A tiny Llama: big enough to have every part of the real thing, small enough for 2 cores.
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
}
#: The tiny Llama as a Qwen3 (per-head query and key norms). Qwen3's config defaults head_dim
#: to 128; the tiny model's is hidden_size / heads.
TINY_QWEN3 = {**TINY_LLAMA, "model_type": "qwen3", "head_dim": 16}


def response_mask(input_lengths: torch.Tensor, generation_lengths: torch.Tensor, width: int):
    """``[B, width]`` True on each row's generated tokens (where ``generate`` puts them)."""
    pos = torch.arange(width)[None, :]
    start = input_lengths.cpu()[:, None]
    return (pos >= start) & (pos < start + generation_lengths.cpu()[:, None])


def logprob_mismatch_metrics(
    generation_logprobs: torch.Tensor, policy_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far a generator's log-probs are from the policy's on the valid (``mask``) tokens, in
    float64: ``token_mult_prob_error`` (mean of ``exp|gen - policy|``, 1 = equal) and
    ``token_mult_prob_error_max_seq`` (the largest per-sequence mean)."""
    valid = mask.bool()
    if not valid.any():
        raise ValueError("no valid tokens to compare (the mask is all zero)")
    # Padding is zeroed before the exp: a -inf there must not turn into inf * 0 = nan.
    gap = torch.where(valid, (generation_logprobs.double() - policy_logprobs.double()).abs(), 0)
    mult = torch.exp(gap) * valid
    tokens = valid.sum(dim=1)
    per_seq = mult.sum(dim=1)[tokens > 0] / tokens[tokens > 0]
    return {
        "token_mult_prob_error": float(mult.sum() / valid.sum()),
        "token_mult_prob_error_max_seq": float(per_seq.max()),
    }


def tiny_config(**overrides) -> PolicyConfig:
    """float64 (exact comparisons), plain SGD with lr=1 and no clipping unless overridden."""
    config = {
        "model": {"hf_config": TINY_LLAMA, "dtype": "float64"},
        "optimizer": {"name": "SGD", "kwargs": {"lr": 1.0}},
        "max_grad_norm": None,
        "train_global_batch_size": 8,
        "train_micro_batch_size": 8,
        **overrides,
    }
    return PolicyConfig.model_validate(config)


def initial_model(seed: int = 0, **model) -> torch.nn.Module:
    """The plain HF model (float64) a worker built from ``TINY_LLAMA`` and ``seed`` starts from.

    Fresh weights come from HF's own initialisation run module by module (``build.py``), the
    same on any number of ranks; the tests compute their references with this model alone.
    """
    from rl_models.modeling.build import build_model

    cfg = tiny_config(model={"hf_config": TINY_LLAMA, "dtype": "float64", **model}, seed=seed)
    return build_model(cfg.model, cfg.seed)


def sequence_logprobs(model: torch.nn.Module, data: BatchedDataDict) -> torch.Tensor:
    """A Hugging Face causal LM's log-prob of each token given the ones before it, each
    sequence run alone and unpadded, laid out as ``get_logprobs`` lays them out (0 at the
    first token and the padding)."""
    out = torch.zeros(data["input_ids"].shape, dtype=torch.float64)
    with torch.no_grad():
        for row, (ids, n) in enumerate(zip(data["input_ids"], data["input_lengths"], strict=True)):
            logp = torch.log_softmax(model(ids[None, :n]).logits[0], dim=-1)
            out[row, 1:n] = logp[:-1].gather(-1, ids[1:n, None])[:, 0]
    return out


def skewed_batch(lengths=(3, 61, 5, 7, 2, 40, 9, 4), seed: int = 0) -> BatchedDataDict:
    """Right-padded sequences of very uneven lengths, with a partial token mask."""
    gen = torch.Generator().manual_seed(seed)
    lengths_t = torch.tensor(lengths)
    width = int(lengths_t.max())
    real = torch.arange(width)[None, :] < lengths_t[:, None]
    ids = torch.randint(1, TINY_LLAMA["vocab_size"], (len(lengths), width), generator=gen) * real
    # Loss on the "response" only: roughly the second half of each sequence.
    token_mask = (torch.arange(width)[None, :] >= lengths_t[:, None] // 2) & real
    sample_mask = torch.ones(len(lengths))
    sample_mask[-1] = 0  # one sample switched off entirely
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths_t,
        loss_mask=token_mask.double(),
        sample_mask=sample_mask,
    )


def grouped_batch(seed: int = 0) -> BatchedDataDict:
    """Three prompts (5, 9 and 12 tokens) x 4 responses of uneven lengths, the loss on the
    responses; plus one row switched off (nothing wanted) and one whose loss starts at token 1
    (an empty prefix)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = TINY_LLAMA["vocab_size"]
    rows, masks = [], []
    for prompt_len in (5, 9, 12):
        prompt = torch.randint(1, vocab, (prompt_len,), generator=gen)
        for _ in range(4):
            n = int(torch.randint(1, 9, (), generator=gen))
            rows.append(torch.cat([prompt, torch.randint(1, vocab, (n,), generator=gen)]))
            masks.append(torch.arange(len(rows[-1])) >= prompt_len)
    rows.append(torch.randint(1, vocab, (6,), generator=gen))
    masks.append(torch.arange(6) >= 1)
    lengths = torch.tensor([len(r) for r in rows])
    width = int(lengths.max())
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    token_mask = torch.zeros(len(rows), width)
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        ids[i, : len(r)], token_mask[i, : len(r)] = r, m.double()
    sample_mask = torch.ones(len(rows))
    sample_mask[2] = 0  # one sample off: nothing of it is wanted
    return BatchedDataDict(
        input_ids=ids, input_lengths=lengths, loss_mask=token_mask, sample_mask=sample_mask
    )


def float64_rms_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm in the input's own precision (Hugging Face's casts to float32)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture
def float64_norms(monkeypatch):
    """Hugging Face's Llama RMSNorm computes in float32 even in a float64 model. Its backward
    is then exact only to float32, and summing a group's gradients before it (one prompt pass)
    rather than after (one per row) differs at ~1e-8: a comparison at 1e-10 needs the norm in
    the model's own precision. (Forward values are bitwise the same either way.)"""
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", float64_rms_norm)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole test process (starting Ray takes seconds)."""
    init_ray(num_cpus=4, log_to_driver=False)
    yield
    ray.shutdown()


def save_tiny(tmp_path_factory, spec: dict) -> str:
    """The model ``spec`` describes (seed 0, float64) saved as a Hugging Face directory."""
    hf = dict(spec)
    path = tmp_path_factory.mktemp(f"tiny-{hf['model_type']}")
    torch.manual_seed(0)
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    AutoModelForCausalLM.from_config(config, dtype=torch.float64).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """The tiny Llama (seed 0, float64) saved as a Hugging Face model directory."""
    return save_tiny(tmp_path_factory, TINY_LLAMA)


def run_ranks(nprocs: int, script: str, *args: str, timeout: float = 600) -> None:
    """``script`` on ``nprocs`` gloo ranks under ``torch.distributed.run`` (one OpenMP thread
    each); fails with the end of their stderr when any rank fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}"]
    cmd += [f"--master-port={free_port()}", script, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-6000:]


def scenario_results(nprocs: int, script: str, out) -> list[dict]:
    """What each rank of a scenario script (``two_rank_scenarios.py``,
    ``four_rank_scenarios.py``) saved to ``out/rank<r>.pt``, after running it."""
    run_ranks(nprocs, script, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]


def scenario(ranks: list[dict], name: str) -> list[dict]:
    """Each rank's results of one scenario; a scenario that raised fails with its error."""
    for r in ranks:
        assert isinstance(r[name], dict), f"{name} failed: {r[name]}"
    return [r[name] for r in ranks]


def check_the_one_process_step(config, data, results: list[dict], *weights: str) -> None:
    """One SGD step (NLL) in one process on the whole batch changes the weights, and every
    rank's gradient norm and rank 0's ``results[0][w]`` for each ``w`` in ``weights`` equal
    it (float64, 1e-10)."""
    from rl_models.losses import NLLLoss
    from rl_models.policy.dtensor_worker import DTensorPolicyWorker

    worker = DTensorPolicyWorker(config)
    initial = {k: v.clone() for k, v in worker.model.state_dict().items()}
    grad_norm = worker.train(data, NLLLoss()).metrics["grad_norm"]
    trained = worker.model.state_dict()
    assert max(float((trained[k] - initial[k]).abs().max()) for k in trained) > 1e-2
    for r in results:
        assert r["grad_norm"] == pytest.approx(grad_norm, rel=1e-12)
    for key in weights:
        got = results[0][key]
        assert set(got) == set(trained), key
        for name, tensor in trained.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-10, msg=name)


class WidestVocabTensor(TorchDispatchMode):
    """Records the most rows any new tensor with a vocabulary-sized last dimension had (views,
    such as the transposed output weight, are not new memory).

    A DTensor (tensor parallelism) is counted by its local tensor: the mode sees the op on the
    DTensor, whose shape is the global one, while this rank allocates only its own shard."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in out if isinstance(out, tuple | list) else [out]:
            t = t._local_tensor if isinstance(t, DTensor) else t
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out
