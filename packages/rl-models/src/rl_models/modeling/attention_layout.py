"""Whether a model lets every token see all the tokens before it alike: what running a shared
prefix once needs, in training (``policy/shared_prefix.py``) and in sampling
(``generation/sampling.py``).

Both split a prompt's tokens from the ones after it and lay them out differently from one
whole sequence: padding or other rows' tokens between them, the prefix in a forward of its own.
A plain causal attention over the real tokens cannot tell. These layers can, so a model with
any of them keeps whole sequences:

- a sliding window or chunked attention counts columns, padding included, so a token would see
  fewer real tokens than its window;
- a recurrent or convolutional layer (linear attention, Mamba) steps through the padding;
- a rotary embedding that rescales with the longest position in a forward (``dynamic``,
  ``longrope``) would give the prefix, run alone, other frequencies than the whole prompt;
- ALiBi (BLOOM, MPT, Falcon with ``alibi``) adds a bias by distance that each family builds its
  own way, some from the mask and some from the columns; none is checked against these
  layouts, so they keep whole sequences.
"""

from __future__ import annotations

from typing import Any

#: Rotary embeddings whose frequencies depend on the positions of the forward they run in.
LENGTH_SCALED_ROPE = frozenset({"dynamic", "longrope"})


def _rope_types(rope: Any) -> set[str]:
    """The rope types named in a config's ``rope_parameters`` (or older ``rope_scaling``),
    which may be one dict or one dict per layer type."""
    if not isinstance(rope, dict):
        return set()
    kind = rope.get("rope_type", rope.get("type"))
    found = {kind} if isinstance(kind, str) else set()
    for value in rope.values():
        if isinstance(value, dict):
            found |= _rope_types(value)
    return found


def _uses_alibi(config: Any) -> bool:
    """BLOOM always; Falcon when ``alibi`` is set; MPT when its ``attn_config`` says so."""
    attn = getattr(config, "attn_config", None)
    mpt_alibi = attn.get("alibi") if isinstance(attn, dict) else getattr(attn, "alibi", False)
    return (
        getattr(config, "model_type", None) == "bloom"
        or bool(getattr(config, "alibi", False))
        or bool(mpt_alibi)
    )


def mixed_attention_reason(config: Any) -> str | None:
    """Why a model of this (Hugging Face) config does not attend plainly and causally over
    every earlier token in every layer, or None if it does (see the module docstring)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "sliding_window", None) is not None and getattr(
        config, "use_sliding_window", True
    ):
        return f"it attends through a sliding window of {config.sliding_window} tokens"
    if getattr(config, "attention_chunk_size", None) is not None:
        return f"it attends in chunks of {config.attention_chunk_size} tokens"
    others = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention"})
    if others:
        return f"it has layers of type {others}, not only full_attention"
    if _uses_alibi(config):
        return "it biases attention by distance (ALiBi), unchecked against these layouts"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    scaled = sorted(_rope_types(rope) & LENGTH_SCALED_ROPE)
    if scaled:
        return f"its rotary embedding ({scaled[0]}) rescales with the sequence's length"
    return None
