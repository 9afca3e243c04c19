"""Translations that need code: several targets, or a look at other keys of the recipe."""

from __future__ import annotations

from typing import Any

from rl_algorithms.nemo_compat.core import Context, Refuse

# Our algorithms (``rl <name>``) whose policy rolls out (its sequences are prompt + response),
# each with its loop's config section (NeMo's has the same name).
ROLLOUT_SECTIONS = {"grpo": "grpo", "ppo": "ppo", "distill": "distillation"}

# -- conversions ---------------------------------------------------------------------------------


def _torch_optimizer(value: Any, ctx: Context) -> str:
    import torch

    name = str(value).removeprefix("torch.optim.")
    if "." in name or not isinstance(getattr(torch.optim, name, None), type):
        raise Refuse(f"would build optimizer {value!r}; only torch.optim classes are offered")
    return name


def _importance_weight(value: Any, ctx: Context) -> Any:
    if value and ctx.get("loss_fn.sequence_level_importance_ratios"):
        # NeMo RL's sequence weight is the product of the token weights; ours is their
        # geometric mean (the GSPO ratio's form), a different number for every long sequence.
        raise Refuse(
            "would weight each sequence by exp(sum_t log pi_old/pi_gen) with "
            "sequence_level_importance_ratios; here the weight is exp(mean_t ...)"
        )
    return value


def _kl_in_reward(value: Any, ctx: Context) -> Any:
    if not value:
        return value
    if ctx.get("grpo.adv_estimator.name", "grpo") == "reinforce_plus_plus":
        raise Refuse(
            "would subtract each token's own KL (penalty * kl_t) from REINFORCE++'s "
            "advantages; here use_kl_in_reward subtracts the KL summed from t to the "
            "response's end (the REINFORCE++ paper's returns)"
        )
    raise Refuse(
        "would take the KL out of the loss while GRPO's advantages ignore it, leaving no KL "
        "penalty; for that here, set loss_fn.reference_policy_kl_penalty: 0"
    )


def _backend(ctx: Context) -> str:
    return "megatron" if ctx.get("policy.megatron_cfg.enabled") is True else "dtensor"


def _precision(ctx: Context, key: str, value: Any) -> None:
    if value in ("float32", "fp32"):
        ctx.put(key, value, "policy.model.dtype", ours="float32")
    elif value in ("bfloat16", "bf16") and _backend(ctx) == "megatron":
        # NeMo's Megatron path computes in bf16 over float32 master weights; ours has no such
        # split for Megatron, so it keeps the float32 weights (slower, not less accurate).
        note = "Megatron here: float32 weights, no bf16 compute"
        ctx.put(key, value, "policy.model.dtype", note, ours="float32")
    elif value in ("bfloat16", "bf16"):
        # NeMo's DTensor path: float32 master weights, bf16 compute. Ours: the same split.
        note = "float32 weights + policy.mixed_precision: bfloat16"
        ctx.put(key, value, "policy.model.dtype", note, ours="float32")
        ctx.set_ours("policy.mixed_precision", "bfloat16")
    else:
        raise Refuse(f"would train in {value}; here float32 weights, optionally bf16 autocast")


def _model_name(ctx: Context, key: str, value: Any) -> None:
    ctx.put(key, value, "policy.model.path", "a hub id resolves from the local HF cache")
    if ctx.get("policy.tokenizer.name") is None:
        ctx.set_ours("tokenizer.path", value)


def _template_config(ctx: Context) -> dict[str, Any]:
    """Our ``tokenizer.chat_template`` for NeMo's ``policy.tokenizer.chat_template`` (absent or
    ``default``: the tokenizer's own; null: passthrough; ``*.jinja``: that file's text; any other
    string: the Jinja source) with ``data.add_bos`` / ``data.add_eos`` folded in. NeMo adds BOS
    and EOS to the tokens of an SFT sample unless they are there; our tokenizer adds no special
    tokens, so here the template writes them, where it does not already name them."""
    value = ctx.get("policy.tokenizer.chat_template", "default")
    if value == "default":
        config: dict[str, Any] = {"kind": "tokenizer"}
    elif value is None:
        config = {"kind": "passthrough"}
    elif str(value).endswith(".jinja"):
        config = {"kind": "jinja", "template": _read_recipe_file(ctx, str(value))}
    else:
        config = {"kind": "jinja", "template": str(value)}
    wanted = [t for t in ("bos", "eos") if ctx.get(f"data.add_{t}") is True]
    if not wanted:
        return config
    if config["kind"] == "tokenizer":
        raise Refuse(
            "data.add_bos/add_eos would add BOS/EOS around the tokenizer's own template, "
            "which is only known when the run starts; give policy.tokenizer.chat_template a "
            "Jinja template (or set data.add_bos/add_eos=false)"
        )
    if config["kind"] == "passthrough":
        from rl_data.templates import PASSTHROUGH_TEMPLATE

        config = {"kind": "jinja", "template": PASSTHROUGH_TEMPLATE}
    template = config["template"]
    if "bos" in wanted and "bos_token" not in template:
        template = "{{ bos_token }}" + template
    if "eos" in wanted and "eos_token" not in template:
        template = template + "{{ eos_token }}"
    return {"kind": "jinja", "template": template}


def _read_recipe_file(ctx: Context, name: str) -> str:
    """A file a recipe names: as given (relative: to the working directory), else beside the
    recipe."""
    from pathlib import Path

    tries = [Path(name).expanduser()]
    if ctx.source and not tries[0].is_absolute():
        tries.append(Path(ctx.source).resolve().parent / name)
    for path in tries:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    raise Refuse(f"chat template file {name!r} not found (looked: {', '.join(map(str, tries))})")


def _chat_template(ctx: Context, key: str, value: Any) -> None:
    ctx.put(key, value, "tokenizer.chat_template", ours=_template_config(ctx))


def _add_special_token(ctx: Context, key: str, value: Any) -> None:
    if value is not True:
        ctx.ignore(key, value, "off")
        return
    token = key.rsplit("_", 1)[1].upper()
    note = f"the chat template writes {token} where it does not already"
    ctx.put(key, value, "tokenizer.chat_template", note, ours=_template_config(ctx))


def _enabled_backend(name: str) -> Any:
    def handle(ctx: Context, key: str, value: Any) -> None:
        if value is True:
            if name == "dtensor" and ctx.get("policy.megatron_cfg.enabled") is True:
                raise Refuse("both dtensor_cfg and megatron_cfg are enabled; choose one")
            ctx.put(key, value, "policy.backend", ours=name)
        else:
            ctx.ignore(key, value, "the other training backend is the one enabled")

    return handle


def _scheduler(ctx: Context, key: str, value: Any) -> None:
    """NeMo chains schedulers (a list, with ``milestones`` to switch), as ``policy.scheduler``
    does here. A chain of one, or of a LinearLR warm-up to its full rate followed by a
    constant factor of 1 from the warm-up's end, is written as one scheduler (LinearLR stays at
    its end factor after ``total_iters``)."""
    if ctx.get("policy.megatron_cfg.enabled") is True:
        ctx.ignore(key, value, "the Megatron backend takes megatron_cfg.scheduler instead")
        return
    if value is None or value == []:
        ctx.ignore(key, value, "no scheduler: a constant learning rate, as here by default")
        return
    items = value if isinstance(value, list) else [value]
    steps = [s for s in items if "name" in s]
    milestones = [m for s in items if "milestones" in s for m in s["milestones"]]
    ours = [_scheduler_step(s) for s in steps]
    first = ours[0]
    rest_is_identity = all(
        s["name"] == "ConstantLR" and float(s["kwargs"].get("factor", 1.0)) == 1.0 for s in ours[1:]
    )
    if len(steps) == 1 or (
        rest_is_identity
        and first["name"] == "LinearLR"
        and float(first["kwargs"].get("end_factor", 1.0)) == 1.0
        and milestones == [first["kwargs"].get("total_iters")] * (len(steps) - 1)
    ):
        ctx.put(key, value, "policy.scheduler", "the chain is this one scheduler", ours=first)
        return
    chain = [*ours, {"milestones": milestones}]
    ctx.put(key, value, "policy.scheduler", "the same chain (SequentialLR)", ours=chain)


def _scheduler_step(step: dict[str, Any]) -> dict[str, Any]:
    import torch

    name = str(step["name"]).removeprefix("torch.optim.lr_scheduler.")
    if "." in name or not isinstance(getattr(torch.optim.lr_scheduler, name, None), type):
        raise Refuse(
            f"would build scheduler {step['name']!r}; only torch.optim.lr_scheduler classes "
            "are offered"
        )
    return {"name": name, "kwargs": dict(step.get("kwargs") or {})}


def _megatron_optimizer(ctx: Context, prefix: str) -> None:
    """Megatron's optimizer and scheduler sections -> ``policy.optimizer`` / ``scheduler``."""
    if ctx.get("policy.megatron_cfg.enabled") is not True:
        return
    opt = ctx.get(prefix)
    kind = opt.get("optimizer")
    lr, wd = opt.get("lr"), opt.get("weight_decay", 0.0)
    if kind == "adam":
        kwargs = {
            "lr": lr,
            "weight_decay": wd,
            "betas": [opt.get("adam_beta1", 0.9), opt.get("adam_beta2", 0.999)],
            "eps": opt.get("adam_eps", 1e-8),
        }
        name, own = "AdamW", {"adam_beta1", "adam_beta2", "adam_eps"}
    elif kind == "sgd":
        kwargs = {"lr": lr, "weight_decay": wd, "momentum": opt.get("sgd_momentum", 0.0)}
        name, own = "SGD", {"sgd_momentum"}
    else:
        for k, v in ctx.leaves(prefix):
            ctx.refuse(k, v, f"Megatron optimizer {kind!r} has no counterpart here")
        return
    ctx.set_ours("policy.optimizer", {"name": name, "kwargs": kwargs})
    sched = ctx.get("policy.megatron_cfg.scheduler") or {}
    constant = sched.get("lr_decay_style", "constant") == "constant"
    for k, v in ctx.leaves(prefix):
        field = k.rsplit(".", 1)[1]
        if field in ("optimizer", "lr", "weight_decay") or field in own:
            ctx.record(k, v, "policy.optimizer", f"Megatron's {kind} is torch's {name}")
        elif field in ("adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum"):
            ctx.ignore(k, v, f"belongs to the other optimizer than {kind!r}")
        elif field == "min_lr":
            if constant:
                ctx.ignore(k, v, "only used by a decaying lr_decay_style; this one is constant")
            else:
                ctx.done.add(k)  # reported with the scheduler below
        elif field in ("bf16", "fp16", "params_dtype"):
            ctx.ignore(k, v, "precision follows policy.precision (see policy.model.dtype)")
        elif field in ("use_distributed_optimizer", "use_precision_aware_optimizer"):
            ctx.ignore(k, v, "how optimizer state is sharded/stored; the update is the same")
        elif field == "clip_grad":
            if v == ctx.get("policy.max_grad_norm"):
                ctx.ignore(k, v, "same as policy.max_grad_norm, which is translated")
            else:
                ctx.refuse(k, v, "would clip at a norm other than policy.max_grad_norm")
        elif field in ("optimizer_cpu_offload", "optimizer_offload_fraction"):
            if v:
                ctx.refuse(k, v, "would run part of the optimizer on the CPU")
            else:
                ctx.ignore(k, v, "off")
        else:
            ctx.ignore(k, v, "Megatron optimizer internals (overlap of copies)")
    for k, v in ctx.leaves("policy.megatron_cfg.scheduler"):
        field = k.rsplit(".", 1)[1]
        if field == "lr_decay_style" and not constant:
            ctx.refuse(k, v, "would decay the learning rate to min_lr over lr_decay_iters")
        elif field in ("lr_warmup_iters", "lr_warmup_init", "lr_decay_style"):
            ctx.record(k, v, "policy.scheduler", "linear warm-up, then constant: LinearLR")
        elif field in ("start_weight_decay", "end_weight_decay"):
            if v == wd:
                ctx.ignore(k, v, "equal to the optimizer's weight_decay: no schedule")
            else:
                ctx.refuse(k, v, "would schedule the weight decay")
        elif field == "weight_decay_incr_style":
            if v == "constant":
                ctx.ignore(k, v, "constant weight decay")
            else:
                ctx.refuse(k, v, "would schedule the weight decay")
        elif field == "lr_decay_iters":
            if constant:
                ctx.ignore(k, v, "no decay: lr_decay_style is constant")
            else:
                ctx.done.add(k)
        else:
            ctx.refuse(k, v, "Megatron scheduler setting with no counterpart here")
    warmup = int(sched.get("lr_warmup_iters", 0) or 0)
    if warmup > 0 and constant:
        start = round(float(sched.get("lr_warmup_init", 0.0)) / float(lr), 12)
        ctx.set_ours(
            "policy.scheduler",
            {"name": "LinearLR", "kwargs": {"start_factor": start, "total_iters": warmup}},
        )
    elif constant:
        ctx.set_ours("policy.scheduler", None)


def _megatron_optimizer_off(ctx: Context, key: str, value: Any) -> None:
    if value is None and ctx.get("policy.megatron_cfg.enabled") is True:
        ctx.ignore(key, value, "NeMo's Megatron recipes take the optimizer from megatron_cfg")
    else:
        raise Refuse("policy.optimizer: null needs megatron_cfg.optimizer (Megatron backend)")


def _metric_name(value: Any, ctx: Context) -> str | None:
    if value is None:
        return None
    kind, _, name = str(value).partition(":")
    if kind not in ("val", "train") or not name:
        raise Refuse("expected 'val:<metric>' or 'train:<metric>'")
    # NeMo's names of the validation loss, one per recipe family; ours is val/loss.
    name = {"val_loss": "loss", "validation-default_loss": "loss"}.get(name, name)
    return f"{kind}/{name}"


def _generation_backend(value: Any, ctx: Context) -> str:
    from rl_models.backends import GENERATION_BACKENDS

    known = GENERATION_BACKENDS.names()
    if value not in known:
        raise Refuse(f"would generate with NeMo's {value!r} backend; here: {' or '.join(known)}")
    return value


def _colocated_resources(ctx: Context, key: str, value: Any) -> None:
    if value is None:
        ctx.ignore(key, value, "unset: NeMo's default placement")
    elif ctx.get("policy.generation.colocated.enabled") is True:
        ctx.ignore(key, value, "only read when generation is not colocated")
    elif key.endswith("gpus_per_node"):
        nodes = ctx.get("policy.generation.colocated.resources.num_nodes") or 1
        tp = ctx.get("policy.generation.vllm_cfg.tensor_parallel_size", 1) or 1
        workers = max(1, value * nodes // tp)
        note = "GPUs for generation / vLLM TP size"
        ctx.put(key, value, "generation.num_workers", note, ours=workers)
    else:
        ctx.record(key, value, "generation.num_workers", "with gpus_per_node")


def _max_length(ctx: Context, key: str, value: Any) -> None:
    if ctx.algorithm in ROLLOUT_SECTIONS:
        ctx.put(key, value, "policy.max_total_sequence_length")
    elif ctx.get("data.max_input_seq_length", value) == value:
        # SFT/DPO: the length samples are cut to, which data.max_seq_length is here.
        ctx.put(key, value, "data.max_seq_length")
    else:
        ctx.ignore(key, value, "data.max_input_seq_length (translated) cuts the samples here")


def _estimator_setting(name: str) -> Any:
    """``grpo.<name>`` (``normalize_rewards``, ``use_leave_one_out_baseline``). NeMo RL's
    advantage estimators read ``grpo.adv_estimator.<name>``, which its recipes interpolate
    from ``grpo.<name>`` and a child recipe (GDPO's) may set apart; the top-level key then only
    steers NeMo's dynamic-sampling statistics, which here need no baseline."""

    def handle(ctx: Context, key: str, value: Any) -> None:
        read = f"grpo.adv_estimator.{name}"
        if ctx.has(read) and ctx.get(read) != value:
            ctx.ignore(key, value, f"NeMo's advantage estimator reads {read} instead")
        else:
            ctx.put(key, value, f"grpo.{name}")

    return handle


def _reward_weights_neutral(value: Any, ctx: Context) -> bool:
    return value is None or all(float(w) == 1.0 for w in value)


def _val_sampling(train_key: str) -> Any:
    def handle(ctx: Context, key: str, value: Any) -> None:
        ctx.ignore(
            key,
            value,
            "validation here is greedy (accuracy of the argmax answer); NeMo samples it at "
            f"this setting (train: {ctx.get(train_key)!r})",
        )

    return handle


def _packing_algorithm(value: Any, ctx: Context) -> str:
    from rl_distributed.packing import PACKING_ALGORITHMS

    if value not in PACKING_ALGORITHMS:
        raise Refuse(f"would pack with {value!r}; known here: {sorted(PACKING_ALGORITHMS)}")
    return value


def _dtensor_sequence_parallel(ctx: Context, key: str, value: Any) -> None:
    """NeMo runs ``sequence_parallel: true`` without tensor parallelism as if it were off;
    here the config refuses that combination, so it is only carried over with tp > 1."""
    if value and ctx.get("policy.dtensor_cfg.tensor_parallel_size", 1) == 1:
        ctx.ignore(key, value, "no effect without tensor parallelism (tensor_parallel_size 1)")
    else:
        ctx.put(key, value, "policy.dtensor.sequence_parallel")


def _model_kind(ctx: Context) -> str:
    """Our ``model.kind`` for the section: a critic for NeMo's ``value:``, a reward model where
    ``reward_model_cfg`` is on (``_reward_model_cfg``), else a causal LM."""
    if ctx.section == "value":
        return "value"
    if ctx.get("policy.reward_model_cfg.enabled"):
        return "sequence_classification"
    return "causal_lm"


def _dtensor_context_parallel(ctx: Context, key: str, value: Any) -> None:
    """Carried over where our config takes it: refused with what the config's own rule
    (``context_parallel_clashes``) names, read from the recipe's keys. No NeMo key sets the
    attention kernel: ours is the default."""
    from rl_models.modeling.config import ModelConfig
    from rl_models.policy.context_parallel_rules import context_parallel_clashes

    clashes = context_parallel_clashes(
        activation_checkpointing=bool(ctx.get("policy.dtensor_cfg.activation_checkpointing")),
        attn_implementation=ModelConfig.model_fields["attn_implementation"].default,
        router_replay=bool(ctx.get("policy.router_replay.enabled")),
        lora=bool(ctx.get("policy.dtensor_cfg.lora_cfg.enabled")),
        kind=_model_kind(ctx),
    )
    if value != 1 and clashes:
        ctx.refuse(key, value, f"would split sequences across GPUs with {', '.join(clashes)}")
    else:
        ctx.put(key, value, "policy.dtensor.context_parallel_size")


def _empty(value: Any, ctx: Context) -> bool:
    return not value or (isinstance(value, dict) and not any(value.values()))


def _experts_split_as_dense_layers(value: Any, ctx: Context) -> bool:
    """NeMo's ``expert_tensor_parallel_size`` changes nothing here: unset, 1 or the
    tensor-parallel size. Experts are split over the tensor-parallel ranks as the dense layers
    are (Megatron's default); NeMo's usual 1 keeps them whole, a layout with the same results."""
    return value in (None, 1) or value == ctx.get("policy.megatron_cfg.tensor_model_parallel_size")


def _stop_strings(value: Any, ctx: Context) -> list[str]:
    # null: none, unless the sliding-puzzle games (translated first) stop at their action tag.
    return list(value or ctx.ours("generation.sampling.stop_strings") or [])


def _skip_reference(ctx: Context, key: str, value: Any) -> None:
    """PPO's ``skip_reference_policy_logprobs_calculation``: no reference model at all, which
    is right only while nothing reads its log-probs (no KL penalty)."""
    penalty = ctx.get("loss_fn.reference_policy_kl_penalty", 0) or 0
    if value is True and penalty > 0:
        raise Refuse(
            "would skip the reference policy's log-probs, which the KL penalty "
            f"(loss_fn.reference_policy_kl_penalty: {penalty}) reads"
        )
    note = "no reference model: nothing reads its log-probs" if value else ""
    ctx.put(key, value, "policy.reference_policy.enabled", note, ours=not value)


def _step_limit(ctx: Context, key: str, value: Any) -> None:
    """A supervised loop's ``max_num_steps``: NeMo's -1 (no step limit, the epochs decide) is
    our null."""
    target = key  # (``sft.``, ``dpo.`` and ``rm.`` keep NeMo's names)
    if value is not None and value < 0:
        ctx.record(key, value, target, "no step limit: the epochs decide")
        ctx.set_ours(target, None)
    else:
        ctx.put(key, value, target)


def _reward_model_cfg(ctx: Context, key: str, value: Any) -> None:
    """NeMo builds its PPO value model as a one-output regression reward model; our critic is
    a value head on the model (``critic.model.kind: value``), the same thing. In a reward-model
    recipe the policy is the Bradley-Terry reward model ``rl rm`` trains."""
    if ctx.section == "value":
        if key.endswith(".reward_model_type") and value != "regression":
            raise Refuse(f"would build the value model as a {value!r} reward model")
        ctx.ignore(key, value, "the critic is a value head on its model (critic.model.kind)")
    elif key.endswith(".enabled") and value is False:
        ctx.ignore(key, value, "off")
    elif ctx.algorithm != "rm":
        raise Refuse("would train the policy as a reward model: that is `rl rm` here")
    elif key.endswith(".enabled"):
        # A score head on the last real token, one score: what `rl rm` trains.
        ctx.put(key, value, "policy.model.kind", ours=_model_kind(ctx))
        ctx.set_ours("policy.model.num_labels", 1)
    elif key.endswith(".reward_model_type") and value == "bradley_terry":
        ctx.ignore(key, value, "`rl rm` trains with the Bradley-Terry loss")
    else:
        raise Refuse(f"would train a {value!r} reward model; `rl rm` trains Bradley-Terry ones")


def _vllm_dtype(value: Any, ctx: Context) -> Any:
    if value in ("fp8", "float8", "e4m3"):
        raise Refuse("would generate with FP8 weights in vLLM")
    return value
