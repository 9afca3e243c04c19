"""The key table: NeMo RL key -> ours, ignored, or refused. First matching pattern wins.

``*`` matches one key segment, ``**`` the rest of the key; ``{0}``/``{1}`` in a target are
what they matched. :data:`OFF_SECTIONS` are sections whose every key is ignored when their
switch is off; :data:`GROUPS` are subtrees translated as a whole (datasets, environments,
Megatron's optimizer), by code in :mod:`.datasets` and here.
"""

from __future__ import annotations

from typing import Any

from rl_algorithms.nemo_compat.core import Call, Context, Ignore, To, Unless
from rl_algorithms.nemo_compat.datasets import data_group
from rl_algorithms.nemo_compat.envs import env_group
from rl_algorithms.nemo_compat.handlers import (
    ROLLOUT_SECTIONS,
    _add_special_token,
    _chat_template,
    _colocated_resources,
    _dtensor_context_parallel,
    _dtensor_sequence_parallel,
    _empty,
    _enabled_backend,
    _estimator_setting,
    _experts_split_as_dense_layers,
    _generation_backend,
    _importance_weight,
    _kl_in_reward,
    _max_length,
    _megatron_optimizer,
    _megatron_optimizer_off,
    _metric_name,
    _model_name,
    _packing_algorithm,
    _precision,
    _reward_model_cfg,
    _reward_weights_neutral,
    _scheduler,
    _skip_reference,
    _step_limit,
    _stop_strings,
    _torch_optimizer,
    _val_sampling,
    _vllm_dtype,
)

# -- the table -----------------------------------------------------------------------------------

KERNEL = "a kernel/performance choice; the result is the same"
PORTS = "a network port range of NeMo's Ray launcher; ports are chosen for you here"
MOE = "a mixture-of-experts setting; it does nothing for a dense model"

# NeMo's supervised loops (our SFT, DPO and reward-model loops share their keys).
SUPERVISED_LOOPS = ("sft", "dpo", "rm")

OFF_SECTIONS: list[tuple[str, str]] = [
    ("policy.dtensor_cfg", "policy.dtensor_cfg.enabled"),
    ("policy.megatron_cfg", "policy.megatron_cfg.enabled"),
    ("policy.dtensor_cfg.lora_cfg", "policy.dtensor_cfg.lora_cfg.enabled"),
    ("policy.megatron_cfg.peft", "policy.megatron_cfg.peft.enabled"),
    ("policy.megatron_cfg.fp8_cfg", "policy.megatron_cfg.fp8_cfg.enabled"),
    ("policy.draft", "policy.draft.enabled"),
    ("policy.dynamic_batching", "policy.dynamic_batching.enabled"),
    ("policy.sequence_packing", "policy.sequence_packing.enabled"),
    ("grpo.reward_shaping", "grpo.reward_shaping.enabled"),
    ("grpo.reward_scaling", "grpo.reward_scaling.enabled"),
    ("ppo.reward_shaping", "ppo.reward_shaping.enabled"),
    ("ppo.reward_scaling", "ppo.reward_scaling.enabled"),
    ("ppo.async_ppo", "ppo.async_ppo.enabled"),
    ("data_plane", "data_plane.enabled"),
    ("logger.wandb", "logger.wandb_enabled"),
    ("logger.swanlab", "logger.swanlab_enabled"),
    ("logger.mlflow", "logger.mlflow_enabled"),
    ("logger.gpu_monitoring", "logger.monitor_gpus"),
]


def _not_vllm(ctx: Context) -> str | None:
    backend = ctx.get("policy.generation.backend")
    return None if backend == "vllm" else f"vLLM's settings; generation uses {backend!r}"


# Sections that do nothing given another key (the reason), e.g. vLLM's without vLLM.
UNUSED_SECTIONS = [
    ("policy.generation.vllm_cfg", _not_vllm),
    ("policy.generation.vllm_kwargs", _not_vllm),
]

# Sections for features we lack: off, they are ignored; on, each of their keys is refused.
UNSUPPORTED_SECTIONS = [
    ("ppo.async_ppo", "run PPO asynchronously (generation ahead of training)"),
    ("policy.draft", "train a speculative-decoding draft model"),
    ("policy.megatron_cfg.peft", "train LoRA adapters on the Megatron backend"),
    ("policy.megatron_cfg.fp8_cfg", "train in FP8"),
    ("data_plane", "move rollouts through NeMo's TransferQueue data plane"),
]

GROUPS = [
    ("data", data_group),
    ("env", env_group),
    ("policy.megatron_cfg.optimizer", _megatron_optimizer),
]

XTOKEN = "use NeMo's cross-tokenizer off-policy distillation loss"


def _other_backend(backend: str) -> Any:
    return lambda value, ctx: ctx.get("policy.generation.backend") != backend


RULES: list[tuple[str, Any]] = [
    *[
        rule
        for prefix, would in UNSUPPORTED_SECTIONS
        for rule in (
            (f"{prefix}.enabled", Unless((False,), would)),
            (f"{prefix}.**", Unless(lambda v, c: False, would)),
        )
    ],
    # -- the loop sections: same names ---------------------------------------------------------
    *[
        (f"{loop}.{k}", To(f"{loop}.{k}"))
        for loop in ("grpo", "ppo", "distillation")
        for k in ("max_num_epochs", "max_num_steps", "val_at_start", "seed")
    ],
    *[
        (f"{loop}.{k}", To(f"{loop}.{k}"))
        for loop in SUPERVISED_LOOPS
        for k in ("max_num_epochs", "val_at_start", "seed")
    ],
    *[(f"{loop}.max_num_steps", Call(_step_limit)) for loop in SUPERVISED_LOOPS],
    # NeMo: a period <= 0 never validates during training, which is our 0.
    *[
        (f"{loop}.val_period", To(f"{loop}.val_period", lambda v, c: max(int(v), 0)))
        for loop in ("grpo", "ppo", "distillation", *SUPERVISED_LOOPS)
    ],
    *[
        (f"{algo}.{k}", To(f"{algo}.{k}"))
        for algo in SUPERVISED_LOOPS
        for k in ("val_global_batch_size", "val_micro_batch_size")
    ],
    # NeMo: -1 validates on every batch, which is our 0.
    *[
        (f"{algo}.val_batches", To(f"{algo}.val_batches", lambda v, c: max(int(v), 0)))
        for algo in SUPERVISED_LOOPS
    ],
    *[
        (f"dpo.{k}", To(f"dpo.{k}"))
        for k in (
            "reference_policy_kl_penalty",
            "preference_average_log_probs",
            "sft_average_log_probs",
            "preference_loss_weight",
            "sft_loss_weight",
        )
    ],
    # NeMo validates after the last step only with val_at_end (whatever val_period is); our
    # default does whenever val_period > 0, so the value is always written.
    *[
        (f"{loop}.val_at_end", To(f"{loop}.val_at_end"))
        for loop in ("grpo", "ppo", "distillation", *SUPERVISED_LOOPS)
    ],
    (
        "policy.activation_checkpointing_enabled",
        Ignore("NeMo RL does not read it (dtensor_cfg.activation_checkpointing is its key)"),
    ),
    ("sft.only_unmask_final", Unless((False,), "train only on the final assistant turn")),
    # GRPO, PPO and distillation share the rollout loop (RolloutLoopConfig) and its keys.
    *[
        rule
        for loop in ROLLOUT_SECTIONS.values()
        for rule in (
            *[
                (f"{loop}.{k}", To(f"{loop}.{k}"))
                for k in (
                    "num_prompts_per_step",
                    "num_generations_per_prompt",
                    "max_rollout_turns",
                    "overlong_filtering",
                    "max_val_samples",
                    "val_batch_size",
                    "use_dynamic_sampling",
                    "dynamic_sampling_max_gen_batches",
                )
            ],
            (
                f"{loop}.reward_shaping.stop_properly_penalty_coef",
                Unless((None,), "penalise responses that do not stop properly"),
            ),
            (f"{loop}.reward_shaping.**", To(f"{loop}.reward_shaping.{{0}}")),
            (f"{loop}.reward_scaling.**", To(f"{loop}.reward_scaling.{{0}}")),
            (
                f"{loop}.val_start_at",
                Unless((-1, 0, None), "delay periodic validation to a later step"),
            ),
            (
                f"{loop}.val_num_generations_per_prompt",
                Unless((1,), "sample several validation answers"),
            ),
            (f"{loop}.stop_at_validation_*", Unless((None,), "stop early at a validation metric")),
            (f"{loop}.batch_multiplier", Unless((1,), "generate several batches per step")),
            (
                f"{loop}.seq_logprob_error_threshold",
                Unless((None,), "drop sequences by logprob error"),
            ),
        )
    ],
    ("grpo.advantage_clip_*", Unless((None,), "clip advantages to a range")),
    # -- PPO (its value model, NeMo's value:, is our critic: see translate.MODEL_SECTIONS) ------
    *[
        (f"ppo.{k}", To(f"ppo.{k}"))
        for k in ("ppo_epochs", "critic_ppo_epochs", "policy_training_start_step")
    ],
    *[
        (f"ppo.adv_estimator.{k}", To(f"ppo.adv_estimator.{k}"))
        for k in ("name", "gae_gamma", "gae_lambda", "normalize_advantages")
    ],
    (
        "ppo.adv_estimator.gae_lambda_*",
        Unless((None,), "decouple GAE's lambda for the critic and the policy (VAPO)"),
    ),
    (
        "ppo.adv_estimator.length_adaptive_alpha",
        Unless((0, 0.0), "adapt the policy's GAE lambda to the response length (VAPO)"),
    ),
    ("ppo.skip_reference_policy_logprobs_calculation", Call(_skip_reference)),
    ("value_loss_fn.cliprange", To("value_loss_fn.cliprange")),
    ("value_loss_fn.scale", To("value_loss_fn.scale")),
    # -- distillation --------------------------------------------------------------------------
    ("distillation.topk_logits_k", To("distillation.topk_logits_k")),
    *[
        (f"loss_fn.{k}", To(f"loss_fn.{k}"))
        for k in ("kl_type", "mixed_kl_weight", "zero_outside_topk")
    ],
    ("grpo.adv_estimator.name", To("grpo.advantage_estimator")),
    *[
        (f"grpo.{k}", Call(_estimator_setting(k)))
        for k in ("normalize_rewards", "use_leave_one_out_baseline")
    ],
    ("grpo.adv_estimator.normalize_rewards", To("grpo.normalize_rewards")),
    ("grpo.adv_estimator.use_leave_one_out_baseline", To("grpo.use_leave_one_out_baseline")),
    (
        "grpo.adv_estimator.reward_weights",
        Unless(
            _reward_weights_neutral,
            "weight the reward components by name; give each function its weight in "
            "env.<task>.config.functions instead",
        ),
    ),
    ("grpo.adv_estimator.minus_baseline", Unless((True,), "skip Reinforce++'s baseline")),
    ("grpo.invalid_tool_call_advantage", Unless((None,), "penalise invalid tool calls")),
    ("grpo.malformed_thinking_advantage", Unless((None,), "penalise malformed <think> tags")),
    ("grpo.async_grpo.enabled", To("grpo.async_grpo.enabled")),
    ("grpo.async_grpo.max_trajectory_age_steps", To("grpo.async_grpo.max_trajectory_age_steps")),
    ("grpo.async_grpo.in_flight_weight_updates", To("grpo.async_grpo.in_flight_weight_updates")),
    ("grpo.async_grpo.max_generation_failures", Unless((0,), "tolerate failed generations")),
    (
        "grpo.async_grpo.recompute_kv_cache_after_weight_updates",
        Unless((False,), "recompute the KV cache after a refit"),
    ),
    ("grpo.async_grpo", Unless((None,), "run GRPO asynchronously")),
    ("async_rl.**", Unless(lambda v, c: False, "run NeMo's single-controller asynchronous loop")),
    ("teachers", Unless((None,), "distil off-policy from several teachers (cross-tokenizer)")),
    ("teacher", Unless((None,), "distil from a teacher given in teachers: instead")),
    *[
        (f"loss_fn.{k}", Unless(lambda v, c: False, XTOKEN))
        for k in (
            "gold_loss",
            "xtoken_loss",
            "temperature",
            "vocab_topk",
            "uncommon_topk",
            "reverse_kl",
            "exact_token_match_only",
            "kl_loss_weight",
            "ce_loss_scale",
            "dynamic_loss_scaling",
            "kd_loss_mode",
            "sum_weights_metric",
            "alpha",
            "normalize_teacher_by_vocab",
        )
    ],
    ("reward_penalties.**", Unless((False, None), "apply NeMo-Gym reward penalties")),
    ("on_policy_distillation", Unless((None,), "distil from teacher models")),
    # -- loss ------------------------------------------------------------------------------------
    *[
        (f"loss_fn.{k}", To(f"loss_fn.{k}"))
        for k in (
            "reference_policy_kl_penalty",
            "reference_policy_kl_type",
            "kl_input_clamp_value",
            "kl_output_clamp_value",
            "ratio_clip_min",
            "ratio_clip_max",
            "ratio_clip_c",
            "use_on_policy_kl_approximation",
            "truncated_importance_sampling_ratio",
            # tis / icepop / seq-mask-tis and the lower bound read alike (losses/mismatch.py).
            "truncated_importance_sampling_type",
            "truncated_importance_sampling_ratio_min",
            "sequence_level_importance_ratios",
            "token_level_loss",
            # The same clipped, detached ratio times A * log pi, over the same clip range.
            "use_cispo",
        )
    ],
    (
        "loss_fn.use_importance_sampling_correction",
        To("loss_fn.use_importance_sampling_correction", _importance_weight),
    ),
    # NeMo RL's ClippedPGLossFn has no entropy bonus; the key is ours, taken as it is written.
    (
        "loss_fn.entropy_coef",
        To("loss_fn.entropy_coef", note="not a NeMo RL key: this library's entropy bonus"),
    ),
    ("loss_fn.force_on_policy_ratio", Unless((False,), "force the probability ratio to 1")),
    ("loss_fn.use_kl_in_reward", To("loss_fn.use_kl_in_reward", _kl_in_reward)),
    ("loss_fn.disable_ppo_ratio", Unless((False,), "drop the PPO ratio (REINFORCE loss)")),
    ("loss_fn.positive_example_nll_weight", Unless((0, 0.0), "add VAPO's positive NLL term")),
    # -- checkpointing ---------------------------------------------------------------------------
    *[
        (f"checkpointing.{k}", To(f"checkpointing.{k}"))
        for k in ("enabled", "checkpoint_dir", "higher_is_better", "keep_top_k", "save_period")
    ],
    ("checkpointing.metric_name", To("checkpointing.metric_name", _metric_name)),
    (
        "checkpointing.checkpoint_must_save_by",
        To(
            "checkpointing.checkpoint_must_save_by",
            note="counted from the run's start, setup included (NeMo RL: from its first step)",
        ),
    ),
    ("checkpointing.model_save_format", Unless(("safetensors",), "save weights as torch files")),
    ("checkpointing.save_consolidated", Ignore("checkpoints here are consolidated HF files")),
    ("checkpointing.save_optimizer", Unless((True,), "leave the optimizer out of checkpoints")),
    # -- policy: model, tokenizer, precision -----------------------------------------------------
    ("policy.model_name", Call(_model_name)),
    ("policy.tokenizer.name", To("tokenizer.path", note="a hub id resolves from the HF cache")),
    ("policy.tokenizer.chat_template", Call(_chat_template)),
    ("policy.tokenizer.chat_template_kwargs", Unless((None,), "pass kwargs to the template")),
    ("policy.tokenizer.use_fastokens", Ignore("a faster tokenizer build; same tokens")),
    ("policy.reward_model_cfg.*", Call(_reward_model_cfg)),
    ("policy.hf_config_overrides", Unless(_empty, "override the pretrained model's config")),
    ("policy.precision", Call(_precision)),
    ("policy.train_global_batch_size", To("policy.train_global_batch_size")),
    ("policy.train_micro_batch_size", To("policy.train_micro_batch_size")),
    ("policy.logprob_batch_size", To("policy.logprob_micro_batch_size")),
    ("policy.generation_batch_size", Ignore("batch size of NeMo's HF/Megatron generation")),
    ("policy.max_total_sequence_length", Call(_max_length)),
    ("policy.logprob_chunk_size", To("policy.logprob_chunk_size")),
    ("policy.offload_optimizer_for_logprob", To("policy.offload.optimizer_state")),
    ("policy.max_grad_norm", To("policy.max_grad_norm")),
    (
        "policy.make_sequence_length_divisible_by",
        Ignore("padding for tensor/sequence parallelism, done where needed here"),
    ),
    ("policy.optimizer", Call(_megatron_optimizer_off)),
    ("policy.optimizer.name", To("policy.optimizer.name", _torch_optimizer)),
    ("policy.optimizer.kwargs.**", To("policy.optimizer.kwargs.{0}")),
    ("policy.scheduler", Call(_scheduler)),
    # -- micro-batching --------------------------------------------------------------------------
    ("policy.dynamic_batching.enabled", To("policy.dynamic_batching.enabled")),
    ("policy.dynamic_batching.train_mb_tokens", To("policy.dynamic_batching.train_mb_tokens")),
    ("policy.dynamic_batching.logprob_mb_tokens", To("policy.dynamic_batching.logprob_mb_tokens")),
    (
        "policy.dynamic_batching.sequence_length_round",
        To("policy.dynamic_batching.sequence_length_round"),
    ),
    ("policy.sequence_packing.enabled", To("policy.sequence_packing.enabled")),
    (
        "policy.sequence_packing.train_mb_tokens",
        To("policy.sequence_packing.max_tokens_per_microbatch"),
    ),
    (
        "policy.sequence_packing.logprob_mb_tokens",
        To("policy.sequence_packing.logprob_max_tokens_per_microbatch"),
    ),
    (
        "policy.sequence_packing.algorithm",
        To("policy.sequence_packing.algorithm", _packing_algorithm),
    ),
    (
        "policy.sequence_packing.microbatch_order",
        Ignore("run order of packed micro-batches; the summed gradient is the same"),
    ),
    ("policy.sequence_packing.sequence_length_round", Ignore(KERNEL)),
    # -- DTensor backend -------------------------------------------------------------------------
    ("policy.dtensor_cfg.enabled", Call(_enabled_backend("dtensor"))),
    ("policy.dtensor_cfg._v2", Ignore("which of NeMo's two DTensor workers runs")),
    ("policy.dtensor_cfg.activation_checkpointing", To("policy.activation_checkpointing")),
    (
        "policy.dtensor_cfg.cpu_offload",
        Unless(
            (False,), "keep parameters, gradients and optimizer state in CPU memory (FSDP2 offload)"
        ),
    ),
    ("policy.dtensor_cfg.sequence_parallel", Call(_dtensor_sequence_parallel)),
    ("policy.dtensor_cfg.tensor_parallel_size", To("policy.dtensor.tensor_parallel_size")),
    ("policy.dtensor_cfg.context_parallel_size", Call(_dtensor_context_parallel)),
    ("policy.dtensor_cfg.dp_replicate_size", Unless((1,), "replicate (HSDP) across groups")),
    ("policy.dtensor_cfg.custom_parallel_plan", Unless((None,), "use a custom TP plan")),
    ("policy.dtensor_cfg.automodel_kwargs", Unless(_empty, "pass kwargs to NeMo Automodel")),
    ("policy.*_cfg.env_vars", Unless(_empty, "set environment variables in workers")),
    ("policy.*_cfg.env_vars.*", Unless(("", None), "set this environment variable in workers")),
    ("policy.dtensor_cfg.clear_cache_every_n_steps", Ignore("CUDA cache housekeeping")),
    ("policy.dtensor_cfg.lora_cfg.enabled", To("policy.lora.enabled")),
    ("policy.dtensor_cfg.lora_cfg.dim", To("policy.lora.rank")),
    ("policy.dtensor_cfg.lora_cfg.alpha", To("policy.lora.alpha")),
    ("policy.dtensor_cfg.lora_cfg.dropout", To("policy.lora.dropout")),
    (
        "policy.dtensor_cfg.lora_cfg.target_modules",
        Unless(
            lambda v, c: not v and c.get("policy.dtensor_cfg.lora_cfg.match_all_linear"),
            "adapt only the named modules (set policy.lora.target_modules instead)",
        ),
    ),
    (
        "policy.dtensor_cfg.lora_cfg.match_all_linear",
        Ignore("our default targets are all linear layers of Llama-style blocks"),
    ),
    ("policy.dtensor_cfg.lora_cfg.exclude_modules", Unless(_empty, "exclude modules from LoRA")),
    (
        "policy.dtensor_cfg.lora_cfg.dropout_position",
        Unless(
            lambda v, c: c.get("policy.dtensor_cfg.lora_cfg.dropout") == 0,
            "place LoRA dropout after the adapter",
        ),
    ),
    ("policy.dtensor_cfg.lora_cfg.lora_A_init", Ignore("A is initialised as peft does")),
    ("policy.dtensor_cfg.lora_cfg.use_triton", Ignore(KERNEL)),
    # -- Megatron backend ------------------------------------------------------------------------
    ("policy.megatron_cfg.enabled", Call(_enabled_backend("megatron"))),
    ("policy.megatron_cfg.tensor_model_parallel_size", To("policy.megatron.tensor_parallel_size")),
    (
        "policy.megatron_cfg.pipeline_model_parallel_size",
        To("policy.megatron.pipeline_parallel_size"),
    ),
    ("policy.megatron_cfg.sequence_parallel", To("policy.megatron.sequence_parallel")),
    ("policy.megatron_cfg.activation_checkpointing", To("policy.activation_checkpointing")),
    ("policy.megatron_cfg.context_parallel_size", Unless((1,), "split sequences across GPUs")),
    ("policy.megatron_cfg.expert_model_parallel_size", To("policy.megatron.expert_parallel_size")),
    (
        "policy.megatron_cfg.expert_tensor_parallel_size",
        Unless(_experts_split_as_dense_layers, "split MoE experts unlike the dense layers"),
    ),
    (
        "policy.megatron_cfg.num_layers_in_*_pipeline_stage",
        Unless((None,), "size the first/last pipeline stage"),
    ),
    (
        "policy.megatron_cfg.converter_type",
        Ignore("NeMo's HF->Megatron converter; the model's own architecture decides here"),
    ),
    ("policy.megatron_cfg.pipeline_dtype", Ignore("follows the model's dtype here")),
    ("policy.megatron_cfg.moe_*", Ignore(MOE)),
    ("policy.megatron_cfg.freeze_moe_router", Ignore(MOE)),
    ("policy.megatron_cfg.mtp_*", Unless((0, 0.0, False), "train multi-token prediction")),
    ("policy.megatron_cfg.*_fusion", Ignore(KERNEL)),
    (
        "policy.megatron_cfg.use_fused_*",
        Unless((False,), "use a fused logprob/activation kernel (memory saving)"),
    ),
    ("policy.megatron_cfg.fused_linear_logprobs_chunk_size", Ignore(KERNEL)),
    ("policy.megatron_cfg.defer_fp32_logits", Ignore(KERNEL)),
    ("policy.megatron_cfg.cuda_graph_*", Ignore(KERNEL)),
    ("policy.megatron_cfg.use_gloo_process_groups", Ignore("NeMo's process-group plumbing")),
    ("policy.megatron_cfg.empty_unused_memory_level", Ignore("CUDA cache housekeeping")),
    ("policy.megatron_cfg.force_reconvert_from_hf", Ignore("NeMo's HF->Megatron cache")),
    ("policy.megatron_cfg.model_overrides", Unless(_empty, "override the Megatron model")),
    ("policy.megatron_cfg.checkpoint.**", Ignore("Megatron dist-checkpoint write options")),
    (
        "policy.megatron_cfg.fine_grained_activation_offloading",
        Unless((False,), "offload activations to the CPU"),
    ),
    ("policy.megatron_cfg.offload_modules", Unless((None,), "offload activations")),
    (
        "policy.megatron_cfg.recompute_*",
        Ignore(
            "activation recompute granularity; here whole "
            "layers when activation_checkpointing is on"
        ),
    ),
    (
        "policy.megatron_cfg.distributed_data_parallel_config.**",
        Ignore("Megatron DDP bucketing/overlap; the gradient is the same"),
    ),
    # -- generation ------------------------------------------------------------------------------
    ("policy.generation.backend", To("generation.backend", _generation_backend)),
    ("policy.generation.max_new_tokens", To("generation.sampling.max_new_tokens")),
    ("policy.generation.temperature", To("generation.sampling.temperature")),
    ("policy.generation.top_p", To("generation.sampling.top_p")),
    ("policy.generation.top_k", To("generation.sampling.top_k")),
    ("policy.generation.stop_token_ids", To("generation.sampling.stop_token_ids")),
    (
        "policy.generation.stop_strings",
        To("generation.sampling.stop_strings", _stop_strings),
    ),
    ("policy.generation.val_temperature", Call(_val_sampling("policy.generation.temperature"))),
    ("policy.generation.val_top_p", Call(_val_sampling("policy.generation.top_p"))),
    ("policy.generation.val_top_k", Call(_val_sampling("policy.generation.top_k"))),
    ("policy.generation.port_range_*", Ignore(PORTS)),
    *[
        (
            f"policy.generation.{section}.**",
            Unless(_other_backend(backend), f"configure NeMo's {name} generation backend"),
        )
        for section, backend, name in (
            ("sglang_cfg", "sglang", "SGLang"),
            ("trtllm_cfg", "trtllm", "TensorRT-LLM"),
            ("trtllm_kwargs", "trtllm", "TensorRT-LLM"),
            ("dynamo_cfg", "dynamo", "Dynamo"),
        )
    ],
    (
        "policy.generation.use_async_rollouts",
        Unless((False,), "stream rollouts from an asynchronous engine"),
    ),
    (
        "policy.generation.vllm_cfg.distributed_executor_backend",
        Ignore("how vLLM starts its own workers"),
    ),
    ("policy.generation.refit_transport", Unless((None,), "pick NeMo's weight-refit transport")),
    ("policy.generation.refit_cfg.**", Ignore("NeMo's NIXL refit transport settings")),
    ("policy.generation.real_quant_export_cpu_offload", Ignore("quantised refit export")),
    (
        "policy.generation.mcore_generation_config.**",
        Ignore("NeMo's Megatron generation backend only"),
    ),
    ("policy.generation.colocated.enabled", To("generation.colocated")),
    ("policy.generation.colocated.resources.*", Call(_colocated_resources)),
    ("policy.generation.vllm_cfg.tensor_parallel_size", To("generation.vllm.tensor_parallel_size")),
    (
        "policy.generation.vllm_cfg.gpu_memory_utilization",
        To("generation.vllm.gpu_memory_utilization"),
    ),
    ("policy.generation.vllm_cfg.max_model_len", To("generation.vllm.max_model_len")),
    ("policy.generation.vllm_cfg.enforce_eager", To("generation.vllm.enforce_eager")),
    ("policy.generation.vllm_cfg.async_engine", To("generation.vllm.async_engine")),
    ("policy.generation.vllm_cfg.precision", To("generation.vllm.dtype", _vllm_dtype)),
    ("policy.generation.vllm_cfg.pipeline_parallel_size", Unless((1,), "pipeline vLLM")),
    ("policy.generation.vllm_cfg.expert_parallel_size", Unless((1,), "shard MoE experts")),
    ("policy.generation.vllm_cfg.kv_cache_dtype", Unless(("auto",), "quantise the KV cache")),
    (
        "policy.generation.vllm_cfg.logprobs_mode",
        Unless(("processed_logprobs",), "return raw (unscaled) logprobs from vLLM"),
    ),
    ("policy.generation.vllm_cfg.use_deep_gemm", Unless((False,), "use DeepGEMM (FP8)")),
    ("policy.generation.vllm_cfg.num_*_layers_in_bf16", Unless((0,), "keep FP8 layers in bf16")),
    ("policy.generation.vllm_cfg.use_tqdm", Ignore("vLLM's progress bar")),
    ("policy.generation.vllm_cfg.enable_vllm_metrics_logger", Ignore("vLLM metrics logging")),
    ("policy.generation.vllm_cfg.vllm_metrics_logger_interval", Ignore("vLLM metrics logging")),
    ("policy.generation.vllm_cfg.http_refit_api_key_env_var", Ignore("NeMo's HTTP refit")),
    ("policy.generation.vllm_cfg.*_refit_server_port", Ignore(PORTS)),
    (
        "policy.generation.vllm_cfg.reset_encoder_cache_after_weight_update",
        Ignore("multimodal encoder cache"),
    ),
    ("policy.generation.vllm_kwargs", Unless(_empty, "pass extra arguments to vLLM")),
    ("policy.generation.vllm_kwargs.*", Unless((None,), "pass this argument to vLLM")),
    ("policy.router_replay.enabled", Unless((False,), "replay MoE routing in training")),
    ("policy.router_replay.**", Ignore(MOE)),
    # -- data, logger, cluster (data.train/validation/default: the data group) -------------------
    ("data.max_input_seq_length", To("data.max_seq_length")),
    ("data.shuffle", To("data.shuffle")),
    ("data.num_workers", Ignore("DataLoader worker processes")),
    ("data.use_multiple_dataloader", Unless((False,), "draw from several dataloaders")),
    (
        "data.num_prompts_per_dataloader",
        Unless((None,), "draw from several dataloaders"),
    ),
    ("data.custom_dataloader", Unless((None,), "draw from several dataloaders")),
    ("data.add_bos", Call(_add_special_token)),
    ("data.add_eos", Call(_add_special_token)),
    ("data.add_generation_prompt", Unless((False,), "add the generation prompt to SFT rows")),
    ("data.add_system_prompt", Ignore("the chat template decides on a default system prompt")),
    ("logger.log_dir", To("logger.log_dir")),
    ("logger.wandb_enabled", To("logger.wandb_enabled")),
    ("logger.tensorboard_enabled", To("logger.tensorboard_enabled")),
    ("logger.mlflow_enabled", To("logger.mlflow_enabled")),
    ("logger.monitor_gpus", To("logger.monitor_gpus")),
    ("logger.swanlab_enabled", Unless((False,), "log to SwanLab")),
    ("logger.num_val_samples_to_print", To("logger.num_val_samples_to_print")),
    ("logger.wandb.project", To("logger.wandb.project")),
    ("logger.wandb.name", To("logger.wandb.name")),
    ("logger.wandb.log_nemo_gym_full_result_tables", Ignore("NeMo-Gym tables")),
    ("logger.tensorboard", Ignore("empty: TensorBoard's defaults")),
    ("logger.tensorboard.log_dir", To("logger.tensorboard.log_dir")),
    ("logger.mlflow.*", To("logger.mlflow.{0}")),
    ("logger.swanlab.**", Unless(lambda v, c: False, "log to SwanLab")),
    ("logger.gpu_monitoring.*", Ignore("NeMo's GPU monitor intervals")),
    ("cluster.gpus_per_node", To("cluster.gpus_per_node")),
    ("cluster.num_nodes", To("cluster.num_nodes")),
    ("cluster.master_port_range_*", Ignore(PORTS)),
    ("cluster.segment_size", Unless((None,), "align workers to NVLink domains")),
]
