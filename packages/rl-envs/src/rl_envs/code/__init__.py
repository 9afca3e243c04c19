"""Model-written Python run against tests in a sandbox (see :mod:`rl_envs.code.sandbox`)."""
