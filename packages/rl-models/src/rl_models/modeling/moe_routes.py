"""Mixture-of-experts routes: which experts each token's router chose, recorded while
generating (``RouteRecorder``) and replayed while training (``RouteReplay``).

Why: in RL on a mixture-of-experts model the trainer recomputes the log-probs of the sampled
tokens. Its router sees slightly different hidden states than the generator's did (another
kernel, another batch, another dtype), and where two experts' scores are within rounding of
each other it picks another one: the token's log-prob then comes from other weights than the
ones that sampled it, and the importance ratios drift until training collapses. Replaying the
generator's choices in the trainer's forward removes that source of mismatch.

Routes are a compact integer tensor ``[..., layers, k]`` (``ROUTE_DTYPE``): per token and per
MoE layer (in the model's module order), the ``k`` experts the router chose, in its order.
``NO_ROUTE`` marks a token the generator never ran through the model (a response's last token,
padding); a replaying router chooses for itself there.

Both work by forward hooks on the routers, registered for the duration of a ``with`` block and
removed after it, so the model class is never changed. A router is one of ``ROUTERS``: the
``transformers`` modules that return ``(logits, weights, expert indices)`` and weigh the chosen
experts by the softmax of the logits at them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: What a route tensor holds: expert ids fit in 15 bits (models of 2026 have <= 512 experts).
ROUTE_DTYPE = torch.int16
#: A token without a recorded route.
NO_ROUTE = -1


@dataclass(frozen=True)
class RouterKind:
    """How one family's router turns its logits into the weights of the chosen experts:
    ``softmax`` in (at least) float32, taken at the chosen experts, renormalised to sum to 1 when
    ``renormalises(router)``, cast back to the logits' dtype when ``weights_in_logits_dtype``."""

    renormalises: Callable[[torch.nn.Module], bool]
    weights_in_logits_dtype: bool


#: The routers replay knows, by class name (each family's ``*TopKRouter``).
ROUTERS: dict[str, RouterKind] = {
    "Qwen3MoeTopKRouter": RouterKind(lambda r: bool(r.norm_topk_prob), True),
    "MixtralTopKRouter": RouterKind(lambda r: True, False),
}


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers, in module order (the order of the routes' layer dimension)."""
    return [m for m in model.modules() if type(m).__name__ in ROUTERS]


def model_name(model: torch.nn.Module) -> str:
    """The model as errors name it: its class and, where it has one, its path or type."""
    config = getattr(model, "config", None)
    where = getattr(config, "_name_or_path", "") or getattr(config, "model_type", "")
    return f"{type(model).__name__} ({where})" if where else type(model).__name__


def require_routers(model: torch.nn.Module, what: str) -> list[torch.nn.Module]:
    """``moe_routers(model)``, or a ``ValueError`` naming the model and ``what`` needed them."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError(
            f"{what} needs a mixture-of-experts model, but {model_name(model)} has no MoE "
            f"router layers (known routers: {sorted(ROUTERS)})"
        )
    return routers


class RouteRecorder:
    """Inside ``with``, every forward of the model's routers is recorded; ``take`` hands out
    the routes of the forward that just ran, ``[tokens, layers, k]`` in the order the routers
    saw the tokens (a ``[B, S]`` input flattened)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = require_routers(model, "recording routed experts")
        self.pending: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> RouteRecorder:
        for layer, router in enumerate(self.routers):

            def hook(module, args, output, layer=layer):
                self.pending[layer].append(output[2].detach().to(ROUTE_DTYPE))

            self.handles.append(router.register_forward_hook(hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def take(self) -> torch.Tensor:
        """``[tokens, layers, k]``: the routes of the one forward since the last ``take``."""
        calls = [len(p) for p in self.pending]
        if any(n != 1 for n in calls):
            raise RuntimeError(
                f"expected one router call per MoE layer since the last take, got {calls}"
            )
        routes = torch.stack([p.pop() for p in self.pending], dim=1)
        return routes


class RouteReplay:
    """Inside ``with``, each MoE router of ``model`` uses the experts of ``routes`` instead of
    its own top-k; the weights stay the router's softmax probabilities at those experts
    (renormalised as its family does), so the router still gets gradients through them.

    ``routes``: ``[tokens, layers, k]`` or ``[B, S, layers, k]`` (flattened: the model's input
    must have as many tokens in that order); ``NO_ROUTE`` entries keep the router's own choice
    for that token. Every forward inside the block replays the same routes (an activation
    checkpoint's recomputation in backward included, if the block spans it).
    """

    def __init__(self, model: torch.nn.Module, routes: torch.Tensor) -> None:
        self.routers = require_routers(model, "policy.router_replay")
        if routes.dim() < 3:
            raise ValueError(f"routes must be [..., layers, k], got shape {tuple(routes.shape)}")
        layers, k = routes.shape[-2:]
        if layers != len(self.routers):
            raise ValueError(
                f"the routes cover {layers} MoE layers but {model_name(model)} has "
                f"{len(self.routers)}: they were recorded from another model"
            )
        top_k = {int(r.top_k) for r in self.routers}
        if top_k != {k}:
            raise ValueError(f"the routes hold {k} experts per token; the routers choose {top_k}")
        self.routes = routes.reshape(-1, layers, k)
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def _hook(self, layer: int, kind: RouterKind):
        def hook(router, args, output):
            logits, _, own = output
            if logits.shape[0] != self.routes.shape[0]:
                raise ValueError(
                    f"router replay: the forward has {logits.shape[0]} tokens but the routes "
                    f"have {self.routes.shape[0]}"
                )
            recorded = self.routes[:, layer].to(device=own.device, dtype=own.dtype)
            chosen = torch.where(recorded >= 0, recorded, own)
            # At least float32, as the families compute it (a float64 model keeps float64).
            dtype = torch.promote_types(logits.dtype, torch.float32)
            weights = torch.softmax(logits, dim=-1, dtype=dtype).gather(-1, chosen)
            if kind.renormalises(router):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            if kind.weights_in_logits_dtype:
                weights = weights.to(logits.dtype)
            return logits, weights, chosen

        return hook

    def __enter__(self) -> RouteReplay:
        for layer, router in enumerate(self.routers):
            hook = self._hook(layer, ROUTERS[type(router).__name__])
            self.handles.append(router.register_forward_hook(hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
