"""Train an agent program the library did not write: it talks to the policy through an
OpenAI-compatible endpoint (``server.EndpointServer``), every request of an episode is
recorded and joined into one trainable trajectory, token in / token out
(``trajectories.Trajectory``), and its final conversation is scored by the row's environment
(``programs.run_program_rollouts``). Set ``grpo.agent_program`` (``config.AgentProgramConfig``)
to roll out through it; docs/guides/agent-programs.md shows how.

The submodules are imported where they are used: reading a config must not start importing
the web server.
"""
