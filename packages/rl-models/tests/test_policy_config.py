"""Policy config mistakes refused at validation (before any worker starts), and LR chains."""

import math

import pytest
import torch
from pydantic import ValidationError

from rl_models.modeling.lora import wrap_with_lora
from rl_models.policy.config import PolicyConfig, build_scheduler

from .conftest import TINY_LLAMA


def policy(**overrides) -> PolicyConfig:
    config = {"model": {"hf_config": TINY_LLAMA}, "train_global_batch_size": 8, **overrides}
    return PolicyConfig.model_validate(config)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"optimizer": {"name": "AdamW", "kwargs": {"lr": 1e-5, "weight_decy": 0.1}}},
            r"optimizer\.kwargs\n.*AdamW has no argument 'weight_decy'; did you mean "
            r"'weight_decay'\?",
        ),
        ({"optimizer": {"name": "Adamw"}}, r"optimizer\.name: .*no 'Adamw'; did you mean 'AdamW'"),
        (
            {"optimizer": {"name": "AdamW", "kwargs": {"fused": "maybe"}}},
            r"optimizer\.kwargs\n.*fused must be true, false or null, not 'maybe'",
        ),
        (
            {"scheduler": {"name": "CosineAnnealingLR", "kwargs": {"eta_min": 0.0}}},
            r"scheduler\.SchedulerConfig\.kwargs\n.*CosineAnnealingLR needs 'T_max'",
        ),
        (
            {"scheduler": {"name": "StepLR", "kwargs": {"step_size": 2, "gama": 0.5}}},
            r"scheduler\.SchedulerConfig\.kwargs\n.*StepLR has no argument 'gama'; did you mean 'gamma'",
        ),
        (
            {"sequence_packing": {"enabled": True, "algorithm": "best_fit"}},
            r"sequence_packing\.algorithm\n.*unknown packing algorithm 'best_fit'; choose one of",
        ),
        (
            {"lora": {"enabled": True, "target_modules": ["all-linear", "q_proj"]}},
            r"lora\.target_modules\n.*'all-linear' already covers the others",
        ),
        (
            {
                "scheduler": [
                    {"name": "LinearLR", "kwargs": {"total_iters": 2}},
                    {"name": "ConstantLR"},
                ]
            },
            r"ends with one \{milestones: \[\.\.\.\]\} entry",
        ),
        (
            {
                "scheduler": [
                    {"name": "LinearLR", "kwargs": {"total_iters": 2}},
                    {"name": "ConstantLR"},
                    {"milestones": [2, 5]},
                ]
            },
            r"scheduler\.milestones: 2 schedulers need 1 milestones",
        ),
        ({"scheduler": {"name": "LambdaLR"}}, r"scheduler\.name: LambdaLR takes .*functions"),
    ],
)
def test_config_mistakes_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ValidationError, match=message):
        policy(**overrides)


def test_full_torch_names_as_nemo_rl_writes_them():
    cfg = policy(
        optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-4}},
        scheduler={"name": "torch.optim.lr_scheduler.StepLR", "kwargs": {"step_size": 3}},
    )
    assert cfg.optimizer.name == "AdamW" and cfg.scheduler.name == "StepLR"


def test_lora_all_linear_adapts_every_linear_layer_but_the_output():
    from rl_models.modeling.build import build_model

    for targets in ("all-linear", ["all-linear"]):
        cfg = policy(lora={"enabled": True, "target_modules": targets})
        assert cfg.lora.target_modules == ["all-linear"]
    base = policy()
    model = wrap_with_lora(build_model(base.model, base.seed), cfg.lora, base.seed)
    adapted = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def lrs(scheduler_spec, steps: int, base_lr: float = 1e-3) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=base_lr)
    cfg = policy(optimizer={"name": "AdamW", "kwargs": {"lr": base_lr}}, scheduler=scheduler_spec)
    # through a dump and back, as the config reaches the workers
    cfg = PolicyConfig.model_validate(cfg.model_dump())
    sched = build_scheduler(opt, cfg.scheduler)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_then_cosine_chain_matches_a_float64_reference():
    base, start, warmup, decay, floor = 1e-3, 0.1, 5, 12, 1e-5
    spec = [
        {"name": "LinearLR", "kwargs": {"start_factor": start, "total_iters": warmup}},
        {"name": "CosineAnnealingLR", "kwargs": {"T_max": decay, "eta_min": floor}},
        {"milestones": [warmup]},
    ]
    got = torch.tensor(lrs(spec, warmup + decay + 1), dtype=torch.float64)
    t = torch.arange(warmup + decay + 1, dtype=torch.float64)
    # linear warm-up from start*base to base over `warmup` steps, then a half cosine to `floor`
    ramp = base * (start + (1 - start) * t / warmup)
    u = t - warmup
    cosine = floor + (base - floor) * (1 + torch.cos(math.pi * u / decay)) / 2
    reference = torch.where(t < warmup, ramp, cosine)
    torch.testing.assert_close(got, reference, rtol=1e-12, atol=1e-15)
    assert got[warmup] == base and got[-1] == pytest.approx(floor)


def test_warmup_then_constant_chain_matches_a_float64_reference():
    base, warmup = 2e-4, 4
    spec = [
        {"name": "LinearLR", "kwargs": {"start_factor": 0.25, "total_iters": warmup}},
        {"name": "ConstantLR", "kwargs": {"factor": 1.0, "total_iters": 1}},
        {"milestones": [warmup]},
    ]
    got = torch.tensor(lrs(spec, 10, base), dtype=torch.float64)
    t = torch.arange(10, dtype=torch.float64)
    flat = torch.full_like(t, base)
    reference = torch.where(t < warmup, base * (0.25 + 0.75 * t / warmup), flat)
    torch.testing.assert_close(got, reference, rtol=1e-12, atol=1e-15)


def test_no_scheduler_is_a_constant_rate_and_one_scheduler_is_itself():
    assert lrs(None, 3) == [1e-3] * 3
    assert lrs({"name": "StepLR", "kwargs": {"step_size": 2, "gamma": 0.5}}, 5) == pytest.approx(
        [1e-3, 1e-3, 5e-4, 5e-4, 2.5e-4], rel=1e-12
    )
