"""NeMo RL recipes, read as they are.

NeMo RL's YAML recipes (``examples/configs/grpo_math_1B.yaml`` and the like) name many things
as we do, but not all: ``policy.model_name`` is our ``policy.model.path``,
``policy.generation.*`` is our top-level ``generation.*``, the scheduler is a list there, and
many keys configure NeMo's own machinery (ports, refit transports, its data plane). This
package reads such a recipe, following its ``defaults:`` chain, and turns it into ours:

- every leaf key of the recipe is either *translated* (to the key and value that do the same
  here), *ignored* (it has no meaning here, or its value is the one that does nothing), or
  *refused* (it asks for a feature we lack; the message says what it would have done);
- :data:`rules.RULES` is that table, as data, first match wins; ``docs/nemo-rl.md`` shows it;
- datasets NeMo names (``OpenMathInstruct-2``, ``squad``, ``HelpSteer3``) are found on local
  disk and converted once to our chat / preference JSONL (:mod:`.datasets`); the sliding-puzzle
  recipe's games are generated from its ``game_config``;
- hub model ids resolve from the local Hugging Face cache (:mod:`rl_models.model_files`).

``rl <algo> --config <nemo recipe>`` uses :func:`translate_file`; ``rl convert-config`` writes
the translated recipe as a native one (:mod:`.convert`).
"""

from rl_algorithms.nemo_compat.translate import (
    Translation,
    is_nemo_recipe,
    translate,
    translate_file,
)

__all__ = ["Translation", "is_nemo_recipe", "translate", "translate_file"]
