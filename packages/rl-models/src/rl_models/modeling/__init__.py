"""The model policies and generators share: its config (``modeling.config``, light) and how
it is built (``modeling.build``, imports ``transformers``). Neither ``policy/`` nor
``generation/`` is imported from here, so both can build on it."""
