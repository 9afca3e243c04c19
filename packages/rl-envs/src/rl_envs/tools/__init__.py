"""Tool calling: a model's turn may call Python functions (tools); the environment runs them and
answers each call with a ``role: tool`` message, and the episode goes on until the model answers
without a call.

- :mod:`rl_envs.tools.parsers`: a turn's text -> its tool calls, per model family's format;
- :mod:`rl_envs.tools.registry`: tools named in the recipe, their JSON schemas, argument checks;
- :mod:`rl_envs.tools.execute`: one call, as a verifier process runs it (timeout, output cap);
- :mod:`rl_envs.tools.builtin`: ``calculator``, ``python`` (sandboxed) and ``search`` (BM25);
- :mod:`rl_envs.tools.env`: the environment (``env.<task>.kind: tools``).

Verifier processes import this package, so it imports nothing heavy (no torch, no Ray) here.
"""
